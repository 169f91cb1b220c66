"""Op-level capture cost and file size per forward on the built-in tiny Llama. Not a test.

    python bench/bench_ops.py [--threads 1] [--repeats 5] [--seq 64]

One prefill forward at sequence length `seq`: the plain forward vs the same forward under the
op recorder (`--level op`: every operator inside the default modules, plus the module records)
in four variants: stats, full (tensors), full + op inputs (what shadow replay and
`accucheck replay` need), and full + inputs + shadow replay against a reference. Reported as
ratios to the plain forward measured in this same run (median over repeats), and MiB written
per forward. Reference (issue 4, Huawei msprobe on the same kind of model, seq 64): API-level
tensor dump 33x plain forward, 27.9 MiB per forward; mixed module + API level 73x, 47.8 MiB.
"""
from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from accucheck.capture.record.ops import OpRecorder
from accucheck.capture.record.selection import select_modules
from accucheck.capture.record.shadow import ShadowSource
from accucheck.capture.tiny import tiny_model_dir
from accucheck.store import CaptureWriter
from bench_capture import median_time  # same folder: run as python bench/bench_ops.py


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seq", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir(), local_files_only=True).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, args.seq),
                        generator=torch.Generator().manual_seed(args.seq))
    modules = select_modules(model)

    def forward():
        with torch.no_grad():
            return model(input_ids=ids, use_cache=False)

    plain = median_time(forward, args.repeats)
    print(f"tiny Llama, seq {args.seq}, {args.threads} thread(s): plain forward "
          f"{plain * 1e3:.1f} ms")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        ref = None
        for name, store, inputs, shadow in (("op stats", "stats", False, False),
                                            ("op full", "full", False, False),
                                            ("op full + inputs", "full", True, False),
                                            ("op full + inputs + shadow", "full", True, True)):
            path = tmp / f"{name.replace(' ', '_')}.h5"
            writer = CaptureWriter(path, meta={"bench": True}, store=store, force=True)
            src = ShadowSource(ref) if shadow else None
            rec = OpRecorder(model, writer, modules, record_inputs=inputs, shadow=src)
            n = {"req": 0}

            def captured():
                # the reference holds requests 0..repeats of the same ids: one per forward
                rec.begin_step(n["req"], 0)
                rec.end_step(forward().logits)
                n["req"] += 1

            with rec.hooks():
                t = median_time(captured, args.repeats)
            writer.close()
            if src is not None:
                src.close()
            size = os.path.getsize(path) / (args.repeats + 1) / 2**20
            if inputs and ref is None:
                ref = path
            print(f"  {name:28s} {t / plain:6.1f}x plain forward, {size:6.2f} MiB per forward"
                  f"  [{rec.n_ops // (args.repeats + 1)} ops per forward]")


if __name__ == "__main__":
    main()
