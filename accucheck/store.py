"""HDF5 capture files: the only module that imports h5py. Imports accucheck.errors, keys, paths.

One capture = one HDF5 file, schema version 1. Everything below can be read with h5py alone:

    /                       attrs: format = "accucheck", schema_version = 1 (int),
                                   schema_minor = 1 (int; absent = 0: written before
                                   /index/hash; readers accept every minor of their version),
                                   complete = True only after a clean close
    /meta                   scalar UTF-8 string: JSON object (tool version, time, device,
                            environment fingerprint, seed, dtype, mode, runner, store mode,
                            model id / path / config hash / weight hash, capture options)
    /index/key              [n] UTF-8 strings: record keys (see accucheck.keys), one row per record
    /index/kind             [n] strings: "module" | "op" | "logits"
    /index/dtype            [n] strings: torch dtype name of the captured tensor ("bfloat16", ...)
    /index/shape            [n] strings: JSON list of ints
    /index/stats            [n, 10] float64: min, max, mean, std, absmax, l2, nan, inf, zero, numel
                            (min / max / mean / std over the finite elements; computed in float32
                            for 16-bit inputs, float64 otherwise)
    /index/checksum         [n] int64: sum of the raw bit patterns (as integers) mod 2**52
                            (permutation-invariant: equal checksums do NOT prove equal tensors)
    /index/data             [n] strings: dataset name under /tensors, "" in stats mode; rows
                            holding the same tensor name the same dataset (a weight recorded
                            as an op input at every call is stored once, as is one tensor
                            recorded by two modules: o_proj's output is self_attn's)
    /index/extra            [n] strings (OPTIONAL: files written before it existed lack it; a
                            reader treats it as all ""): "" or a JSON object with per-record
                            details, on the first output record of a module / op call:
                            "src" (eager captures; absent when empty): {"<in slot>": "<site>"}
                            for each floating-point input that IS an earlier recorded tensor of
                            the same request and step, the site being its key without
                            "r{req}.s{step}:" ({"hidden_states":
                            "model.layers.0.input_layernorm#0:out.0"}); an input neither linked
                            nor a weight has its own "in" record
                            (accucheck.capture.record.recorder).
                            Op records (kind "op") also carry
                            {"site": "transformers/.../modeling_llama.py:154 in forward",
                             "args": [...], "kwargs": {...}} where "args"/"kwargs" describe the
                            op call with tensors as {"t": "<in slot>"}
                            (see accucheck.capture.record.ops)
    /index/hash             [n] int64 (OPTIONAL, schema_minor >= 1; files without it read as
                            all 0): a content hash of the stored tensor: the first 8 bytes of
                            the SHA-256 of its C-order bytes in the stored representation
                            (bfloat16 as its uint16 bit patterns), as a signed little-endian
                            int64, never 0; 0 when no tensor is stored. Position-sensitive:
                            two records with the same non-zero hash, dtype and shape hold the
                            same tensor (up to a 2**-64 collision), so a diff need not read
                            them (compare.parallel.unread_pair)
    /index/sample           [n, 64] float64 (OPTIONAL, like extra): a fixed sample of the
                            tensor's values at flat (C-order) positions
                            (j * (numel - 1)) // 63 for j = 0..63 (every element, NaN-padded,
                            when numel < 64): the same positions on every device for the same
                            shape, so two stats-mode captures can estimate rel_l2 from it
    /tensors/<8 digits>     the tensor in its original dtype and shape (contiguous; chunked
                            with --compression gzip / lzf). bfloat16 is stored bit-exact as uint16 with attribute
                            dtype = "bfloat16": `(u16.astype(uint32) << 16).view(float32)`
                            gives the exact values.
    /requests/<i>/prompt_ids     int64 token ids of prompt i
    /requests/<i>/generated_ids  int64 token ids generated (or forced) at steps 1..N
                                 (attribute `prompt`: the prompt text when known)

Row order in /index is execution order (HDF5 iterates group members alphabetically, so
"layers.10" would sort before "layers.2"; the index is an array and keeps call order).
The index is appended as the capture runs and flushed at step ends (at most once a second), so a
capture killed midway still opens: `complete` is then false and readers refuse it unless asked not to.
Nothing in a file is ever deserialised as code: strings, numbers and arrays only.

Writing never loses an existing file: a writer that replaces one (force) writes a temporary file
beside it (".NAME.*.partial" in the same folder) and renames it into place only on a clean,
complete close; an interrupted or failed capture removes the temporary file and leaves the old
one as it was. A new file is written in place, so a capture killed midway leaves it incomplete.
A full disk (or `ulimit -f`) ends the capture with one UserError; the file keeps the records
flushed so far and opens as incomplete.

A reader checks, when it opens a file, the layout it relies on (attributes, /meta, every /index
column, record keys, statistics, /requests) and raises a UserError that names the file and what
is wrong; a tensor is checked against its index row (present, same shape) when it is read.
"""
from __future__ import annotations

