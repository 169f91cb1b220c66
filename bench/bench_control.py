"""False alarms and detection power of the control rule (accucheck.verdict.noise), measured on
the real SmolLM2-135M (30 layers) in bfloat16, with the rules without a control (the dtype
tolerance, the peer gate, the noise floor) beside it. Not a test: it writes the table of
docs/control.md.

    python bench/bench_control.py [--work DIR] [--controls 1,3 | 0] [--trials 2] [--quick]

The runs (all HF eager, store full, teacher-forced on the reference's tokens):

- the reference: float32 on the CPU (`--regime bf16`: bfloat16);
- controls and clean candidates: bfloat16 on the CPU, each with a dither of its own seed
  (accucheck.capture.faults.dithered: every rounding op's output moves one ULP with
  probability 1/4: two devices of the same precision whose kernels round differently), one
  torch thread; some clean candidates with 2 threads; two prompt sets;
- faulty candidates: a clean candidate (its own dither seed) with one graded fault planted,
  sized so that the faulty record's rel_l2 error is s x its natural noise (the controls' rel_l2
  at that record, RMS over its requests and steps), s in 1.25, 1.5, 2, 4: the fault alone
  adds e0 * sqrt(s^2 - 1). The faults (tests/planting.py), each in code no record covers:
  norm, linear (down_proj), act, the attention core, rotary, at L in 3, 14, 26 (rotary: once).

A clean pair is a false alarm when anything is named: with control, a site more than noise;
without, a culprit or a SUSPICIOUS record. A faulty pair is "named" when the
culprit is exactly the planted module (the attention core: self_attn), "wrong" when another
one is named, "missed" when none is. Captures are cached in --work (default
~/.cache/accucheck-bench/control), so a second run only re-judges.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "tests"):
    if str(p) not in sys.path:  # runnable from a source checkout
        sys.path.insert(0, str(p))

from planting import KINDS, fault, natural_noise, site_rel_l2, size_fault  # noqa: E402

PROMPT_SETS = {
    "A": ["def fibonacci(n):", "The capital of France is", "Once upon a time, a small robot",
          "Q: What is 17 times 23?\nA:", "The mitochondria is the powerhouse of",
          "import numpy as np\nx = np.arange(10)\n"],
    "B": ["Translate to French: good morning", "The three primary colors are",
          "for (int i = 0; i < n; i++) {", "In 1969, the first humans", "Water boils at",
          "My favourite book is"],
}
STEPS = 2
STRENGTHS = (1.25, 1.5, 2.0, 4.0)
DEPTHS = (3, 14, 26)


class Runs:
    """Cached captures of the real model."""

    def __init__(self, work: Path, regime: str):
        import torch
        import smollm2
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(1)
        d = smollm2.model_dir()
        self.model = AutoModelForCausalLM.from_pretrained(
            d, local_files_only=True, attn_implementation="eager").eval()
        self.tok = AutoTokenizer.from_pretrained(d, local_files_only=True)
        self.work, self.regime = work, regime
        work.mkdir(parents=True, exist_ok=True)
        self.seconds = 0.0
        self.made = 0

    def capture(self, name: str, pset: str, *, dtype: str = "bfloat16", seed: int | None = None,
                planted: tuple[str, str] | None = None, threads: int = 1,
                include: tuple[str, ...] = ()) -> Path:
        import torch
        from accucheck.capture.runners.hf import capture_model
        from accucheck.capture.faults import dithered, planted as plant

        path = self.work / f"{self.regime}-{pset}-{name}.h5"
        if path.exists():
            return path
        ref = None if name == "ref" else self.ref(pset)
        t = time.perf_counter()
        old = torch.get_num_threads()
        torch.set_num_threads(threads)
        tmp = path.with_suffix(".tmp.h5")
        try:
            with (dithered(seed) if seed is not None else nullcontext()), \
                    (plant(self.model, *planted) if planted else nullcontext()):
                capture_model(self.model, PROMPT_SETS[pset], tmp, tokenizer=self.tok,
                              store="full", max_new_tokens=STEPS, dtype=dtype,
                              include=include, force=True,
                              tokens_from=str(ref) if ref is not None else None)
        finally:
            torch.set_num_threads(old)
        tmp.rename(path)
        self.seconds += time.perf_counter() - t
        self.made += 1
        return path

    def ref(self, pset: str) -> Path:
        return self.capture("ref", pset, dtype="float32" if self.regime == "fp32" else
                            "bfloat16")

    def control(self, pset: str, i: int) -> Path:
        return self.capture(f"ctl{i}", pset, seed=1000 + i)


def calibrate(runs: Runs, kind: str, layer: int, s: float, noise: float, pset: str) -> float:
    """tests/planting.size_fault on fault-only runs of this reference's dtype."""
    dtype = "float32" if runs.regime == "fp32" else "bfloat16"

    def capture(name, planted, include):
        return runs.capture(name, pset, dtype=dtype, planted=planted, include=include)
    return size_fault(capture, runs.ref(pset), kind, layer, s, noise)


