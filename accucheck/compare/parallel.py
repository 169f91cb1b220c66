"""The record pairs of a diff measured by a pool of processes, which pairs must be read at all
(`unread_pair`: equal content hashes), and the bytes a diff reads.
Imports errors, store and compare.mapping; never torch, never compare.diff (its _Differ comes
in the worker's spec, by reference). compare.ray_tasks runs the same chunks (`chunk_ranges`)
through the same worker functions (`worker_init`, `worker_run`) as Ray tasks.

`measure(differ, work, total)` -> `[(RecordDiff, LogitsStep | None)]`, one per work item, in
the work's order: what `differ.measure_serial(work, total)` returns, bit for bit, since each
pair is measured by the same `_Differ._compare` on the same bytes, only in another process.

- Serial below a size: a pool costs about half a second to start (each worker imports numpy
  and h5py and opens the captures), so a diff with fewer than MIN_PARALLEL_BYTES of tensors to
  read (pairs whose content hashes are equal are not read), or fewer than two work items, stays
  in this process, as does `jobs` 1 or a capture that is not one file on disk (a reader made
  in memory).
- Each worker opens the capture files itself (readers hold HDF5 handles, which do not pickle),
  with vLLM's mapped view where the parent has one (compare.mapping), and keeps them open for
  all its chunks. Work goes out in contiguous chunks of about equal bytes, CHUNKS_PER_JOB per
  worker, so the fastest worker takes more; the results come back and are put in the work's
  order. A worker's memory is one chunk of metrics (`max_elems`), as in the serial diff.
- The 'forkserver' start method (spawn where there is none), never fork: torch or h5py may be
  loaded in the parent, and neither is safe to fork with threads running.
- A record a worker cannot read is the worker's UserError, re-raised here as it was (one line,
  exit 3); a worker that dies (killed, out of memory) is one UserError too; either way the
  other chunks are cancelled and no result is returned, so no partial verdict can be shown.
  Any other exception in a worker is a bug and comes back with its traceback.
"""
from __future__ import annotations

import math
import multiprocessing
import os
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from typing import Sequence

from accucheck.errors import UserError

MIN_PARALLEL_BYTES = 256 << 20  # tensor bytes to read below which a diff stays in-process
CHUNKS_PER_JOB = 4              # chunks of work per worker: a slow chunk delays less
SMALL_PAIR_BYTES = 4096         # the cost given to a pair measured from statistics / hashes
TEST_DIE_ENV = "ACCUCHECK_TEST_DIFF_WORKER_EXIT"  # tests: a worker os._exit()s at its Nth chunk


def available_cores() -> int:
    """The cores this process may run on (its affinity mask), the CLI's default --jobs."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def measure(differ, work: Sequence[tuple], total: int) -> list:
    """Every work item `(pair number, ref row, cand row, golden row, shadow row)` measured, in
    order: in a pool of `differ.jobs` processes, or in this process (see the module
    docstring). Adds the pool's bytes read, unread pairs and transform counts to `differ`."""
    costs = [pair_cost(differ, w) for w in work]
    spec = worker_spec(differ)
    if (differ.jobs <= 1 or spec is None or len(work) < 2 or not _main_importable()
            or sum(c for c in costs if c > SMALL_PAIR_BYTES) < MIN_PARALLEL_BYTES):
        return differ.measure_serial(work, total)
    chunks = chunk_ranges(costs, differ.jobs * CHUNKS_PER_JOB)
    return _pool(differ, spec, work, chunks, total)


