"""CaptureReader / open_capture: reads one capture file and checks the layout it relies on
(accucheck.store's docstring)."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator

import h5py
import numpy as np

from accucheck.errors import UserError
from accucheck.errors import one_line as _one_line
from accucheck.keys import RecordKey
from accucheck.paths import spill_dirs
from accucheck.store.format import (FORMAT, IndexRow, KINDS, REGENERATE_HINT, RequestTokens,
                                    SAMPLE_SIZE, SCHEMA_VERSION, STAT_FIELDS, Stats,
                                    _INDEX_COLUMNS, _NATIVE, _as_str, _split_axis,
                                    bf16_bits_to_float32)
from accucheck.store.sketch import SKETCH_WIDTH


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
            if spill_dirs(self.path):
                raise UserError(f"{self.path}: incomplete capture (its vLLM run was killed, "
                                f"or still runs); `accucheck salvage {self.path}` keeps the "
                                f"forwards it completed")
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
        for c, width in (("extra", None), ("hash", None), ("sample", SAMPLE_SIZE),
                         ("sketch", SKETCH_WIDTH)):
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
            sample, sketch = (opt[c][:n] if c in opt and opt[c].shape[0] >= n else None
                              for c in ("sample", "sketch"))
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
                else None,
                sketch=sketch[i] if sketch is not None and not np.isnan(sketch[i, 0]) else None))
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