import datetime as _dt
import errno
import json
import os
import re
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import h5py
from h5py._hl.files import make_fapl, make_fcpl  # what h5py.File uses
import numpy as np

from accucheck.errors import UserError
from accucheck.errors import one_line as _one_line
from accucheck.keys import RecordKey
from accucheck.paths import check_output_file, free_bytes, temp_beside

FORMAT = "accucheck"
SCHEMA_VERSION = 1
SCHEMA_MINOR = 1  # 1: /index/hash; a reader reads every minor of its SCHEMA_VERSION
STAT_FIELDS = ("min", "max", "mean", "std", "absmax", "l2", "nan", "inf", "zero", "numel")
KINDS = ("module", "op", "logits")
_KIND_SET = frozenset(KINDS)
STORE_MODES = ("stats", "full")
_STR = h5py.string_dtype("utf-8")
_INDEX_COLUMNS = {
    "key": _STR, "kind": _STR, "dtype": _STR, "shape": _STR, "data": _STR,
    "checksum": np.int64,
}
_OPTIONAL_COLUMNS = {"extra": _STR, "hash": np.int64}  # absent in older schema-1 files
SAMPLE_SIZE = 64  # values per record in the optional /index/sample column
_NATIVE = {"float16": np.float16, "float32": np.float32, "float64": np.float64,
           "int8": np.int8, "uint8": np.uint8, "int16": np.int16, "int32": np.int32,
           "int64": np.int64, "bool": np.bool_}
_INDEX_CHUNK = 256  # rows per HDF5 chunk of the index: small files stay small, big ones fast
REGENERATE_HINT = "re-run `accucheck capture` with this accucheck version to regenerate it"


@dataclass(frozen=True)
class Stats:
    min: float
    max: float
    mean: float
    std: float
    absmax: float
    l2: float
    nan: int
    inf: int
    zero: int
    numel: int

    @classmethod
    def from_row(cls, row: Sequence[float]) -> "Stats":
        v = [float(x) for x in row]
        return cls(v[0], v[1], v[2], v[3], v[4], v[5], int(v[6]), int(v[7]), int(v[8]), int(v[9]))

    def as_dict(self) -> dict:
        return {f: getattr(self, f) for f in STAT_FIELDS}


@dataclass(frozen=True)
class IndexRow:
    key: RecordKey
    order: int
    kind: str
    dtype: str
    shape: tuple[int, ...]
    stats: Stats
    checksum: int
    data: str  # dataset name under /tensors, "" when only statistics were stored
    extra: str = ""  # JSON object with per-record details (input links, op call site / args) or ""
    sample: np.ndarray | None = field(default=None, compare=False, repr=False)
    # SAMPLE_SIZE values at fixed positions (see /index/sample); None when not captured
    hash: int = field(default=0, compare=False)
    # content hash of the stored tensor (see /index/hash); 0: none (statistics only, old file)

    @property
    def has_data(self) -> bool:
        return bool(self.data)


@dataclass(frozen=True)
class RequestTokens:
    prompt_ids: np.ndarray
    generated_ids: np.ndarray
    prompt: str | None


def sample_positions(numel: int, size: int = SAMPLE_SIZE) -> np.ndarray:
    """The flat positions of a record's /index/sample values (see the format above): every
    element when the tensor has fewer than `size` (the rest is NaN padding)."""
    if numel < size:
        return np.arange(size)
    return np.arange(size) * (numel - 1) // (size - 1)


