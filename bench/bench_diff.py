"""Benchmark `accucheck diff`: start-up time, tensor throughput vs a plain h5py read + numpy
reduction over the same files, and peak memory vs file size. Not a test; one run, prints a table.

    python bench/bench_diff.py [--workdir DIR] [--sizes 64,256] [--keep]

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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--sizes", default="64,256", help="MiB per capture file")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="accucheck-bench-"))
    work.mkdir(parents=True, exist_ok=True)
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
