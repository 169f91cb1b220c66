"""Benchmark `accucheck diff`: start-up time, tensor throughput vs a plain h5py read + numpy
reduction over the same files, and peak memory vs file size. Not a test; one run, prints a table.

    python bench/bench_diff.py [--workdir DIR] [--sizes 64,256] [--keep]
    python bench/bench_diff.py --scaling [--scaling-mib 512] [--jobs 1,2,N] [--ray]  # docs/scale.md

--scaling: GB/s of `diff_captures(jobs=j)` (tensor bytes read / wall time, page cache warm) for
each j, the speed-up per core against j = 1, and the bytes a mostly identical pair (95 % of its
records bitwise equal, as an eager-vs-graph pair of one device mostly is) reads through the
content hashes (/index/hash) against the same files without them. With --ray, the same jobs
again as Ray tasks (compare.ray_tasks) on a local Ray started once (its start-up time printed
apart: a cluster is started once, not per diff).

Synthetic full captures (float32 activations [1, 512, 4096], 8 MiB each, candidate = reference
+ 1e-6 relative noise) are written with accucheck.store.CaptureWriter. The baseline reads every
tensor pair with h5py and computes ||a-b|| / ||a|| in float64: the least a diff must do.
accucheck computes ~12 metrics per pair (abs/rel/L2/cosine/SQNR/ULP/thousandth ratios/NaN
check) plus locate and report. Files are read once before timing so both runs see the page
cache. Peak memory is the max RSS of a child process that runs the whole diff.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPE = (1, 512, 4096)


def make_pair(d: Path, mib: int) -> tuple[Path, Path]:
    from accucheck.keys import RecordKey
    from accucheck.store import CaptureWriter

    n = max(1, mib * (1 << 20) // (int(np.prod(SHAPE)) * 4))
    ref, cand = d / f"ref_{mib}.h5", d / f"cand_{mib}.h5"
    if ref.exists() and cand.exists():
        return ref, cand
    rng = np.random.default_rng(0)
    with CaptureWriter(ref, meta={"dtype": "float32"}, store="full", force=True) as wr, \
            CaptureWriter(cand, meta={"dtype": "float32"}, store="full", force=True) as wc:
        for i in range(n):
            key = RecordKey(0, 0, f"model.layers.{i}", 0, "out", "0")
            a = rng.standard_normal(SHAPE, dtype=np.float32)
            b = a * (1 + np.float32(1e-6) * rng.standard_normal(SHAPE, dtype=np.float32))
            for w, x in ((wr, a), (wc, b)):
                x64 = x.astype(np.float64)
                st = [x64.min(), x64.max(), x64.mean(), x64.std(), np.abs(x64).max(),
                      np.sqrt(np.dot(x64.ravel(), x64.ravel())), 0, 0, 0, x.size]
                w.add(key, "module", "float32", SHAPE, np.array(st), 0, x)
            del a, b
        for w in (wr, wc):
            w.set_request(0, [1, 2, 3], [])
    return ref, cand


def baseline(ref: Path, cand: Path) -> float:
    import h5py

    worst = 0.0
    with h5py.File(ref, "r") as fa, h5py.File(cand, "r") as fb:
        for name in fa["tensors"]:
            a = fa["tensors"][name][()].astype(np.float64).ravel()
            b = fb["tensors"][name][()].astype(np.float64).ravel()
            d = a - b
            worst = max(worst, float(np.sqrt(np.dot(d, d) / np.dot(a, a))))
    return worst


def accucheck_diff(ref: Path, cand: Path) -> int:
    from accucheck.verdict.locate import analyze
    from accucheck.report.diff import render

    a = analyze(ref, cand)
    render(a, "json")
    return a.exit_code


def timed(fn, *args, repeat: int = 3) -> float:
    ts = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn(*args)
        ts.append(time.perf_counter() - t)
    return min(ts)


def startup(repeat: int = 7) -> float:
    ts = []
    for _ in range(repeat):
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "accucheck", "diff", "--help"], cwd=ROOT,
                       check=True, capture_output=True)
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def import_time(repeat: int = 7) -> float:
    """Whole process: python + every module on the diff path (cli, diff, locate, report,
    store/h5py, numpy, click, tabulate)."""
    ts = []
    code = ("import accucheck.cli, accucheck.compare.diff, accucheck.verdict.locate, "
            "accucheck.report.diff, tabulate, sys; assert 'torch' not in sys.modules")
    for _ in range(repeat):
        t = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True)
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def startup_diff_small(ref: Path, cand: Path, repeat: int = 5) -> float:
    ts = []
    for _ in range(repeat):
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "accucheck", "diff", str(ref), str(cand)],
                       cwd=ROOT, capture_output=True)
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def peak_rss_mib(code: str) -> float:
    p = subprocess.run([sys.executable, "-c", code + "\nimport resource; print(resource."
                        "getrusage(resource.RUSAGE_SELF).ru_maxrss)"], cwd=ROOT, check=True,
                       capture_output=True, text=True)
    return int(p.stdout.strip().splitlines()[-1]) / 1024


def make_mostly_identical(d: Path, mib: int, differ_every: int = 20) -> tuple[Path, Path]:
    """A pair of which one record in `differ_every` differs (1e-6 relative noise); the others
    are the same bytes on both sides."""
    from accucheck.keys import RecordKey
    from accucheck.store import CaptureWriter

    n = max(differ_every, mib * (1 << 20) // (int(np.prod(SHAPE)) * 4))
    ref, cand = d / f"same_ref_{mib}.h5", d / f"same_cand_{mib}.h5"
    rng = np.random.default_rng(1)
    with CaptureWriter(ref, meta={"dtype": "float32"}, store="full", force=True) as wr, \
            CaptureWriter(cand, meta={"dtype": "float32"}, store="full", force=True) as wc:
        for i in range(n):
            key = RecordKey(0, 0, f"model.layers.{i}", 0, "out", "0")
            a = rng.standard_normal(SHAPE, dtype=np.float32)
            b = a * (1 + np.float32(1e-6) * rng.standard_normal(SHAPE, dtype=np.float32)) \
                if i % differ_every == differ_every - 1 else a
            for w, x in ((wr, a), (wc, b)):
                x64 = x.astype(np.float64)
                st = [x64.min(), x64.max(), x64.mean(), x64.std(), np.abs(x64).max(),
                      np.sqrt(np.dot(x64.ravel(), x64.ravel())), 0, 0, (x64 == 0).sum(), x.size]
                w.add(key, "module", "float32", SHAPE, np.array(st), 0, x)
        for w in (wr, wc):
            w.set_request(0, [1, 2, 3], [])
    return ref, cand


def without_hashes(path: Path, out: Path) -> Path:
    """A copy of `path` as written before /index/hash existed."""
    import shutil

    import h5py

    shutil.copyfile(path, out)
    with h5py.File(out, "a") as f:
        del f["index/hash"]
    return out


def scaling(work: Path, mib: int, jobs: list[int], on_ray: bool = False) -> None:
    from accucheck.compare.diff import diff_captures
    from accucheck.compare.parallel import available_cores

    ref, cand = make_pair(work, mib)
    baseline(ref, cand)  # warm the page cache
    print(f"scaling: a {2 * mib} MiB pair ({mib} MiB per file, every record differs, all read); "
          f"{available_cores()} cores available; load average {os.getloadavg()[0]:.1f}")
    print(f"{'jobs':>4} {'s':>7} {'GB read':>8} {'GB/s':>6} {'speed-up':>8} {'per core':>8} "
          f"{'CPU s':>6} {'GB/CPU-s':>8}")
    base, rates = None, {}
    for j in jobs:
        t, d = timed_result(lambda: diff_captures(ref, cand, jobs=j))
        gb = d.io["bytes_read"] / 1e9
        base = base or gb / t
        rates[j] = gb / t
        cpu = d.io["cpu_s"]  # the measuring processes' CPU time: what a free core would do
        print(f"{j:>4} {t:>7.2f} {gb:>8.2f} {gb / t:>6.2f} {gb / t / base:>8.2f} "
              f"{gb / t / base / j:>8.2f} {cpu:>6.2f} {gb / cpu:>8.2f}")
    if on_ray:
        ray_rows(ref, cand, jobs, base)
    best = max(r / j for j, r in rates.items())
    print(f"per core: accucheck {1000 * best:.0f} MB/s (best of the rows above); msprobe's "
          f"published 0.1-0.3 GB/s on a 192-core machine is {100 / 192:.1f}-{300 / 192:.1f} MB/s "
          f"per core (accucheck per core: {1000 * best / (300 / 192):.0f}-"
          f"{1000 * best / (100 / 192):.0f} x msprobe's)")
    same_ref, same_cand = make_mostly_identical(work, mib)
    old_ref = without_hashes(same_ref, work / "old_ref.h5")
    old_cand = without_hashes(same_cand, work / "old_cand.h5")
    for label, (a, b) in (("with content hashes", (same_ref, same_cand)),
                          ("without (older files)", (old_ref, old_cand))):
        baseline(a, b)
        t, d = timed_result(lambda: diff_captures(a, b, jobs=1))
        io = d.io
        print(f"mostly identical pair, {label}: read {io['bytes_read'] / 1e6:.0f} of "
              f"{io['bytes_data'] / 1e6:.0f} MB ({100 * io['bytes_read'] / io['bytes_data']:.1f} "
              f"%), {io['unread_identical']} of {len(d.records)} records not read, {t:.2f} s "
              f"(jobs 1), verdict {'PASS' if d.within else 'FAIL'}")


def ray_rows(ref: Path, cand: Path, jobs: list[int], base: float) -> None:
    """The scaling rows again with the pairs measured as Ray tasks on a local Ray."""
    import logging

    import ray

    from accucheck.compare.diff import diff_captures

    t = time.perf_counter()
    ray.init(num_cpus=max(jobs), include_dashboard=False, log_to_driver=False,
             logging_level=logging.ERROR)
    print(f"ray: a local Ray with {max(jobs)} CPUs started in {time.perf_counter() - t:.1f} s")
    try:
        for j in jobs:
            t, d = timed_result(lambda: diff_captures(ref, cand, ray="auto", jobs=j))
            gb = d.io["bytes_read"] / 1e9
            print(f"{'ray' + str(j):>4} {t:>7.2f} {gb:>8.2f} {gb / t:>6.2f} "
                  f"{gb / t / base:>8.2f} (against the serial row)")
    finally:
        ray.shutdown()


def timed_result(fn, repeat: int = 3):
    best, out = float("inf"), None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--sizes", default="64,256", help="MiB per capture file")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--scaling", action="store_true", help="jobs scaling and bytes read only")
    ap.add_argument("--scaling-mib", type=int, default=512, help="MiB per file for --scaling")
    ap.add_argument("--jobs", default=None, help="e.g. 1,2,4 (default 1, 2 and the cores)")
    ap.add_argument("--ray", action="store_true", help="with --scaling: Ray tasks too")
    args = ap.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="accucheck-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.scaling:
        from accucheck.compare.parallel import available_cores

        jobs = [int(j) for j in args.jobs.split(",")] if args.jobs else \
            sorted({1, 2, available_cores()})
        scaling(work, args.scaling_mib, jobs, args.ray)
        if not args.keep and not args.workdir:
            import shutil

            shutil.rmtree(work, ignore_errors=True)
        return
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = []
    for mib in sizes:
        ref, cand = make_pair(work, mib)
        baseline(ref, cand)  # warm the page cache
        tb = timed(baseline, ref, cand)
        ta = timed(accucheck_diff, ref, cand)
        data = 2 * ref.stat().st_size / (1 << 20)
        mem_a = peak_rss_mib(f"import sys; sys.path.insert(0, {str(ROOT)!r})\n"
                             f"from accucheck.verdict.locate import analyze\n"
                             f"analyze({str(ref)!r}, {str(cand)!r})")
        mem_b = peak_rss_mib(f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
                             f"import bench_diff; bench_diff.baseline("
                             f"__import__('pathlib').Path({str(ref)!r}), "
                             f"__import__('pathlib').Path({str(cand)!r}))")
        rows.append((mib, data, tb, ta, mem_b, mem_a))
    st = startup()
    small = work / "small"
    small.mkdir(exist_ok=True)
    ref0, cand0 = make_pair(small, 8)
    st_small = startup_diff_small(ref0, cand0)
    st_imp = import_time()
    print(f"start-up: `accucheck diff --help` {st:.3f} s; python + every module on the diff path "
          f"(no torch) {st_imp:.3f} s; whole `accucheck diff` of a 1-record 8 MiB pair "
          f"{st_small:.3f} s (medians; load average {os.getloadavg()[0]:.1f})")
    print(f"{'file MiB':>8} {'read MiB':>8} {'h5py+np s':>9} {'accucheck s':>11} "
          f"{'h5py MiB/s':>10} {'acc MiB/s':>9} {'ratio':>6} {'RSS base':>8} {'RSS acc':>8}")
    for mib, data, tb, ta, mb, ma in rows:
        print(f"{mib:>8} {data:>8.0f} {tb:>9.3f} {ta:>11.3f} {data / tb:>10.0f} "
              f"{data / ta:>9.0f} {tb / ta:>6.2f} {mb:>8.0f} {ma:>8.0f}")
    print("ratio = accucheck throughput / baseline throughput (>= 0.5 required); RSS in MiB")
    if not args.keep and not args.workdir:
        import shutil

        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
