"""CaptureWriter: writes one capture file (accucheck.store's docstring: layout, replacing a file,
a full disk)."""
from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

import h5py
from h5py._hl.files import make_fapl, make_fcpl  # what h5py.File uses
import numpy as np

from accucheck.errors import UserError
from accucheck.errors import one_line as _one_line
from accucheck.keys import RecordKey
from accucheck.paths import check_output_file, free_bytes, temp_beside
from accucheck.store.format import (FORMAT, KINDS, SAMPLE_SIZE, SCHEMA_MINOR, SCHEMA_VERSION,
                                    STAT_FIELDS, STORE_MODES, _INDEX_CHUNK, _INDEX_COLUMNS,
                                    _KIND_SET, _OPTIONAL_COLUMNS, _STR, _as_str, _disk_full,
                                    _split_axis, content_hash)
from accucheck.store.sketch import SKETCH_WIDTH

_ROW = len(STAT_FIELDS) + SAMPLE_SIZE + SKETCH_WIDTH  # a buffered index row
_WIDTHS = (len(STAT_FIELDS), len(STAT_FIELDS) + SAMPLE_SIZE, _ROW)  # rows `add` takes


class CaptureWriter:
    """Append-only writer for one capture file.

    Refuses to overwrite an existing file unless `force`; then the new capture is written beside
    it and renamed into place only by a complete close (see the module docstring). `add`
    buffers index rows and writes tensors at once; `flush` (called by the recorder after every
    step) writes the buffered rows and flushes HDF5, so a killed capture leaves a readable,
    incomplete file. `add_rows` adds many records without tensor data at once (a stats-mode
    step, the recorder's end_step): the same rows as one `add` each. Use as a context manager:
    a clean exit sets `complete`, an exception leaves it false. A full disk raises UserError
    ("disk full writing ...") and leaves the file incomplete with the records flushed so far;
    the writer stops short of the limit (keeping room for a clean close) when it can see it
    coming (free space, `ulimit -f`).
    """

    # bytes kept free for the index rows and metadata that a clean close still writes
    reserve = 64 * 1024

    def __init__(self, path: str | os.PathLike, *, meta: dict, store: str = "stats",
                 force: bool = False, compression: str | None = None):
        if store not in STORE_MODES:
            raise UserError(f"unknown store mode {store!r}: use one of {', '.join(STORE_MODES)}")
        if compression not in (None, "gzip", "lzf"):
            raise UserError(f"unknown compression {compression!r}: use gzip or lzf")
        self.path = check_output_file(path, force)
        self.store = store
        self.compression = compression
        self._rows: list[tuple] = []
        self._block = np.empty((256, _ROW))  # their stats + sample + sketch
        self._n = 0
        self._seen: set[str] = set()
        self._shared: dict[str, tuple[str, int]] = {}  # share -> (dataset name, hash)
        self._shapes: dict[tuple, str] = {}  # shape -> its JSON
        self._closed = False
        self.flush_interval = 1.0
        self._last_flush = float("-inf")
        self._free: int | None = None  # free bytes at the last look (see _room)
        self._free_at = float("-inf")
        self._spent = 0
        # replacing an existing file: write beside it, rename into place on a complete close
        self.replacing = self.path.exists() or self.path.is_symlink()
        if self.replacing:
            self.file = temp_beside(self.path)
        else:
            self.file = self.path
        try:
            self._f = _create_file(self.file, replace=self.replacing)
        except FileExistsError:
            raise UserError(f"{self.path} exists: choose another -o or pass --force to "
                            f"overwrite it") from None
        except OSError as e:
            self._discard()
            if _disk_full(e):
                raise UserError(f"disk full creating {self.path}: nothing written; free some "
                                f"space and re-run") from None
            raise UserError(f"cannot create {self.path}: {_one_line(e)}") from None
        try:
            with self._io():
                self._f.attrs["format"] = FORMAT
                self._f.attrs["schema_version"] = SCHEMA_VERSION
                self._f.attrs["schema_minor"] = SCHEMA_MINOR
                self._f.attrs["complete"] = False
                self._f.create_dataset("meta", data=json.dumps(dict(meta, store=store),
                                                               sort_keys=True), dtype=_STR)
                idx = self._f.create_group("index")
                for name, dt in {**_INDEX_COLUMNS, **_OPTIONAL_COLUMNS}.items():
                    idx.create_dataset(name, shape=(0,), maxshape=(None,), dtype=dt,
                                       chunks=(_INDEX_CHUNK,))
                idx.create_dataset("stats", shape=(0, len(STAT_FIELDS)),
                                   maxshape=(None, len(STAT_FIELDS)), dtype=np.float64,
                                   chunks=(_INDEX_CHUNK, len(STAT_FIELDS)))
                # the sketch (accucheck.store.sketch) in stats mode only: a full capture's
                # tensors give the exact errors
                for name, width in (("sample", SAMPLE_SIZE),) + (
                        (("sketch", SKETCH_WIDTH),) if store == "stats" else ()):
                    idx.create_dataset(name, shape=(0, width), maxshape=(None, width),
                                       dtype=np.float64, chunks=(_INDEX_CHUNK, width))
                self._f.create_group("tensors")
                self._f.create_group("requests")
                self._index = {name: idx[name] for name in idx}  # opened once, not per flush
                self._f.flush()  # on disk at once: from here on a killed capture opens
        except UserError:  # the disk is full before the first record
            self._discard()
            raise UserError(f"disk full creating {self.path}: nothing written; free some space "
                            f"(or raise `ulimit -f`) and re-run") from None
        except BaseException:
            self._closed = True
            self._close_file()
            self._discard()  # a skeleton that never held a record: nothing to keep
            raise

    # -- failure handling
    @contextmanager
    def _io(self) -> Iterator[None]:
        """Turn a full disk during HDF5 writes into one UserError (see `_disk_is_full`)."""
        try:
            yield
        except UserError:
            raise
        except Exception as e:
            if not _disk_full(e):
                raise
            self._disk_is_full()

    def _room(self, nbytes: int) -> None:
        """Stop cleanly, before HDF5 hits a full disk, when `nbytes` more would not leave room
        for the close. The free space is asked again at most once a second or when half of
        what was free at the last look has been written (statvfs can be slow on network file
        systems); a disk filled by someone else in between is `_disk_is_full`'s case."""
        need = nbytes + self._close_bytes()
        now = time.monotonic()
        if self._free is not None and now - self._free_at < 1.0 \
                and self._spent + need <= self._free // 2:
            self._spent += nbytes
            return
        self._free, self._free_at, self._spent = \
            free_bytes(self.file.parent, self._size()), now, nbytes
        if self._free is None or self._free >= need:
            return
        self._closed = True
        try:
            self._write_rows()
            self._f.flush()
        except Exception as e:
            if not _disk_full(e):
                raise
            self._disk_is_full()
        self._close_file()
        self._stopped()

    def _size(self) -> int:
        try:
            return int(self._f.id.get_filesize())
        except Exception:
            return 0

    def _close_bytes(self) -> int:
        """About what writing the buffered rows and closing needs: index chunks of _INDEX_CHUNK
        rows (the sample and sketch columns dominate) and metadata."""
        k = len(self._rows)
        chunks = -(-(self._n + k) // _INDEX_CHUNK) - (-(-self._n // _INDEX_CHUNK)) + 1
        width = _ROW if self.store == "stats" else _ROW - SKETCH_WIDTH
        row_bytes = 8 * (width + 1) + 16 * (len(_INDEX_COLUMNS) + 1)
        return self.reserve + chunks * _INDEX_CHUNK * row_bytes + k * 256

    def _disk_is_full(self) -> None:
        """A write failed for lack of space. HDF5 cannot be closed cleanly on a full disk (a
        second failing close crashes h5py), so its file descriptor is pointed at /dev/null
        first: what it still writes is dropped and the file keeps what was flushed."""
        self._closed = True
        _write_to_null(self._f.id)
        self._close_file()
        self._stopped()

    def _stopped(self) -> None:
        if self.replacing:
            self._discard()
            raise UserError(f"disk full writing {self.path}: the new capture was discarded "
                            f"after {self._n} records; {self.path} is unchanged; free some "
                            f"space (or raise `ulimit -f`) and re-run")
        raise UserError(f"disk full writing {self.path}: {self._n} records written, file left "
                        f"incomplete; free some space (or raise `ulimit -f`) and re-run the "
                        f"capture with --force")

    def _close_file(self) -> None:
        try:
            if self._f.id.valid:
                self._f.close()
        except Exception:
            pass

    def _discard(self) -> None:
        try:
            self.file.unlink()
        except OSError:
            pass

    def add(self, key: RecordKey | str, kind: str, dtype: str, shape: Sequence[int],
            stats: np.ndarray, checksum: int, data: np.ndarray | None = None,
            extra: str = "", share: str | None = None, keep: bool = False) -> None:
        """Add one record. `key`: a RecordKey or its string. `stats`: the STAT_FIELDS values,
        optionally followed by SAMPLE_SIZE sampled values (see /index/sample) and the sketch
        row (SKETCH_WIDTH values, /index/sketch); what is left out is stored NaN. `data` (full
        mode only) is the tensor as a numpy array in its stored representation (bfloat16 as
        uint16 bit patterns, `dtype` says "bfloat16"). `extra`: "" or a JSON object string
        (see /index/extra). `share`: records added with the same `share` string hold the same
        tensor (a weight seen at every call, one tensor recorded by two modules): the first
        one's `data` is stored, the later ones point to that dataset (their `data` is not
        read). `keep`: store `data` also in stats mode (MoE routing records)."""
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}")
        skey = str(key)
        if skey in self._seen:
            raise ValueError(f"duplicate record key {skey}")
        self._seen.add(skey)
        order = self._n + len(self._rows)
        name, digest = "", 0
        if self._closed:
            raise ValueError(f"{self.path}: add after close")
        if self.store == "full" and share is not None and share in self._shared:
            name, digest = self._shared[share]
        elif data is not None and (self.store == "full" or keep):
            name = f"{order:08d}"
            arr = np.ascontiguousarray(data) if np.ndim(data) else np.asarray(data)  # 0-d stays
            self._room(arr.nbytes + 4096)
            with self._io():
                if self.compression is None and arr.size and arr.dtype.kind in "fiu":
                    _write_contiguous(self._f["tensors"], name, arr, dtype)
                else:
                    chunked = arr.size and arr.ndim  # scalars and empty arrays are not
                    ds = self._f["tensors"].create_dataset(
                        name, data=arr,
                        chunks=_chunk_shape(arr.shape, arr.itemsize) if chunked else None,
                        compression=self.compression if chunked else None)
                    ds.attrs["dtype"] = dtype
            digest = content_hash(arr)
            if share is not None:
                self._shared[share] = (name, digest)
        row = stats if type(stats) is np.ndarray and stats.ndim == 1 \
            and stats.dtype == np.float64 else np.asarray(stats, dtype=np.float64).reshape(-1)
        if row.size not in _WIDTHS:
            raise ValueError(f"stats row of {row.size} values for {skey}")
        shape_key = tuple(shape)
        shape_json = self._shapes.get(shape_key)
        if shape_json is None:
            shape_json = self._shapes[shape_key] = json.dumps([int(s) for s in shape])
        k = len(self._rows)
        if k == len(self._block):  # statistics and samples of the buffered rows, one block
            grown = np.empty((2 * k, self._block.shape[1]))
            grown[:k] = self._block
            self._block = grown
        self._block[k, :row.size] = row
        self._block[k, row.size:] = np.nan
        self._rows.append((skey, kind, dtype, shape_json, name, int(checksum), digest, extra,
                           None))

    @property
    def keys(self) -> frozenset[str]:
        """The keys of every record added so far."""
        return frozenset(self._seen)

    def add_rows(self, keys: Sequence[str], kinds: Sequence[str], dtypes: Sequence[str],
                 shapes: Sequence[Sequence[int]], stats: np.ndarray, checksums: Sequence[int],
                 extras: Sequence[str]) -> None:
        """Many records without tensor data at once (a stats-mode step): the same rows as
        `add(keys[i], kinds[i], dtypes[i], shapes[i], stats[i], checksums[i], extra=extras[i])`
        for each i, in order, with one check and one block copy. `keys`: strings; `stats`:
        [n, STAT_FIELDS (+ SAMPLE_SIZE (+ SKETCH_WIDTH))] float64; `checksums`: ints."""
        n = len(keys)
        if not n:
            return
        if not set(kinds) <= _KIND_SET:
            raise ValueError(f"kind must be one of {KINDS}")
        new = set(keys)
        if len(new) != n or not self._seen.isdisjoint(new):
            seen = set(self._seen)
            for skey in keys:
                if skey in seen:
                    raise ValueError(f"duplicate record key {skey}")
                seen.add(skey)
        if self._closed:
            raise ValueError(f"{self.path}: add after close")
        block = np.asarray(stats, dtype=np.float64)
        width = block.shape[1] if block.ndim == 2 and len(block) == n else -1
        if width not in _WIDTHS:
            raise ValueError(f"stats block of shape {block.shape} for {n} records")
        self._seen |= new
        cache = self._shapes
        shape_json = []
        for s in shapes:
            j = cache.get(s)
            if j is None:
                s = tuple(s)
                j = cache[s] = json.dumps([int(v) for v in s])
            shape_json.append(j)
        k = len(self._rows)
        if k + n > len(self._block):
            grown = np.empty((max(2 * len(self._block), k + n), self._block.shape[1]))
            grown[:k] = self._block[:k]
            self._block = grown
        self._block[k:k + n, :width] = block
        self._block[k:k + n, width:] = np.nan
        none = (None,) * n
        self._rows.extend(zip(keys, kinds, dtypes, shape_json, ("",) * n, checksums,
                              (0,) * n, extras, none))

    def set_request(self, i: int, prompt_ids: Sequence[int], generated_ids: Sequence[int],
                    prompt: str | None = None) -> None:
        self._room(8 * (len(prompt_ids) + len(generated_ids)) + 8192)
        with self._io():
            g = self._f["requests"].require_group(str(i))
            for name, ids in (("prompt_ids", prompt_ids), ("generated_ids", generated_ids)):
                if name in g:
                    del g[name]
                g.create_dataset(name, data=np.asarray(list(ids), dtype=np.int64))
            if prompt is not None:
                g.attrs["prompt"] = prompt

    def update_meta(self, **fields) -> None:
        """Add what is only known at the end of a capture (e.g. shadow replay counts) to /meta."""
        with self._io():
            meta = json.loads(_as_str(self._f["meta"][()]))
            meta.update(fields)
            text = json.dumps(meta, sort_keys=True)
            self._room(2 * len(text) + 8192)
            del self._f["meta"]
            self._f.create_dataset("meta", data=text, dtype=_STR)

    def flush(self, force: bool = False) -> None:
        """Write buffered index rows and flush HDF5. Cheap to call after every step: unless
        `force`, it writes at most once per `flush_interval` seconds (a killed capture loses at
        most that much)."""
        now = time.monotonic()
        if not force and now - self._last_flush < self.flush_interval:
            return
        self._last_flush = now
        self._room(0)
        with self._io():
            self._write_rows()
            self._f.flush()

    def _write_rows(self) -> None:
        if self._rows:
            idx = self._index
            n0, k = self._n, len(self._rows)
            cols = list(zip(*self._rows))
            for j, name in ((0, "key"), (1, "kind"), (2, "dtype"), (3, "shape"), (4, "data"),
                            (5, "checksum"), (6, "hash"), (7, "extra")):
                ds = idx[name]
                ds.resize((n0 + k,))
                ds[n0:] = np.asarray(cols[j], dtype=np.int64) if name in ("checksum", "hash") \
                    else \
                    np.asarray([v.encode() for v in cols[j]], dtype=object)  # UTF-8, as h5py
            ns = len(STAT_FIELDS)
            for name, block in (("stats", self._block[:k, :ns]),
                                ("sample", self._block[:k, ns:ns + SAMPLE_SIZE]),
                                ("sketch", self._block[:k, ns + SAMPLE_SIZE:])):
                ds = idx.get(name)
                if ds is None:  # no sketch in full mode
                    continue
                ds.resize((n0 + k, ds.shape[1]))
                ds[n0:] = block
            self._n += k
            self._rows.clear()

    @property
    def n_records(self) -> int:
        return self._n + len(self._rows)

    def close(self, complete: bool = True) -> None:
        """Write what is buffered and close; `complete` marks the capture finished. Replacing
        an existing file: a complete close renames the new file into place, an incomplete one
        removes it (the old file stays). Idempotent."""
        if self._closed:
            return
        done = False
        try:
            self.flush(force=True)
            with self._io():
                self._f.attrs["complete"] = bool(complete)
            self._closed = True
            with self._io():
                self._f.close()
            done = True
        finally:
            self._closed = True
            self._close_file()
            if self.replacing and self.file.exists():
                if done and complete:
                    os.replace(self.file, self.path)
                else:
                    self._discard()

    def __enter__(self) -> "CaptureWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(complete=exc_type is None)