def _context():
    """forkserver (its server imports the diff's modules once, so a worker starts in a few
    milliseconds; it lives as long as this process), else spawn; never fork."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["accucheck.compare.diff", "accucheck.compare.parallel"])
    return ctx


def _main_importable() -> bool:
    """A spawned / forkserver worker imports the parent's main script (as __mp_main__): not
    possible for a script read from stdin; such a parent stays serial."""
    import sys

    path = getattr(sys.modules.get("__main__"), "__file__", None)
    return path is None or os.path.exists(path)


def pair_cost(differ, w: tuple) -> int:
    _n, ra, ca, grow, shadow = w
    if not (ra.has_data and ca.has_data) or unread_pair(ra, ca, grow, shadow, differ.transforms):
        return SMALL_PAIR_BYTES
    return nbytes(ra) + nbytes(ca) + (nbytes(grow) if grow is not None else 0) + (
        nbytes(ra) + nbytes(shadow) if shadow is not None else 0)


def chunk_ranges(costs: Sequence[int], n: int) -> list[range]:
    """Contiguous ranges of work items of about sum(costs) / n each (at least one item)."""
    target = max(1, sum(costs) // max(n, 1))
    out, start, acc = [], 0, 0
    for i, c in enumerate(costs):
        acc += c
        if acc >= target:
            out.append(range(start, i + 1))
            start, acc = i + 1, 0
    if start < len(costs):
        out.append(range(start, len(costs)))
    return out


def _file(x):
    """(path, mapped) of a reader that a worker can open again, else None."""
    from accucheck.compare.mapping import MappedCapture
    from accucheck.store import CaptureReader

    mapped = isinstance(x, MappedCapture)
    inner = x._r if mapped else x
    if type(inner) is not CaptureReader or not inner.path.is_file():
        return None
    return str(inner.path.resolve()), mapped


def worker_spec(differ) -> dict | None:
    sides = {name: _file(x) for name, x in (("R", differ.R), ("C", differ.C), ("G", differ.G))
             if x is not None}
    if any(v is None for v in sides.values()):
        return None
    return {"differ": type(differ), "sides": sides, "tol": differ.tol,
            "max_elems": differ.max_elems, "transforms": differ.transforms,
            "die": os.environ.get(TEST_DIE_ENV)}


def _pool(differ, spec: dict, work: Sequence[tuple], chunks: list[range], total: int) -> list:
    results: list = [None] * len(chunks)
    done, read0 = 0, differ.bytes_read
    start = said = time.perf_counter()
    try:
        ex = ProcessPoolExecutor(max_workers=min(differ.jobs, len(chunks)),
                                 mp_context=_context(), initializer=worker_init, initargs=(spec,))
    except OSError:  # no processes here (a sandbox without semaphores): this process then
        return differ.measure_serial(work, total)
    differ.processes = min(differ.jobs, len(chunks))
    if differ.progress:
        differ.progress(f"diff: 0/{total} records ({differ.processes} processes)")
    try:
        pending = {ex.submit(worker_run, i, [work[j][1:] for j in c]): i for i, c in enumerate(chunks)}
        while pending:
            finished, _ = wait(pending, return_when=FIRST_COMPLETED)
            for f in finished:
                i = pending.pop(f)
                results[i] = merge(differ, f.result())  # a worker's UserError here
                done += len(results[i])
            now = time.perf_counter()
            if differ.progress and now - said >= 2.0:  # compare.diff.PROGRESS_EVERY_S
                said = now
                differ.progress(progress_line(done, total, differ.bytes_read - read0,
                                                now - start))
    except BrokenProcessPool:
        raise UserError(f"a diff worker process died (killed, or out of memory?) before "
                        f"{len(work) - done} of {len(work)} record pairs were measured: no "
                        f"verdict; re-run, or with --jobs 1 (one process, the least "
                        f"memory)") from None
    finally:
        ex.shutdown(wait=True, cancel_futures=True)
    return [r for out in results for r in out]


def merge(differ, chunk: tuple) -> list:
    """A chunk's result (`worker_run`) added to `differ`'s counts; returns its measured pairs."""
    out, nread, unread, applied, cpu = chunk
    differ.bytes_read += nread
    differ.unread += unread
    differ.cpu_s += cpu
    for text, (a, b) in applied.items():
        differ._applied[text][0] += a
        differ._applied[text][1] += b
    return out


_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8, "int8": 1, "uint8": 1,
             "int16": 2, "int32": 4, "int64": 8, "bool": 1}


def nbytes(row) -> int:
    """Bytes of a record's stored tensor (0 without one)."""
    if not row.has_data:
        return 0
    return math.prod(row.shape) * _ITEMSIZE.get(row.dtype, 4)


def data_bytes(reader) -> int:
    """Bytes of the tensors a capture holds (a dataset shared by several records once)."""
    seen: dict[str, int] = {}
    for r in reader.rows:
        if r.has_data and r.data not in seen:
            seen[r.data] = nbytes(r)
    return sum(seen.values())


