"""The cost of `accucheck impact`: forward runs and wall time against the number of layers,
block-first (the decoder layer blocks, then --bisect K inside the top K) against leaf-by-leaf
(every leaf module of every layer patched alone). Not a test.

    python bench/bench_impact.py [--layers 2,4,8] [--bisect 1] [--threads 2]

For each layer count: the tiny Llama with that many layers (accucheck.capture.tiny, seed 0),
a full-store reference of 2 prompts x 4 decode steps on the CPU in float32, and a candidate of
the same weights with `norm:part:0.1` planted in the middle layer's post_attention_layernorm.
Each row says how many teacher-forced runs the strategy made (one run = every prompt, every
step), their wall time, and the sites that recover the most (the planted module should be
among them). Runs are deterministic counts; times depend on the machine's load (printed).
"""
from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

PROMPTS = ["The quick brown fox jumps", "Greedy decoding picks"]


def leaves(model, n_layers: int) -> list[str]:
    return [n for n, m in model.named_modules()
            if n.startswith("model.layers.") and not list(m.children())]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", default="2,4,8")
    ap.add_argument("--bisect", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from accucheck.capture.runners.hf import capture_model
    from accucheck.capture.tiny import write_tiny_model
    from accucheck.impact.api import ImpactOptions, impact_model

    torch.set_num_threads(a.threads)
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    print(f"{'layers':>6}  {'strategy':<26} {'runs':>5} {'seconds':>8}  top sites")
    with tempfile.TemporaryDirectory() as tmp:
        for n in [int(x) for x in a.layers.split(",")]:
            d = write_tiny_model(Path(tmp) / f"tiny{n}", seed=0, num_hidden_layers=n)
            model = AutoModelForCausalLM.from_pretrained(d).eval()
            tok = AutoTokenizer.from_pretrained(d)
            ref = capture_model(model, PROMPTS, Path(tmp) / f"ref{n}.h5", tokenizer=tok,
                                store="full", max_new_tokens=4)
            fault = (f"model.layers.{n // 2}.post_attention_layernorm", "norm:part:0.1")
            for name, opts in (
                    (f"block-first, bisect {a.bisect}",
                     ImpactOptions(plant=(fault,), bisect=a.bisect)),
                    ("leaf-by-leaf", ImpactOptions(plant=(fault,),
                                                   include=tuple(leaves(model, n))))):
                res = impact_model(ref, model, opts)
                top = ", ".join(s.site for s in res.leaders())
                print(f"{n:>6}  {name:<26} {res.runs:>5} {res.seconds:>8.2f}  {top}")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
