"""Tensors of a multi-process capture on disk, rank by rank: each worker appends its records'
tensors to `<dir>/rank<r>.bin` as its forwards complete (`Spill`), and the front end reads them
back one record at a time while it merges and writes the capture (`SpillReader`). Used by the
vLLM runner (capture.runners.vllm_plugin in the workers, capture.runners.vllm in the front end).
numpy only (tests/test_ranks.py): the file is raw bytes, private to one capture and removed
with it, so it needs no format; where each tensor lies travels with its record. Beside it,
`<dir>/rank<r>.idx`: each forward's records (key, statistics, where the tensor lies) as one
JSON line once its tensors are on disk, so that when the engine dies mid-capture the front
end still writes the records of the forwards every rank completed (`Spill.note`,
`SpillReader.noted`). And
`release_freed_memory`: what a step freed goes back to the system, so that a capture's memory
stays at one step's records.

A record here is anything with the attributes of record.ranks.Record: `rank`, `shape`, `data`
(its tensor, or None) and `spilled` (what `Spill.put` returned: [byte offset, numpy dtype], or
None).
"""
from __future__ import annotations

import ctypes
import json
import os
from pathlib import Path
from typing import BinaryIO

import numpy as np

from accucheck.errors import UserError


def _path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank{rank}.bin")


def _index(path: str) -> str:
    return path[:-len(".bin")] + ".idx"


class Spill:
    """One rank's tensors on disk, appended as each forward completes (`put`), read back one
    record at a time by the front end (`SpillReader`). Bounds a worker's memory to one
    forward's tensors and the front end's to one record's, where holding every record and
    sending them through `collective_rpc` at the end took about 2 GB of memory per GB captured
    (bench/bench_scale.py, docs/scale.md). The directory is the front end's (on the workers'
    machine), removed when the capture ends."""

    def __init__(self, directory: str, rank: int):
        self.path = _path(directory, rank)
        self._f: BinaryIO | None = None

    def put(self, data: np.ndarray) -> list:
        if self._f is None:  # reopened after a drain: what was sent so far stays
            self._f = open(self.path, "ab")
        at = self._f.tell()
        self._f.write(np.ascontiguousarray(data).tobytes())
        return [at, data.dtype.str]

    def note(self, rows: list) -> None:
        """One forward's records (JSON-able rows, their tensors already `put`) appended to
        `rank<r>.idx` as one line, after the tensors are flushed: what the front end keeps of
        a capture whose engine dies (`SpillReader.noted`). A line cut short by the death is
        dropped whole, so a forward's records are kept all or none."""
        if self._f is not None:
            self._f.flush()
        with open(_index(self.path), "a", encoding="utf-8") as f:
            f.write(json.dumps(rows) + "\n")

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


class SpillReader:
    """The front end's side of `Spill`: a record's tensor from its rank's file."""

    def __init__(self, directory: str):
        self.directory = directory

    def noted(self, ranks: range) -> dict[int, list]:
        """rank -> the rows its worker noted, forward by forward (`Spill.note`); a last line
        cut short (the worker died writing it) is left out."""
        out: dict[int, list] = {}
        for rank in ranks:
            rows: list = []
            try:
                lines = Path(_index(_path(self.directory, rank))).read_text(
                    encoding="utf-8").splitlines()
            except OSError:
                lines = []
            for ln in lines:
                try:
                    rows.extend(json.loads(ln))
                except json.JSONDecodeError:
                    break
            out[rank] = rows
        return out

    def size(self, rank: int) -> int:
        """Bytes in `rank`'s tensor file (0 when there is none)."""
        try:
            return os.path.getsize(_path(self.directory, rank))
        except OSError:
            return 0

    def data(self, rec) -> np.ndarray | None:
        if rec.spilled is None:
            return rec.data
        at, dtype = rec.spilled
        dt = np.dtype(dtype)
        n = int(np.prod(rec.shape, dtype=np.int64))
        try:
            with open(_path(self.directory, rec.rank), "rb") as f:
                f.seek(int(at))
                buf = f.read(n * dt.itemsize)
        except OSError as e:
            raise UserError(f"rank {rec.rank}'s tensors on disk cannot be read "
                            f"({e.strerror or e}: {_path(self.directory, rec.rank)})") from None
        if len(buf) != n * dt.itemsize:
            raise UserError(f"rank {rec.rank}'s tensors on disk ({self.directory}) end early at "
                            f"byte {at}: was the disk full, or did a worker stop?")
        return np.frombuffer(buf, dtype=dt).reshape(rec.shape)


def spilled_end(rec) -> int:
    """The byte after `rec`'s tensor in its rank's file (0 when it was not spilled)."""
    if rec.spilled is None:
        return 0
    return int(rec.spilled[0]) + int(np.prod(rec.shape, dtype=np.int64)) * \
        np.dtype(rec.spilled[1]).itemsize


def release_freed_memory() -> None:
    """Hand the pages of freed heap memory back to the system (glibc's `malloc_trim`; nothing
    where there is none). A step frees its records once they are written, but glibc keeps the
    freed pages, scattered between small live objects: without this, the HF runner's resident
    memory grew by about 0.1 GB per GB a full-store capture wrote, with it by 0.02
    (bench/bench_scale.py, docs/scale.md). Called at every step boundary of the HF runner,
    after every forward of a vLLM worker that spills and after every request the vLLM front
    end writes; well under a millisecond per call here."""
    global _TRIM
    if _TRIM is None:
        try:
            _TRIM = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):  # not glibc: nothing to hand back this way
            _TRIM = False
    if _TRIM:
        _TRIM(0)


_TRIM = None
