"""Faults on the real SmolLM2 (bf16 candidate): does `diff` call each more than noise, and how
much of the output gap does its block recover? The table of docs/impact.md "On SmolLM2", case 2.
Not a test (tests/test_impact_real.py holds the chosen case).

    python bench/bench_impact_damped.py [MODULE=FAULT ...] [--out DIR]

The setting of tests/test_impact_real.py: prompts "def fibonacci(n):" and "The capital of
France is", 1 decode step; REF float32 --store full; two bf16 controls made of the CPU's kernels
with their last bit dithered (seeds 1000, 1001), forced to REF's tokens; each candidate bf16
with the fault planted, forced to REF's tokens. Per fault: the sites `diff` flags (with z), its
culprit, the candidate's gap, the control's own gap, and what the fault's layer block recovers
against its band (impact with the first control). Captures are cached in --out.
"""
from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

DEFAULT = ("model.layers.5.self_attn.v_proj=tile:0.5", "model.layers.5.self_attn.v_proj=tile:0.25",
           "model.layers.5.self_attn.v_proj=tile:1", "model.layers.5.self_attn.k_proj=tile:0.5",
           "model.layers.10.self_attn.v_proj=tile:0.5",
           "model.layers.14.self_attn.o_proj=tile:0.3")
PROMPTS = ["def fibonacci(n):", "The capital of France is"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("faults", nargs="*", default=list(DEFAULT), metavar="MODULE=FAULT")
    ap.add_argument("--out", default=None, help="where the captures go (default: a temp dir)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    import smollm2
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from accucheck.capture.faults import dithered, planted
    from accucheck.capture.runners.hf import capture_model
    from accucheck.impact.api import ImpactOptions, impact_model
    from accucheck.verdict.locate import analyze

    torch.set_num_threads(args.threads)
    d = smollm2.model_dir()
    model = AutoModelForCausalLM.from_pretrained(d, local_files_only=True,
                                                 attn_implementation="eager").eval()
    tok = AutoTokenizer.from_pretrained(d, local_files_only=True)
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    out = Path(args.out or tempfile.mkdtemp(prefix="impact-damped-"))
    out.mkdir(parents=True, exist_ok=True)

    def cap(name, dtype="float32", seed=None, fault=None):
        p = out / f"{name}.h5"
        if not p.exists():
            with (dithered(seed) if seed is not None else nullcontext()), \
                    (planted(model, *fault) if fault else nullcontext()):
                capture_model(model, PROMPTS, p, tokenizer=tok, store="full", max_new_tokens=1,
                              dtype=dtype, tokens_from=None if name == "ref" else
                              str(out / "ref.h5"))
        return p

    ref = cap("ref")
    ctls = [cap(f"ctl{i}", "bfloat16", seed=1000 + i) for i in range(2)]
    print("| fault | diff with 2 controls | baseline lp / KL / flips | control's gap lp / KL | "
          "block recovers lp / KL | band lp / KL | s |")
    print("|---|---|---|---|---|---|---|")
    for spec in args.faults:
        module, _, fault = spec.partition("=")
        block = ".".join(module.split(".")[:3])
        t = time.perf_counter()
        cand = cap("cand-" + spec.replace("/", "_"), "bfloat16", fault=(module, fault))
        a = analyze(ref, cand, controls=ctls)
        flagged = ", ".join(f"{x.site.split('#')[0]} z {x.z:.0f}"
                            for x in a.location.noise.flagged[:2]) or "nothing flagged"
        culprit = a.culprit.module if a.culprit else "none"
        res = impact_model(ref, bf16, ImpactOptions(plant=((module, fault),),
                                                    control=str(ctls[0]), include=(block,)))
        b, g, c = res.sites[0], res.baseline, res.control_gap
        print(f"| {spec} | {flagged}; culprit {culprit} | {g.logprob:.4f} / {g.kl:.5f} / "
              f"{g.flips} | {c.logprob:.4f} / {c.kl:.4f} | {100 * b.recovered['logprob']:.1f} % / "
              f"{100 * b.recovered['kl']:.1f} % | {100 * b.band['logprob']:.1f} % / "
              f"{100 * b.band['kl']:.1f} % | {time.perf_counter() - t:.0f} |", flush=True)


if __name__ == "__main__":
    main()
