"""HDF5 capture files: the only module that imports h5py. Imports accucheck.errors and keys.

One capture = one HDF5 file, schema version 1. Everything below can be read with h5py alone:

    /                       attrs: format = "accucheck", schema_version = 1 (int),
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
    /index/data             [n] strings: dataset name under /tensors, "" in stats mode
    /index/extra            [n] strings (OPTIONAL: files written before it existed lack it; a
                            reader treats it as all ""): "" or a JSON object with per-record
                            details, on the first output record of a module / op call:
                            "src" (eager captures; absent when empty): {"<in slot>": "<site>"}
                            for each floating-point input that IS an earlier recorded tensor of
                            the same request and step, the site being its key without
                            "r{req}.s{step}:" ({"hidden_states":
                            "model.layers.0.input_layernorm#0:out.0"}); an input neither linked
                            nor a weight has its own "in" record (accucheck.capture.recorder).
                            Op records (kind "op") also carry
                            {"site": "transformers/.../modeling_llama.py:154 in forward",
                             "args": [...], "kwargs": {...}} where "args"/"kwargs" describe the
                            op call with tensors as {"t": "<in slot>"} (see accucheck.capture.ops)
    /index/sample           [n, 64] float64 (OPTIONAL, like extra): a fixed sample of the
                            tensor's values at flat (C-order) positions
                            (j * (numel - 1)) // 63 for j = 0..63 (every element, NaN-padded,
                            when numel < 64): the same positions on every device for the same
                            shape, so two stats-mode captures can estimate rel_l2 from it
    /tensors/<8 digits>     the tensor in its original dtype and shape (chunked, optional
                            gzip / lzf). bfloat16 is stored bit-exact as uint16 with attribute
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
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import h5py
import numpy as np

from accucheck.errors import UserError
from accucheck.keys import RecordKey

FORMAT = "accucheck"
SCHEMA_VERSION = 1
STAT_FIELDS = ("min", "max", "mean", "std", "absmax", "l2", "nan", "inf", "zero", "numel")
KINDS = ("module", "op", "logits")
STORE_MODES = ("stats", "full")
_STR = h5py.string_dtype("utf-8")
_INDEX_COLUMNS = {
    "key": _STR, "kind": _STR, "dtype": _STR, "shape": _STR, "data": _STR,
    "checksum": np.int64,
}
_OPTIONAL_COLUMNS = {"extra": _STR}  # absent in older schema-1 files
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

    @property
    def has_data(self) -> bool:
        return bool(self.data)


@dataclass(frozen=True)
class RequestTokens:
    prompt_ids: np.ndarray
    generated_ids: np.ndarray
    prompt: str | None


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """Exact float32 values of bfloat16 numbers stored as their uint16 bit patterns."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