def _write_to_null(fid) -> None:
    """Point the file descriptor of the open HDF5 file `fid` at /dev/null: after a write failed
    for lack of space, what HDF5 still writes (closing ids, the file) is dropped, and the file
    keeps what was flushed."""
    try:
        fd = fid.get_vfd_handle()
        null = os.open(os.devnull, os.O_RDWR)
        try:
            os.dup2(null, int(fd))
        finally:
            os.close(null)
    except Exception:
        pass


def _create_file(path: Path, replace: bool) -> h5py.File:
    """A new HDF5 file (FileExistsError when `path` exists and not `replace`) that writes raw
    data when asked: no chunk cache and no sieve buffer, so a failed write (a full disk)
    raises in add / flush, never later when HDF5 releases an id (h5py reports that from a
    destructor, or crashes). Otherwise what h5py.File(path, "w" / "w-") makes."""
    fapl = make_fapl(None, rdcc_nbytes=0)  # the default driver, no chunk cache
    fapl.set_sieve_buf_size(0)
    flags = h5py.h5f.ACC_TRUNC if replace else h5py.h5f.ACC_EXCL
    try:
        fid = h5py.h5f.create(os.fsencode(path), flags, fapl=fapl, fcpl=make_fcpl())
    except FileExistsError:
        raise
    except OSError as e:
        if not replace and path.exists():
            raise FileExistsError(str(path)) from e
        raise
    return h5py.File(fid)