class Judge:
    """Verdicts on one candidate with 0, 1, ... control runs: the candidate is diffed once and
    each control run once per reference (compare.diff.with_controls), as `accucheck diff
    --control` would compute them."""

    def __init__(self):
        self._controls: dict[tuple[Path, Path], object] = {}

    def __call__(self, ref: Path, cand: Path, controls: dict[int, list[Path]]) -> dict[str, dict]:
        from accucheck.compare.diff import diff_captures, with_controls
        from accucheck.verdict.locate import Analysis, locate

        d = diff_captures(ref, cand)
        out = {}
        for k, ctl in controls.items():
            ctl_diffs = [self._control(ref, c) for c in ctl]
            dk = with_controls(d, ctl_diffs) if ctl_diffs else d
            a = Analysis(dk, locate(dk))
            c = a.culprit
            j = {"culprit": c.module if c is not None else None, "exit": a.exit_code}
            if ctl:
                noise = a.location.noise
                j["flagged"] = [s.site for s in noise.flagged]
                # margins: every site's excess over its threshold (> 1 is more than noise)
                j["margin"] = {s.site: s.excess / s.threshold for s in noise.sites}
            else:
                j["suspicious"] = [str(s.key) for s in a.location.suspicious]
            out["none" if not ctl else f"ctl{k}"] = j
        return out

    def _control(self, ref: Path, ctl: Path):
        from accucheck.compare.diff import diff_captures

        if (ref, ctl) not in self._controls:
            self._controls[(ref, ctl)] = diff_captures(ref, ctl)
        return self._controls[(ref, ctl)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", type=Path, default=Path(os.environ.get(
        "ACCUCHECK_BENCH_CACHE", Path.home() / ".cache" / "accucheck-bench")) / "control")
    ap.add_argument("--regime", choices=("fp32", "bf16"), default="fp32",
                    help="the reference's dtype (the candidate and controls are bfloat16)")
    ap.add_argument("--controls", default="1,3",
                    help="control-run counts to judge with (0: the no-control column only)")
    ap.add_argument("--calibration-controls", type=int, default=3,
                    help="control runs that measure each faulty record's natural noise")
    ap.add_argument("--clean", type=int, default=12, help="clean candidates per prompt set")
    ap.add_argument("--trials", type=int, default=2, help="candidate seeds per fault")
    ap.add_argument("--quick", action="store_true", help="one depth, strengths 1.5 and 2")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args(argv)
    counts = [k for k in (int(x) for x in args.controls.split(",")) if k > 0]
    runs = Runs(args.work, args.regime)
    judge = Judge()
    t0 = time.perf_counter()
    sets = ("A", "B")
    ctl = {p: [runs.control(p, i) for i in range(max([*counts, args.calibration_controls]))]
           for p in sets}

    # false alarms: clean candidates, other prompts, other dither seeds, 1 or 2 threads
    clean = []
    for p in sets:
        for i in range(args.clean):
            cand = runs.capture(f"clean{i}", p, seed=2000 + i, threads=2 if i % 3 == 2 else 1)
            row = {"set": p, "seed": 2000 + i, "threads": 2 if i % 3 == 2 else 1,
                   **judge(runs.ref(p), cand, {0: [], **{k: ctl[p][:k] for k in counts}})}
            clean.append(row)
            print(f"clean {p}{i}: " + ", ".join(
                f"{m}: {_alarm(row[m]) or 'clean'}" for m in ["none"] + [f"ctl{k}" for k in counts]),
                flush=True)

    # power: graded faults, named exactly?
    depths = DEPTHS[1:2] if args.quick else DEPTHS
    strengths = (1.5, 2.0) if args.quick else STRENGTHS
    faulty = []
    p = "A"
    for kind in KINDS:
        for layer in (depths if kind != "rotary" else (0,)):
            _, site, expect = fault(kind, layer, 0.0)
            noise = natural_noise(runs.ref(p), ctl[p][:args.calibration_controls], site)
            for s in strengths:
                d = calibrate(runs, kind, layer, s, noise, p)
                if not math.isfinite(d):
                    print(f"{kind} L{layer} x{s}: cannot be planted at this strength", flush=True)
                    continue
                planted, _, _ = fault(kind, layer, d)
                for t in range(args.trials):
                    cand = runs.capture(f"f-{kind}{layer}-{s}-{t}", p, seed=3000 + t,
                                        planted=planted)
                    got = site_rel_l2(runs.ref(p), cand, site) / noise
                    row = {"kind": kind, "layer": layer, "s": s, "D": d, "trial": t,
                           "measured": got, "expect": expect, "site": site,
                           **judge(runs.ref(p), cand, {0: [], **{k: ctl[p][:k] for k in counts}})}
                    faulty.append(row)
                    print(f"{kind} L{layer} x{s} (measured x{got:.2f}) trial {t}: " + ", ".join(
                        f"{m}: {_outcome(row[m], expect)}" for m in
                        ["none"] + [f"ctl{k}" for k in counts]), flush=True)
    print(table(clean, faulty, counts))
    print(f"\n{runs.made} captures made ({runs.seconds:.0f} s), total {time.perf_counter() - t0:.0f} s")
    if args.json:
        args.json.write_text(json.dumps({"clean": clean, "faulty": faulty}, indent=1))
    return 0