def progress_line(n: int, total: int, nbytes_read: int, seconds: float) -> str:
    """"diff: n/total records", with the GB read and the rate once tensors have been read."""
    line = f"diff: {n}/{total} records"
    if nbytes_read:
        line += (f", {nbytes_read / 1e9:.2f} GB read, "
                 f"{nbytes_read / 1e9 / max(seconds, 1e-9):.2f} GB/s")
    return line


def unread_pair(ra, ca, grow, shadow, transforms) -> bool:
    """A pair (ref row, cand row, golden row or None, shadow row or None) that compare.diff
    measures without reading it: equal non-zero content hashes (/index/hash), the same dtype
    and shape, tensors on both sides, no transform, golden or shadow to read with it, not
    logits (their positions need the values), and index statistics that fix what the metrics
    of two identical tensors are (`square_sum_positive`)."""
    return (ra.hash != 0 and ra.hash == ca.hash and ra.dtype == ca.dtype
            and ra.shape == ca.shape and ra.has_data and ca.has_data
            and ra.kind != "logits" and grow is None and shadow is None
            and not any(t.matches(ra.key) for t in transforms)
            and square_sum_positive(ra) is not None)


def square_sum_positive(row) -> bool | None:
    """From a record's index statistics: whether the sum of squares of its finite elements is
    0 (False) or lies safely inside (1e-140, 1e140) (True); None when the statistics cannot
    tell (l2 near float64's limits, not finite, counts that do not add up): then the tensors
    are read. This is all the metrics of two identical tensors depend on (metrics
    .identical_metrics)."""
    st = row.stats
    finite = st.numel - st.nan - st.inf
    if st.numel != math.prod(row.shape) or finite < 0:
        return None
    if finite == 0 or st.zero == finite:
        return False
    if not math.isfinite(st.l2) or not 1e-70 < st.l2 < 1e70:
        return None
    return True


def io_line(io: dict) -> str:
    """"diff: read X of Y MB of tensor data (...)" from `DiffResult.io`."""
    line = (f"diff: read {_size(io['bytes_read'])} of {_size(io['bytes_data'])} of tensor "
            f"data ({100 * io['bytes_read'] / max(io['bytes_data'], 1):.1f} %)")
    if io.get("unread_identical"):
        line += (f" ({io['unread_identical']} record pairs with equal content hashes "
                 f"measured without reading them)")
    return line + (f", {io['jobs']} processes" if io.get("jobs", 1) > 1 else "")


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


# ----------------------------------------------------------------------------- in a worker

_WORKER: dict = {}


def worker_init(spec: dict) -> None:
    """A worker's own readers of the captures and its own _Differ (kept for every chunk; a
    worker that serves another diff, as a Ray worker does, closes the previous ones)."""
    from accucheck.compare.mapping import maybe_mapped
    from accucheck.store import open_capture

    for r in _WORKER.pop("readers", {}).values():
        r.close()
    readers = {}
    for name, (path, mapped) in spec["sides"].items():
        r = open_capture(path, allow_incomplete=True)  # the parent checked it
        readers[name] = maybe_mapped(r) if mapped else r
    _WORKER["differ"] = spec["differ"](readers["R"], readers["C"], readers.get("G"), spec["tol"],
                                None, (), spec["max_elems"], None, spec["transforms"])
    _WORKER["die"] = int(spec["die"]) if spec.get("die") else None
    _WORKER["readers"], _WORKER["token"] = readers, spec.get("token")


def worker_run(index: int, items: list[tuple]) -> tuple:
    """One chunk: the pairs' (RecordDiff, LogitsStep | None), bytes read, pairs not read, the
    transforms' (applied, statistics only) counts of this chunk, and its CPU seconds."""
    if _WORKER.get("die") is not None and index == _WORKER["die"]:
        os._exit(9)  # tests (TEST_DIE_ENV): a worker killed while it works
    cpu = time.process_time()
    d = _WORKER["differ"]
    d.bytes_read = d.unread = 0
    for counts in d._applied.values():
        counts[0] = counts[1] = 0
    out = [d._compare(ra, ca, grow, shadow) for ra, ca, grow, shadow in items]
    return (out, d.bytes_read, d.unread, {t: tuple(c) for t, c in d._applied.items()},
            time.process_time() - cpu)