def content_hash(arr: np.ndarray) -> int:
    """/index/hash of a stored tensor: the first 8 bytes of the SHA-256 of its C-order bytes,
    as a signed int64, never 0 (0 means "no hash"). SHA-256, not blake2b: OpenSSL's runs on
    the CPUs' SHA extensions (~1.7 GB/s per core here against ~0.5-1 for blake2b), and this
    runs on every stored tensor of a capture."""
    import hashlib

    a = np.ascontiguousarray(arr)
    h = hashlib.sha256(memoryview(a).cast("B") if a.ndim and a.size else a.tobytes())
    return int.from_bytes(h.digest()[:8], "little", signed=True) or 1


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """Exact float32 values of bfloat16 numbers stored as their uint16 bit patterns."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


_DISK_FULL = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}
_ERRNO_IN_MESSAGE = re.compile(r"errno = (\d+)")


def _disk_full(e: BaseException) -> bool:
    """True for a write that failed because the disk (or `ulimit -f`, or a quota) is full; HDF5
    reports the errno of the failed write(2) inside its message."""
    if isinstance(e, OSError) and e.errno in _DISK_FULL:
        return True
    m = _ERRNO_IN_MESSAGE.search(str(e))
    return bool(m) and int(m.group(1)) in _DISK_FULL


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
        self._block = np.empty((256, len(STAT_FIELDS) + SAMPLE_SIZE))  # their stats + sample
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
                idx.create_dataset("sample", shape=(0, SAMPLE_SIZE), maxshape=(None, SAMPLE_SIZE),
                                   dtype=np.float64, chunks=(_INDEX_CHUNK, SAMPLE_SIZE))
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
        rows (the sample column dominates) and metadata."""
        k = len(self._rows)
        chunks = -(-(self._n + k) // _INDEX_CHUNK) - (-(-self._n // _INDEX_CHUNK)) + 1
        row_bytes = 8 * (len(STAT_FIELDS) + SAMPLE_SIZE + 1) + 16 * (len(_INDEX_COLUMNS) + 1)
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
        optionally followed by SAMPLE_SIZE sampled values (see /index/sample). `data` (full
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
        if row.size not in (len(STAT_FIELDS), len(STAT_FIELDS) + SAMPLE_SIZE):
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
        if row.size == len(STAT_FIELDS):
            self._block[k, len(STAT_FIELDS):] = np.nan
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
        [n, STAT_FIELDS (+ SAMPLE_SIZE)] float64; `checksums`: ints."""
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
        if width not in (len(STAT_FIELDS), len(STAT_FIELDS) + SAMPLE_SIZE):
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
        if width == len(STAT_FIELDS):
            self._block[k:k + n, len(STAT_FIELDS):] = np.nan
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
            for name, block in (("stats", self._block[:k, :len(STAT_FIELDS)]),
                                ("sample", self._block[:k, len(STAT_FIELDS):])):
                ds = idx[name]
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


def _split_axis(shape: tuple[int, ...], max_elems: int) -> tuple[int, int]:
    """(k, step): blocks of at most `max_elems` elements in C order are `step` indices of axis k
    with every later axis whole, one block per index of the axes before k."""
    k = 0
    while k < len(shape) - 1 and int(np.prod(shape[k + 1:])) > max_elems:
        k += 1
    inner = int(np.prod(shape[k + 1:])) if k + 1 < len(shape) else 1
    return k, max(1, min(shape[k], max_elems // max(inner, 1)))


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


class CaptureReader:
    """Read-only view of a capture file. Open with `open_capture`.

    Raises UserError (exit 3) for a missing / unreadable / foreign / wrong-version / damaged
    file (naming what is wrong), and for an incomplete one unless `allow_incomplete`.
    """

    def __init__(self, path: str | os.PathLike, *, allow_incomplete: bool = False):
        self.path = Path(path)
        if not self.path.exists():
            raise UserError(f"{self.path}: no such capture file")
        if not self.path.is_file():
            raise UserError(f"{self.path}: not a file (a directory?): give a capture file (.h5)")
        try:
            self._f = h5py.File(self.path, "r")
        except OSError as e:
            raise UserError(_open_error(self.path, e)) from None
        try:
            self._check(allow_incomplete)
            self.meta: dict = self._load_meta()
            self.rows: list[IndexRow] = self._load_index()
            self._requests: list[RequestTokens] = self._load_requests()
        except Exception:
            self._f.close()
            raise
        self._by_key = {str(r.key): r for r in self.rows}

    def _damaged(self, what: str) -> UserError:
        return UserError(f"{self.path}: damaged capture: {what}; re-capture it (or copy it "
                         f"again)")

    def _check(self, allow_incomplete: bool) -> None:
        a = self._f.attrs
        if _as_str(a.get("format", "")) != FORMAT:
            raise UserError(f"{self.path}: not an accucheck capture (no format=accucheck attribute)")
        raw = a.get("schema_version", None)
        if raw is None:
            raise self._damaged("no schema_version attribute")
        if not (isinstance(raw, (int, np.integer)) and not isinstance(raw, (bool, np.bool_))):
            raise self._damaged(f"schema_version is {_short(raw)}, not an integer")
        version = int(raw)
        if version != SCHEMA_VERSION:
            raise UserError(f"{self.path}: schema version {version}, this accucheck reads "
                            f"{SCHEMA_VERSION}; HINT: {REGENERATE_HINT}")
        self.complete = bool(a.get("complete", False))
        if not self.complete and not allow_incomplete:
            why = "interrupted, killed or out of disk space"
            try:  # a capture whose coverage check failed says what is missing
                cov = json.loads(_as_str(self._f["meta"][()])).get("coverage") or {}
            except (KeyError, ValueError, TypeError):
                cov = {}
            if cov and not cov.get("ok", True):
                from accucheck.coverage import coverage_line

                why = coverage_line(cov)
            raise UserError(f"{self.path}: incomplete capture ({why}); re-run the capture, or "
                            f"`accucheck inspect` it to see what it holds (--allow-incomplete "
                            f"compares it anyway)")

    def _dataset(self, name: str, *, group: h5py.Group | None = None,
                 where: str = "") -> h5py.Dataset:
        g = self._f if group is None else group
        obj = g.get(name)
        if obj is None:
            raise self._damaged(f"{where}/{name} is missing")
        if not isinstance(obj, h5py.Dataset):
            raise self._damaged(f"{where}/{name} is not a dataset")
        return obj

    def _load_meta(self) -> dict:
        ds = self._dataset("meta")
        try:
            meta = json.loads(_as_str(ds[()]))
        except (json.JSONDecodeError, UnicodeDecodeError, TypeError, ValueError):
            raise self._damaged("/meta is not JSON") from None
        if not isinstance(meta, dict):
            raise self._damaged("/meta is not a JSON object")
        return meta

    def _load_index(self) -> list[IndexRow]:
        idx = self._f.get("index")
        if not isinstance(idx, h5py.Group):
            raise self._damaged("/index is missing")
        cols = {c: self._dataset(c, group=idx, where="/index")
                for c in list(_INDEX_COLUMNS) + ["stats"]}
        for c, ds in cols.items():
            want = (2, len(STAT_FIELDS)) if c == "stats" else (1, None)
            if ds.ndim != want[0] or (want[1] is not None and ds.shape[1] != want[1]):
                raise self._damaged(f"/index/{c} has shape {ds.shape}")
        opt = {}
        for c, width in (("extra", None), ("hash", None), ("sample", SAMPLE_SIZE)):
            if c in idx:
                ds = self._dataset(c, group=idx, where="/index")
                if ds.ndim != (1 if width is None else 2) or (width and ds.shape[1] != width):
                    raise self._damaged(f"/index/{c} has shape {ds.shape}")
                opt[c] = ds
        lengths = {c: ds.shape[0] for c, ds in cols.items()}
        n = min(lengths.values())
        if self.complete and len(set(lengths.values())) > 1:
            raise self._damaged("the /index columns have different lengths ("
                                + ", ".join(f"{c} {k}" for c, k in lengths.items()) + ")")
        try:
            data = {c: ds[:n] for c, ds in cols.items()}
            extra = opt["extra"][:n] if "extra" in opt and opt["extra"].shape[0] >= n else None
            digests = opt["hash"][:n] if "hash" in opt and opt["hash"].shape[0] >= n else None
            sample = opt["sample"][:n] if "sample" in opt and opt["sample"].shape[0] >= n \
                else None
        except (OSError, ValueError, TypeError) as e:
            raise self._damaged(f"/index cannot be read ({_one_line(e, 120)})") from None
        stats = np.asarray(data["stats"], dtype=np.float64)
        counts = stats[:, 6:]  # nan, inf, zero, numel
        bad = ~np.isfinite(counts) | (counts < 0) | (counts != np.round(counts))
        if bad.any():
            i = int(np.argwhere(bad)[0][0])
            raise self._damaged(f"/index/stats row {i} has counts {counts[i].tolist()} (nan, inf,"
                                f" zero, numel must be whole numbers >= 0)")
        tensors = self._f.get("tensors")
        names = set(tensors.keys()) if isinstance(tensors, h5py.Group) else set()
        rows = []
        for i in range(n):
            try:
                key = RecordKey.parse(_as_str(data["key"][i]))
            except UserError:
                raise self._damaged(f"/index/key row {i} is {_short(data['key'][i])}, not a "
                                    f"record key (r0.s0:model.layers.0#0:out.0)") from None
            kind = _as_str(data["kind"][i])
            if kind not in KINDS:
                raise self._damaged(f"record {key} has kind {kind!r}, not one of {KINDS}")
            try:
                shape = tuple(json.loads(_as_str(data["shape"][i])))
                if not all(isinstance(d, int) and d >= 0 for d in shape):
                    raise ValueError
            except (ValueError, TypeError):
                raise self._damaged(f"record {key} has shape {_short(data['shape'][i])}, not a "
                                    f"list of sizes") from None
            name = _as_str(data["data"][i])
            if name and name not in names:
                raise self._damaged(f"record {key}: its tensor /tensors/{name} is missing")
            rows.append(IndexRow(
                key=key, order=i, kind=kind, dtype=_as_str(data["dtype"][i]), shape=shape,
                stats=Stats.from_row(stats[i]), checksum=int(data["checksum"][i]), data=name,
                extra=_as_str(extra[i]) if extra is not None else "",
                hash=int(digests[i]) if digests is not None and name else 0,
                sample=sample[i] if sample is not None and not np.isnan(sample[i]).all()
                else None))
        if len({str(r.key) for r in rows}) != len(rows):
            raise self._damaged("/index/key lists a record twice")
        return rows

    def _load_requests(self) -> list[RequestTokens]:
        g = self._f.get("requests")
        if not isinstance(g, h5py.Group):
            raise self._damaged("/requests is missing")
        names = list(g)
        if not all(n.isdigit() for n in names):
            raise self._damaged(f"/requests holds {_short(next(n for n in names if not n.isdigit()))}"
                                f", not a request number")
        out = []
        for name in sorted(names, key=int):
            r = g[name]
            if not isinstance(r, h5py.Group):
                raise self._damaged(f"/requests/{name} is not a group")
            ids = []
            for col in ("prompt_ids", "generated_ids"):
                ds = self._dataset(col, group=r, where=f"/requests/{name}")
                if ds.ndim != 1 or ds.dtype.kind not in "iu":
                    raise self._damaged(f"/requests/{name}/{col} is not a list of token ids")
                ids.append(ds[()])
            prompt = r.attrs.get("prompt")
            out.append(RequestTokens(ids[0], ids[1],
                                     _as_str(prompt) if prompt is not None else None))
        return out

    @property
    def store_mode(self) -> str:
        return self.meta.get("store", "stats")

    def row(self, key: RecordKey | str) -> IndexRow:
        return self._by_key[str(key)]

    def __contains__(self, key: RecordKey | str) -> bool:
        return str(key) in self._by_key

    def _tensor(self, row: IndexRow) -> h5py.Dataset:
        """The dataset of `row`, checked against its index row."""
        if not row.has_data:
            raise UserError(f"{self.path}: {row.key} has statistics only; capture with --store full")
        ds = self._f["tensors"].get(row.data)
        if not isinstance(ds, h5py.Dataset):
            raise self._damaged(f"record {row.key}: its tensor /tensors/{row.data} is missing")
        if tuple(ds.shape) != tuple(row.shape):
            raise self._damaged(f"record {row.key}: /tensors/{row.data} has shape "
                                f"{list(ds.shape)}, the index says {list(row.shape)}")
        want = np.uint16 if row.dtype == "bfloat16" else _NATIVE.get(row.dtype)
        if want is not None and ds.dtype != np.dtype(want):
            raise self._damaged(f"record {row.key}: /tensors/{row.data} holds {ds.dtype}, the "
                                f"index says {row.dtype}")
        return ds

    def check_tensor(self, row: IndexRow) -> None:
        """The tensor of `row` is there with the shape and dtype its index row says (UserError,
        exit 3, otherwise), checked without reading its values: what a diff that measures a
        pair by its content hashes (compare.parallel.unread_pair) still checks."""
        self._tensor(row)

    def _get(self, ds: h5py.Dataset, sel, row: IndexRow) -> np.ndarray:
        try:
            return ds[sel]
        except (OSError, ValueError, RuntimeError) as e:
            raise self._damaged(f"record {row.key}: /tensors/{row.data} cannot be read "
                                f"({_one_line(e, 120)})") from None

    def read(self, key: RecordKey | str) -> np.ndarray:
        """The full tensor, exactly: bfloat16 comes back as float32 holding the same values."""
        row = self.row(key)
        return self._decode(self._get(self._tensor(row), (), row), row.dtype)

    def iter_chunks(self, key: RecordKey | str, max_elems: int = 1 << 20) -> Iterator[np.ndarray]:
        """The tensor as flat chunks of at most about `max_elems` elements, in C order, exact
        values (bfloat16 as float32). Memory stays bounded whatever the tensor size."""
        row = self.row(key)
        ds = self._tensor(row)
        if ds.ndim == 0:
            yield self._decode(np.asarray(self._get(ds, (), row)).reshape(1), row.dtype)
            return
        k, step = _split_axis(ds.shape, max_elems)
        for idx in np.ndindex(*ds.shape[:k]):
            for i in range(0, ds.shape[k], step):
                yield self._decode(self._get(ds, idx + (slice(i, i + step),), row),
                                   row.dtype).reshape(-1)

    @staticmethod
    def _decode(arr: np.ndarray, dtype: str) -> np.ndarray:
        if dtype == "bfloat16":
            return bf16_bits_to_float32(np.asarray(arr))
        return np.asarray(arr)

    @property
    def requests(self) -> list[RequestTokens]:
        return list(self._requests)

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> "CaptureReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def meta_header(runner: str) -> dict:
    """The first keys of every capture's meta, whoever writes it (the HF and vLLM runners, the
    msprobe importer): the tool and its version, when (UTC, seconds) and which runner."""
    import accucheck

    return {"tool": "accucheck", "tool_version": accucheck.__version__,
            "time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "runner": runner}


def open_capture(path: str | os.PathLike, *, allow_incomplete: bool = False) -> CaptureReader:
    return CaptureReader(path, allow_incomplete=allow_incomplete)


def _open_error(path: Path, e: OSError) -> str:
    """One line for an HDF5 file that does not open: in use, not HDF5, or cut short."""
    text = str(e)
    if isinstance(e, BlockingIOError) or "unable to lock file" in text:
        return (f"{path}: in use by another process (a capture still writing it?): wait until "
                f"it finishes (`accucheck inspect` then reads it), or read a copy")
    if "truncated file" in text:
        return (f"{path}: cut short ({_one_line(text.split('(', 1)[-1].rstrip(')'), 100)}): "
                f"the copy is incomplete or the disk filled up; copy it again or re-capture")
    if "signature not found" in text:
        if path.stat().st_size == 0:
            return f"{path}: empty file (was the capture killed before it started?); re-capture"
        return (f"{path}: not a readable HDF5 file (no HDF5 signature): give a capture written "
                f"by `accucheck capture`")
    return (f"{path}: not a readable HDF5 file ({e.__class__.__name__}: {_one_line(text, 120)}); "
            f"was the capture killed before its first flush?")


def _short(v, limit: int = 60) -> str:
    if isinstance(v, np.generic):
        v = v.item()
    text = repr(_as_str(v) if isinstance(v, bytes) else v)
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _as_str(v) -> str:
    return v.decode("utf-8") if isinstance(v, bytes) else str(v)
