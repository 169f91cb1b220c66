"""The observer effect of graph-mode taps, measured (issue: graph mode as production runs it).

For the built-in tiny Llama on the CPU with inductor, one 48-token prompt (prefill only), in
float32 and bfloat16, prints:
- plain compiled vs eager: rel L2 of the untapped compiled logits from the eager logits (the
  eager-vs-graph difference a user wants to measure);
- for each tap set: logits rel L2 of the tapped compiled logits from the untapped ones (the capture's
  own meta "observer_effect", accucheck.capture.record.graph), and that as a share of the first row.

Tap sets: the default (kernel boundaries: every Linear's input and output), every default
module (the eager selection, --include each), the decoder-layer outputs only, the embedding
only. Every figure comes from one run of this script (each capture compiles twice: about a
minute each on 2 cores, ~10 min in all).

    python bench/bench_observer.py [--threads 1] [--tokens 48]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from accucheck.capture.options import CaptureOptions
    from accucheck.capture.runners.hf import capture_dir
    from accucheck.capture.models import load_model_dir
    from accucheck.capture.record.selection import default_modules
    from accucheck.capture.tiny import tiny_model_dir
    from accucheck.store import open_capture

    model_dir = tiny_model_dir()
    model, _ = load_model_dir(model_dir, torch.float32, torch.device("cpu"))
    vocab = model.config.vocab_size
    prompt = [list(np.random.default_rng(0).integers(3, vocab, args.tokens))]
    layers = [n for n in default_modules(model) if n.count(".") == 2
              and n.startswith("model.layers.")]
    tap_sets = [("default: kernel boundaries (Linear in + out)", ()),
                ("every default module", tuple(default_modules(model))),
                ("decoder-layer outputs only", tuple(layers)),
                ("embedding only", ("model.embed_tokens",))]
    print(f"tiny Llama, inductor, CPU, {args.threads} thread(s), {args.tokens}-token prompt, "
          f"prefill; load average {os.getloadavg()[0]:.2f}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in args.dtypes.split(","):
            base = dict(dtype=dtype, store="full", max_new_tokens=0)
            eager = capture_dir(model_dir, prompt, Path(tmp) / f"eager-{dtype}.h5",
                                CaptureOptions(**base))
            with open_capture(eager) as e:
                ref = e.read(next(r.key for r in e.rows if r.kind == "logits")).astype(np.float64)
            plain = None
            for label, include in tap_sets:
                t0 = time.monotonic()
                out = capture_dir(model_dir, prompt, Path(tmp) / f"g-{dtype}-{len(rows)}.h5",
                                  CaptureOptions(mode="graph", include=include, **base))
                with open_capture(out) as g:
                    oe = g.meta["observer_effect"]
                    logits = g.read(next(r.key for r in g.rows if r.kind == "logits"))
                    n_rec = sum(r.kind != "logits" for r in g.rows)
                if plain is None:
                    plain = float(np.linalg.norm(logits.astype(np.float64) - ref)
                                  / np.linalg.norm(ref))
                    rows.append((dtype, "plain compiled vs eager", "-", f"{plain:.3g}", "-",
                                 "-"))
                e = oe["max_rel_l2"]
                rows.append((dtype, f"taps: {label}", n_rec,
                             f"{e:.3g}" + (" (bitwise)" if oe["bitwise"] else ""),
                             f"{100 * e / plain:.2g} %" if plain else "-",
                             f"{time.monotonic() - t0:.0f} s"))
                print(" | ".join(map(str, rows[-1])), file=sys.stderr, flush=True)
    from tabulate import tabulate

    print(tabulate(rows, headers=["dtype", "logits compared", "records",
                                  "logits rel L2", "of eager vs graph",
                                  "capture wall"], tablefmt="github"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