def _alarm(j: dict) -> str | None:
    if j.get("flagged"):
        return f"more than noise at {j['flagged'][0]}"
    if j["culprit"]:
        return f"culprit {j['culprit']}"
    if j.get("suspicious"):
        return f"suspicious {j['suspicious'][0]}"
    return None


def _outcome(j: dict, expect: str) -> str:
    if j["culprit"] == expect:
        return "named"
    return "missed" if j["culprit"] is None else f"wrong ({j['culprit']})"


def table(clean: list[dict], faulty: list[dict], counts: list[int]) -> str:
    modes = ["none"] + [f"ctl{k}" for k in counts]
    label = {"none": "no control (tolerance + peer gate)",
             **{f"ctl{k}": f"{k} control run{'s' if k > 1 else ''}" for k in counts}}
    out = ["", "| | " + " | ".join(label[m] for m in modes) + " |",
           "|---|" + "---|" * len(modes)]
    n = len(clean)
    def alarms(m: str) -> str:
        cell = f"{sum(_alarm(r[m]) is not None for r in clean)} / {n}"
        if m == "none":  # a culprit, or only suspicious records (the noise floor)
            named = sum(r[m]["culprit"] is not None for r in clean)
            cell += f" ({named} culprit, {sum(_alarm(r[m]) is not None for r in clean) - named}" \
                    f" suspicious only)"
        return cell
    out.append(f"| false alarms ({n} clean pairs) | " + " | ".join(alarms(m) for m in modes)
               + " |")
    for s in sorted({r["s"] for r in faulty}):
        rows = [r for r in faulty if r["s"] == s]
        cells = []
        for m in modes:
            named = sum(_outcome(r[m], r["expect"]) == "named" for r in rows)
            wrong = sum(_outcome(r[m], r["expect"]).startswith("wrong") for r in rows)
            cells.append(f"{named} / {len(rows)} named ({100 * named / len(rows):.0f} %), "
                         f"{wrong} wrong")
        out.append(f"| fault x{s:g} | " + " | ".join(cells) + " |")
    ctl = [m for m in modes if m != "none"]
    if ctl:
        out += ["", "Margins (a site's excess over its threshold; above 1 it is more than "
                "noise):", ""]
        out.append("| | " + " | ".join(label[m] for m in ctl) + " |")
        out.append("|---|" + "---|" * len(ctl))
        out.append("| clean: the largest of any site in any clean pair | " + " | ".join(
            f"{max(max(r[m]['margin'].values()) for r in clean):.2f}" for m in ctl) + " |")
        for s in sorted({r["s"] for r in faulty}):
            rows = [r for r in faulty if r["s"] == s]
            out.append(f"| fault x{s:g}: the planted site, median (lowest) | " + " | ".join(
                f"{statistics.median(r[m]['margin'].get(r['site'], math.nan) for r in rows):.2f} "
                f"({min(r[m]['margin'].get(r['site'], math.nan) for r in rows):.2f})" for m in ctl) + " |")
    out += ["", "Per kind (named / trials, with the most controls):", ""]
    m = modes[-1]
    kinds = sorted({r["kind"] for r in faulty}, key=KINDS.index)
    out.append("| strength | " + " | ".join(kinds) + " |")
    out.append("|---|" + "---|" * len(kinds))
    for s in sorted({r["s"] for r in faulty}):
        cells = []
        for k in kinds:
            rows = [r for r in faulty if r["s"] == s and r["kind"] == k]
            named = sum(_outcome(r[m], r["expect"]) == "named" for r in rows)
            cells.append(f"{named} / {len(rows)}" if rows else "-")
        out.append(f"| x{s:g} | " + " | ".join(cells) + " |")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