class CaptureWriter:
    """Append-only writer for one capture file.

    Refuses to overwrite an existing file unless `force`. `add` buffers index rows and writes
    tensors at once; `flush` (called by the recorder after every step) writes the buffered rows
    and flushes HDF5, so a killed capture leaves a readable, incomplete file. Use as a context
    manager: a clean exit sets `complete`, an exception leaves it false.
    """

    def __init__(self, path: str | os.PathLike, *, meta: dict, store: str = "stats",
                 force: bool = False, compression: str | None = None):
        if store not in STORE_MODES:
            raise UserError(f"unknown store mode {store!r}: use one of {', '.join(STORE_MODES)}")
        if compression not in (None, "gzip", "lzf"):
            raise UserError(f"unknown compression {compression!r}: use gzip or lzf")
        self.path = Path(path)
        if self.path.exists() and not force:
            raise UserError(f"{self.path} exists: choose another -o or pass --force to overwrite it")
        if not self.path.parent.exists():
            raise UserError(f"output folder {self.path.parent} does not exist: create it first")
        self.store = store
        self.compression = compression
        self._f = h5py.File(self.path, "w")
        self._f.attrs["format"] = FORMAT
        self._f.attrs["schema_version"] = SCHEMA_VERSION
        self._f.attrs["complete"] = False
        self._f.create_dataset("meta", data=json.dumps(dict(meta, store=store), sort_keys=True),
                               dtype=_STR)
        idx = self._f.create_group("index")
        for name, dt in {**_INDEX_COLUMNS, **_OPTIONAL_COLUMNS}.items():
            idx.create_dataset(name, shape=(0,), maxshape=(None,), dtype=dt,
                               chunks=(_INDEX_CHUNK,))
        idx.create_dataset("stats", shape=(0, len(STAT_FIELDS)), maxshape=(None, len(STAT_FIELDS)),
                           dtype=np.float64, chunks=(_INDEX_CHUNK, len(STAT_FIELDS)))
        idx.create_dataset("sample", shape=(0, SAMPLE_SIZE), maxshape=(None, SAMPLE_SIZE),
                           dtype=np.float64, chunks=(_INDEX_CHUNK, SAMPLE_SIZE))
        self._f.create_group("tensors")
        self._f.create_group("requests")
        self._rows: list[tuple] = []
        self._n = 0
        self._seen: set[str] = set()
        self._closed = False
        self.flush_interval = 1.0
        self._last_flush = float("-inf")

    def add(self, key: RecordKey, kind: str, dtype: str, shape: Sequence[int],
            stats: np.ndarray, checksum: int, data: np.ndarray | None = None,
            extra: str = "") -> None:
        """Add one record. `stats`: the STAT_FIELDS values, optionally followed by SAMPLE_SIZE
        sampled values (see /index/sample). `data` (full mode only) is the tensor as a numpy
        array in its stored representation (bfloat16 as uint16 bit patterns, `dtype` says
        "bfloat16"). `extra`: "" or a JSON object string (see /index/extra)."""
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}")
        skey = str(key)
        if skey in self._seen:
            raise ValueError(f"duplicate record key {skey}")
        self._seen.add(skey)
        order = self._n + len(self._rows)
        name = ""
        if data is not None and self.store == "full":
            name = f"{order:08d}"
            arr = np.ascontiguousarray(data)
            chunks = _chunk_shape(arr.shape, arr.itemsize) if arr.size else None
            ds = self._f["tensors"].create_dataset(
                name, data=arr, chunks=chunks,
                compression=self.compression if arr.size else None)
            ds.attrs["dtype"] = dtype
        row = np.asarray(stats, dtype=np.float64).reshape(-1)
        if row.size not in (len(STAT_FIELDS), len(STAT_FIELDS) + SAMPLE_SIZE):
            raise ValueError(f"stats row of {row.size} values for {skey}")
        sample = row[len(STAT_FIELDS):] if row.size > len(STAT_FIELDS) \
            else np.full(SAMPLE_SIZE, np.nan)
        self._rows.append((skey, kind, dtype, json.dumps([int(s) for s in shape]), name,
                           int(checksum), row[:len(STAT_FIELDS)], extra, sample))

    def set_request(self, i: int, prompt_ids: Sequence[int], generated_ids: Sequence[int],
                    prompt: str | None = None) -> None:
        g = self._f["requests"].require_group(str(i))
        for name, ids in (("prompt_ids", prompt_ids), ("generated_ids", generated_ids)):
            if name in g:
                del g[name]
            g.create_dataset(name, data=np.asarray(list(ids), dtype=np.int64))
        if prompt is not None:
            g.attrs["prompt"] = prompt

    def update_meta(self, **fields) -> None:
        """Add what is only known at the end of a capture (e.g. shadow replay counts) to /meta."""
        meta = json.loads(_as_str(self._f["meta"][()]))
        meta.update(fields)
        del self._f["meta"]
        self._f.create_dataset("meta", data=json.dumps(meta, sort_keys=True), dtype=_STR)

    def flush(self, force: bool = False) -> None:
        """Write buffered index rows and flush HDF5. Cheap to call after every step: unless
        `force`, it writes at most once per `flush_interval` seconds (a killed capture loses at
        most that much)."""
        now = time.monotonic()
        if not force and now - self._last_flush < self.flush_interval:
            return
        self._last_flush = now
        if self._rows:
            idx = self._f["index"]
            n0, k = self._n, len(self._rows)
            cols = list(zip(*self._rows))
            for j, name in ((0, "key"), (1, "kind"), (2, "dtype"), (3, "shape"), (4, "data"),
                            (5, "checksum"), (7, "extra")):
                ds = idx[name]
                ds.resize((n0 + k,))
                ds[n0:] = np.asarray(cols[j], dtype=object if name != "checksum" else np.int64)
            for j, name in ((6, "stats"), (8, "sample")):
                ds = idx[name]
                ds.resize((n0 + k, ds.shape[1]))
                ds[n0:] = np.stack(cols[j])
            self._n += k
            self._rows.clear()
        self._f.flush()

    @property
    def n_records(self) -> int:
        return self._n + len(self._rows)

    def close(self, complete: bool = True) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.flush(force=True)
            self._f.attrs["complete"] = bool(complete)
        finally:
            self._f.close()

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


