"""The record pairs of a diff measured as Ray tasks (`accucheck diff --ray ADDRESS`): the chunks
of compare.parallel, each one a task on any node of a Ray cluster that opens the capture files
itself, with the same `_Differ._compare` on the same bytes, so the verdict is the serial one,
bit for bit. Only the small per-record results travel back. compare.diff calls `measure_ray`
in place of compare.parallel.measure when given a Ray address. Imports errors and
compare.parallel (its chunks and its worker functions); `ray` (the optional extra
`accucheck[ray]`) only when called.

- ADDRESS "local" starts a Ray instance on this machine (`jobs` CPUs, default: the cores this
  process may use); any other address ("auto", "HOST:6379", "ray://HOST:10001") joins that
  cluster; either way this process leaves Ray when the diff is done (`shutdown`), a cluster
  keeps running. A Ray already initialised in this process (a library caller's) is used as
  it is and left so. Tasks in flight: `jobs`, default the
  cluster's CPUs; CHUNKS_PER_JOB chunks per task slot, as in the process pool.
- Every node opens the captures at the paths this process has: they must lie on a filesystem
  the nodes share (or be copied to the same path on each node), and accucheck must be
  importable on every node. A node that cannot open them fails its task: one line, exit 3.
- Tasks are not retried (max_retries=0): a worker or node that dies is one UserError (exit 3),
  the other tasks are cancelled and no verdict is given. A worker's UserError (a damaged
  record) is re-raised as it was; any other exception in a task is a bug and keeps its
  traceback.
"""
from __future__ import annotations

import time
import uuid
from typing import Sequence

from accucheck.compare import parallel
from accucheck.errors import UserError

LOCAL = "local"


def _import_ray():
    try:
        import ray
    except ImportError:
        raise UserError("--ray needs Ray: pip install 'accucheck[ray]'") from None
    return ray


def _task(spec: dict, index: int, items: list[tuple]) -> tuple:
    """In a Ray worker: this diff's readers (opened once per worker and diff), then one chunk."""
    if parallel._WORKER.get("token") != spec["token"]:
        parallel.worker_init(spec)
    return parallel.worker_run(index, items)


_STARTED: list = []  # the Ray this module initialised, until `shutdown`


def shutdown() -> None:
    """Stop the Ray this module started or joined (compare.diff calls it once the diff, with
    its control runs, is done); a Ray initialised by the caller is left as it is."""
    while _STARTED:
        _STARTED.pop().shutdown()


def _connect(ray, address: str, jobs: int | None) -> None:
    """Ray initialised for `address` (kept for the next measure of the same diff)."""
    if ray.is_initialized():
        return
    import logging

    kw = dict(logging_level=logging.ERROR, log_to_driver=False, include_dashboard=False)
    if check_address(address) is not None:
        _answers(address)
    try:
        if address == LOCAL:
            ray.init(num_cpus=jobs or parallel.available_cores(), **kw)
        else:
            ray.init(address=address, **kw)
    except Exception as e:  # no cluster there, a version mismatch, ...
        raise UserError(f"--ray {address}: cannot start or join Ray: "
                        f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    _STARTED.append(ray)


def check_address(address: str) -> tuple[str, str] | None:
    """(host, port) of a HOST:PORT or ray://HOST:PORT address, None for local / auto; a usage
    error for anything else (compare.diff checks it before opening a capture)."""
    if address in (LOCAL, "auto"):
        return None
    host, _, port = address.split("://", 1)[-1].rpartition(":")
    if not host or not port.isdigit():
        raise UserError.usage(f"--ray {address}: give local, auto, HOST:PORT or "
                              f"ray://HOST:PORT")
    return host, port


def _answers(address: str, timeout_s: float = 10.0) -> None:
    """UserError unless something accepts a TCP connection at HOST:PORT (ray://HOST:PORT):
    Ray itself retries an address where nothing listens for minutes."""
    import socket

    host, port = check_address(address)
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise UserError(f"--ray {address}: nothing answers at {host}:{port} "
                        f"({e.strerror or type(e).__name__}): is the Ray head running?") from None


def measure_ray(differ, work: Sequence[tuple], total: int) -> list:
    """Every work item `(pair number, ref row, cand row, golden row, shadow row)` measured as
    Ray tasks, in the work's order (see the module docstring): what compare.parallel.measure
    returns, for a `differ` with a Ray address. In this process where the captures are not
    files a task could open, or there are fewer than two items."""
    spec = parallel.worker_spec(differ)
    if spec is None or len(work) < 2:
        return differ.measure_serial(work, total)
    costs = [parallel.pair_cost(differ, w) for w in work]
    ray = _import_ray()
    from ray import exceptions as rx

    _connect(ray, differ.ray, differ.jobs)
    pending: dict = {}
    done = 0
    try:
        slots = differ.jobs or max(1, int(ray.cluster_resources().get("CPU", 1)))
        chunks = parallel.chunk_ranges(costs, slots * parallel.CHUNKS_PER_JOB)
        differ.processes = min(slots, len(chunks))
        spec_ref = ray.put(dict(spec, token=uuid.uuid4().hex))
        task = ray.remote(num_cpus=1, max_retries=0)(_task)
        results: list = [None] * len(chunks)
        read0 = differ.bytes_read
        start = said = time.perf_counter()
        if differ.progress:
            differ.progress(f"diff: 0/{total} records ({differ.processes} Ray tasks)")
        pending = {task.remote(spec_ref, i, [work[j][1:] for j in c]): i
                   for i, c in enumerate(chunks)}
        while pending:
            finished, _ = ray.wait(list(pending), num_returns=1)
            for ref in finished:
                i = pending.pop(ref)
                try:
                    results[i] = parallel.merge(differ, ray.get(ref))
                except rx.RayTaskError as e:
                    if isinstance(e.cause, UserError):
                        raise e.cause from None
                    raise
                done += len(results[i])
            now = time.perf_counter()
            if differ.progress and now - said >= 2.0:  # compare.diff.PROGRESS_EVERY_S
                said = now
                differ.progress(parallel.progress_line(done, total, differ.bytes_read - read0,
                                                       now - start))
    except rx.RayTaskError:
        raise
    except rx.RayError as e:  # a worker or a node died, an object was lost
        raise UserError(f"a Ray diff task failed ({type(e).__name__}: a worker or node died?) "
                        f"with {len(work) - done} of {len(work)} record pairs not measured: no "
                        f"verdict; re-run, or without --ray") from None
    finally:
        for ref in pending:
            ray.cancel(ref, force=True)
    return [r for out in results for r in out]