_ATTR_STR = h5py.h5t.py_create(_STR, logical=True)  # the file type of a str attribute
_ATTR_MEM = h5py.h5t.py_create(_STR)                # and its in-memory (object) type


def _write_contiguous(group: h5py.Group, name: str, arr: np.ndarray, dtype: str) -> None:
    """`group[name] = arr` uncompressed, in one contiguous block, with its "dtype" attribute:
    what create_dataset + attrs write, through h5py's low-level API (a third of the cost per
    dataset, which matters at one dataset per record, and ~4 KiB less than a chunked one).
    The file has no sieve buffer (`_create_file`): the data is written here."""
    h5s, h5t = h5py.h5s, h5py.h5t
    space = ds = attr = None
    try:
        space = h5s.create_simple(arr.shape) if arr.ndim else h5s.create(h5s.SCALAR)
        ds = h5py.h5d.create(group.id, name.encode(), h5t.py_create(arr.dtype), space)
        ds.write(h5s.ALL, h5s.ALL, arr)
        attr = h5py.h5a.create(ds, b"dtype", _ATTR_STR, h5s.create(h5s.SCALAR))
        attr.write(np.array(dtype, dtype=_STR), mtype=_ATTR_MEM)
    except Exception as e:
        # a full disk: what HDF5 still writes goes to /dev/null (see
        # CaptureWriter._disk_is_full), and the ids are released here, not later by the
        # traceback that keeps this frame alive
        if _disk_full(e):
            _write_to_null(group.file.id)
        space = ds = attr = None  # noqa: F841
        raise


def _chunk_shape(shape: tuple[int, ...], itemsize: int, target: int = 1 << 20) -> tuple[int, ...]:
    """HDF5 chunks of about `target` bytes, shaped like the blocks `iter_chunks` reads."""
    if not shape:
        return ()
    k, step = _split_axis(shape, max(1, target // itemsize))
    return (1,) * k + (step,) + tuple(shape[k + 1:])