def _chunk_shape(shape: tuple[int, ...], itemsize: int, target: int = 1 << 20) -> tuple[int, ...]:
    """HDF5 chunks of about `target` bytes, shaped like the blocks `iter_chunks` reads."""
    if not shape:
        return ()
    k, step = _split_axis(shape, max(1, target // itemsize))
    return (1,) * k + (step,) + tuple(shape[k + 1:])


class CaptureReader:
    """Read-only view of a capture file. Open with `open_capture`.

    Raises UserError (exit 3) for a missing / unreadable / foreign / wrong-version file, and for
    an incomplete one unless `allow_incomplete`.
    """

    def __init__(self, path: str | os.PathLike, *, allow_incomplete: bool = False):
        self.path = Path(path)
        if not self.path.is_file():
            raise UserError(f"{self.path}: no such capture file")
        try:
            self._f = h5py.File(self.path, "r")
        except OSError as e:
            raise UserError(f"{self.path}: not a readable HDF5 file ({e.__class__.__name__}); "
                            f"was the capture killed before its first flush?") from None
        try:
            self._check(allow_incomplete)
            self.meta: dict = json.loads(_as_str(self._f["meta"][()]))
            self.rows: list[IndexRow] = self._load_index()
        except Exception:
            self._f.close()
            raise
        self._by_key = {str(r.key): r for r in self.rows}

    def _check(self, allow_incomplete: bool) -> None:
        a = self._f.attrs
        if _as_str(a.get("format", "")) != FORMAT:
            raise UserError(f"{self.path}: not an accucheck capture (no format=accucheck attribute)")
        version = int(a.get("schema_version", -1))
        if version != SCHEMA_VERSION:
            raise UserError(f"{self.path}: schema version {version}, this accucheck reads "
                            f"{SCHEMA_VERSION}; HINT: {REGENERATE_HINT}")
        self.complete = bool(a.get("complete", False))
        if not self.complete and not allow_incomplete:
            raise UserError(f"{self.path}: incomplete capture (the run was interrupted); "
                            f"re-run the capture, or `accucheck inspect` it to see what it holds")

    def _load_index(self) -> list[IndexRow]:
        idx = self._f["index"]
        n = min(idx[c].shape[0] for c in list(_INDEX_COLUMNS) + ["stats"])
        cols = {c: idx[c][:n] for c in _INDEX_COLUMNS}
        extra = idx["extra"][:n] if "extra" in idx and idx["extra"].shape[0] >= n else None
        sample = idx["sample"][:n] if "sample" in idx and idx["sample"].shape[0] >= n else None
        stats = idx["stats"][:n]
        rows = []
        for i in range(n):
            rows.append(IndexRow(
                key=RecordKey.parse(_as_str(cols["key"][i])), order=i,
                kind=_as_str(cols["kind"][i]), dtype=_as_str(cols["dtype"][i]),
                shape=tuple(json.loads(_as_str(cols["shape"][i]))),
                stats=Stats.from_row(stats[i]), checksum=int(cols["checksum"][i]),
                data=_as_str(cols["data"][i]),
                extra=_as_str(extra[i]) if extra is not None else "",
                sample=sample[i] if sample is not None and not np.isnan(sample[i]).all()
                else None))
        return rows

    @property
    def store_mode(self) -> str:
        return self.meta.get("store", "stats")

    def row(self, key: RecordKey | str) -> IndexRow:
        return self._by_key[str(key)]

    def __contains__(self, key: RecordKey | str) -> bool:
        return str(key) in self._by_key

    def read(self, key: RecordKey | str) -> np.ndarray:
        """The full tensor, exactly: bfloat16 comes back as float32 holding the same values."""
        row = self.row(key)
        if not row.has_data:
            raise UserError(f"{self.path}: {key} has statistics only; capture with --store full")
        return self._decode(self._f["tensors"][row.data][()], row.dtype)

    def iter_chunks(self, key: RecordKey | str, max_elems: int = 1 << 20) -> Iterator[np.ndarray]:
        """The tensor as flat chunks of at most about `max_elems` elements, in C order, exact
        values (bfloat16 as float32). Memory stays bounded whatever the tensor size."""
        row = self.row(key)
        if not row.has_data:
            raise UserError(f"{self.path}: {key} has statistics only; capture with --store full")
        ds = self._f["tensors"][row.data]
        if ds.ndim == 0:
            yield self._decode(np.asarray(ds[()]).reshape(1), row.dtype)
            return
        k, step = _split_axis(ds.shape, max_elems)
        for idx in np.ndindex(*ds.shape[:k]):
            for i in range(0, ds.shape[k], step):
                yield self._decode(ds[idx + (slice(i, i + step),)], row.dtype).reshape(-1)

    @staticmethod
    def _decode(arr: np.ndarray, dtype: str) -> np.ndarray:
        if dtype == "bfloat16":
            return bf16_bits_to_float32(np.asarray(arr))
        return np.asarray(arr)

    @property
    def requests(self) -> list[RequestTokens]:
        g = self._f["requests"]
        out = []
        for name in sorted(g, key=int):
            r = g[name]
            prompt = r.attrs.get("prompt")
            out.append(RequestTokens(r["prompt_ids"][()], r["generated_ids"][()],
                                     _as_str(prompt) if prompt is not None else None))
        return out

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> "CaptureReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_capture(path: str | os.PathLike, *, allow_incomplete: bool = False) -> CaptureReader:
    return CaptureReader(path, allow_incomplete=allow_incomplete)


def _as_str(v) -> str:
    return v.decode("utf-8") if isinstance(v, bytes) else str(v)
