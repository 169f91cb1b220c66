"""Capture overhead and file size on the built-in tiny Llama (module level). Not a test.

    python bench/bench_capture.py [--threads 1] [--repeats 20] [--seqs 64,512]

For each sequence length: time of a plain prefill forward vs the same forward under the
recorder in `stats` and `full` store modes (median over repeats, ratios measured in this one
run), bytes written per forward, and the bytes of the captured activations themselves.
Reference (issue 2, Huawei msprobe on the same kind of model, CPU, 1 thread): module-level
statistics 5.8x (seq 64) / 1.7x (seq 512), tensors 19x / 8.6x, 19.9 MiB per forward at seq 64.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from accucheck.capture.recorder import Recorder, select_modules
from accucheck.capture.tiny import tiny_model_dir
from accucheck.store import CaptureWriter, open_capture


def median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench(model, seq: int, repeats: int, tmp: Path) -> dict:
    ids = torch.randint(0, model.config.vocab_size, (1, seq), generator=torch.Generator().manual_seed(seq))
    modules = select_modules(model)

    def plain():
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)

    out = {"seq": seq, "plain_s": median_time(plain, repeats)}
    for store in ("stats", "full"):
        path = tmp / f"bench-{store}-{seq}.h5"
        writer = CaptureWriter(path, meta={"bench": True}, store=store, force=True)
        rec = Recorder(model, writer, modules)
        counter = {"req": 0}

        def captured():
            rec.begin_step(counter["req"], 0)
            with torch.no_grad():
                o = model(input_ids=ids, use_cache=False)
            rec.end_step(o.logits)
            counter["req"] += 1

        with rec.hooks():
            out[f"{store}_s"] = median_time(captured, repeats)
        writer.close()
        n_forwards = counter["req"]
        out[f"{store}_bytes_per_forward"] = path.stat().st_size / n_forwards
        if store == "full":
            with open_capture(path) as r:
                act = sum(int(torch.tensor(row.shape).prod()) * (2 if "16" in row.dtype else 4)
                          for row in r.rows) / n_forwards
            out["activation_bytes_per_forward"] = act
        path.unlink()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--seqs", default="64,512")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir(), local_files_only=True).eval()
    print(f"tiny Llama: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, "
          f"{args.threads} thread(s), {args.repeats} repeats, torch {torch.__version__}")
    with tempfile.TemporaryDirectory() as d:
        for seq in (int(s) for s in args.seqs.split(",")):
            r = bench(model, seq, args.repeats, Path(d))
            mib = 1024 * 1024
            print(f"seq {seq:4d}: plain {r['plain_s'] * 1e3:7.2f} ms | "
                  f"stats {r['stats_s'] / r['plain_s']:.2f}x | full {r['full_s'] / r['plain_s']:.2f}x | "
                  f"file/forward stats {r['stats_bytes_per_forward'] / 1024:.1f} KiB, "
                  f"full {r['full_bytes_per_forward'] / mib:.2f} MiB "
                  f"(activations captured {r['activation_bytes_per_forward'] / mib:.2f} MiB, "
                  f"ratio {r['full_bytes_per_forward'] / r['activation_bytes_per_forward']:.2f})")


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
