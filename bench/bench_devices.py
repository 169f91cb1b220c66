"""False alarms between correct devices, and detection power on them: the real SmolLM2-135M,
candidates emulated as structurally different correct devices (accucheck.capture.emulate: gpu,
npu, mixed, dither), each store mode, with and without a control. Not a test: it writes the
table of docs/control.md ("Correct devices").

    python bench/bench_devices.py [--pairs 12] [--first-pair 0] [--devices gpu,npu,mixed,dither]
        [--stores stats,full] [--faults | --only-faults] [--fault-kinds linear,act,core,norm,rotary]
        [--fault-layers 4,14,24]
        [--strengths 0.5,1.25,2,4]
        [--columns fp32 ref,bf16 ref,control,2 controls,plain control]
        [--controls 1] [--json rows.json]

Clean pairs: pair k (--prompts-per-pair prompts, default 2, of a pool of 48 with prefixed
variants once it is used up; 2 decode steps) captured as
- the references: float32 and bfloat16 on the CPU (HF, sdpa attention: transformers' default);
- the control: bfloat16 on the CPU with a dither of its own seed (what `--control-for` makes,
  on a device that rounds its own way), and a second one with another seed (column
  "2 controls"); column "plain control": the bfloat16 reference above as the one control,
  exactly what `capture --control-for` and `diff --control auto` make (the CPU's kernels, no
  dither);
- the candidate: bfloat16 on emulated device D (seed k), teacher-forced to the float32
  reference's tokens.
A clean pair is a false alarm when the verdict exits 1, names a culprit or a SUSPICIOUS record
(no control), or flags a site (with the control).

Faults (--faults, or --only-faults): graded faults (tests/planting.py: norm, linear, act and
core at layers 4, 14 and 24, rotary once) planted inside each device, 4 prompts, sized to x0.5
(below the noise: the fault alone is half of it), x1.25, x2 and x4 their record's natural
noise (measured in the full store against 3 dither controls), in each store mode; "named" is
the exact planted module, "wrong" any other culprit; with --controls 1-3 dither controls.
Several processes: --devices.
Captures are cached in --work (default ~/.cache/accucheck-bench/devices).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from contextlib import nullcontext
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "tests"):
    if str(p) not in sys.path:  # runnable from a source checkout
        sys.path.insert(0, str(p))

from planting import fault, natural_noise, size_fault  # noqa: E402

POOL = [
    "def fibonacci(n):", "The capital of France is", "Once upon a time, a small robot",
    "Q: What is 17 times 23?\nA:", "The mitochondria is the powerhouse of",
    "import numpy as np\nx = np.arange(10)\n", "Translate to French: good morning",
    "The three primary colors are", "for (int i = 0; i < n; i++) {", "In 1969, the first humans",
    "Water boils at", "My favourite book is", "SELECT name FROM users WHERE",
    "The quick brown fox", "Photosynthesis converts", "def quicksort(arr):",
    "The largest planet in the solar system is", "To be or not to be,",
    "A haiku about autumn:\n", "The derivative of x^2 is", "class Stack:\n    def __init__",
    "Berlin is the capital of", "Dear hiring manager,", "The GDP of a country measures",
    "Machine learning is", "#include <stdio.h>\nint main() {", "The speed of light is",
    "Shakespeare wrote", "List three fruits:", "The Pythagorean theorem states",
    "In a galaxy far, far away", "HTTP status 404 means", "The boiling point of nitrogen",
    "Write a limerick about a cat:", "The French Revolution began in", "git commit -m",
    "A prime number is", "The heart pumps blood", "Once, in a quiet village,",
    "The chemical symbol for gold is", "print('hello')\n", "Neural networks learn by",
    "The Great Wall of China", "An apple a day", "The square root of 144 is",
    "Rust's borrow checker", "The Amazon rainforest", "Summer is the season when",
]
STEPS = 2
STRENGTHS = (0.5, 1.25, 2.0, 4.0)   # x the record's natural noise (0.5: below it)
FAULT_KINDS = ("linear", "act", "core", "norm")
FAULT_LAYERS = (4, 14, 24)


class Runs:
    def __init__(self, work: Path):
        import torch
        import smollm2
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(1)
        d = smollm2.model_dir()
        self.model = AutoModelForCausalLM.from_pretrained(d, local_files_only=True).eval()
        self.tok = AutoTokenizer.from_pretrained(d, local_files_only=True)
        self.work = work
        work.mkdir(parents=True, exist_ok=True)
        self.made, self.seconds = 0, 0.0

    def capture(self, name: str, prompts: list[str], store: str, *, dtype: str = "bfloat16",
                device: str | None = None, seed: int = 0, ref: Path | None = None,
                planted: tuple[str, str] | None = None, include: tuple[str, ...] = ()) -> Path:
        from accucheck.capture.runners.hf import capture_model
        from accucheck.capture.emulate import emulated
        from accucheck.capture.faults import planted as plant

        # a planted run's file names its fault's family: a cached capture of another fault
        # mechanism under the same name (the attention core's, before attn:scale) is not reused
        family = f"-{planted[1].split(':')[0]}" if planted else ""
        path = self.work / f"{name}{family}-{store}.h5"
        if path.exists():
            return path
        t = time.perf_counter()
        tmp = path.with_suffix(f".{os.getpid()}.tmp.h5")  # processes may share --work
        # the fault first: its hook then runs after the emulated device's (hooks are prepended),
        # so a faulty norm kernel replaces the device's fused one instead of being replaced
        with (plant(self.model, *planted) if planted else nullcontext()), \
                (emulated(self.model, device, seed) if device else nullcontext()):
            capture_model(self.model, prompts, tmp, tokenizer=self.tok, store=store,
                          max_new_tokens=STEPS, dtype=dtype, include=include, force=True,
                          tokens_from=str(ref) if ref is not None else None)
        tmp.rename(path)
        self.made += 1
        self.seconds += time.perf_counter() - t
        return path


def judge(ref: Path, cand: Path, controls: tuple[Path, ...]) -> dict:
    from accucheck.verdict.locate import analyze

    a = analyze(ref, cand, controls=controls)
    c = a.culprit
    out = {"exit": a.exit_code, "culprit": c.module if c is not None else None,
           "suspicious": [str(s.key) for s in a.location.suspicious][:3]}
    if a.location.noise is not None:
        out["flagged"] = [s.site for s in a.location.noise.flagged][:3]
        out["margin"] = max((s.excess / s.threshold for s in a.location.noise.sites),
                            default=0.0)
    return out


def alarm(j: dict) -> bool:
    return j["exit"] != 0 or j["culprit"] is not None or bool(j["suspicious"]) \
        or bool(j.get("flagged"))


VARIANTS = ("", "Answer briefly. ", "Note: ", "Continue: ", "Question: ")  # 240 distinct prompts


def pair_prompts(k: int, per_pair: int) -> list[str]:
    """Pair k's prompts: `per_pair` of POOL in turn, a prefix of VARIANTS once POOL is used up."""
    out = []
    for j in range(per_pair):
        i = k * per_pair + j
        out.append(VARIANTS[(i // len(POOL)) % len(VARIANTS)] + POOL[i % len(POOL)])
    return out


COLUMNS = ("fp32 ref", "bf16 ref", "control", "2 controls", "plain control")


def clean_rows(runs: Runs, pairs: range, devices: list[str], stores: list[str],
               per_pair: int = 2, columns: tuple[str, ...] = COLUMNS[:3]) -> list[dict]:
    rows = []
    for k in pairs:
        prompts = pair_prompts(k, per_pair)
        for store in stores:
            tag = f"p{k}x{per_pair}"
            r32 = runs.capture(f"{tag}-ref32", prompts, store, dtype="float32")
            r16 = runs.capture(f"{tag}-ref16", prompts, store, ref=r32) \
                if {"bf16 ref", "plain control"} & set(columns) else None
            ctl = runs.capture(f"{tag}-ctl", prompts, store, device="dither", seed=1000 + k,
                               ref=r32) if {"control", "2 controls"} & set(columns) else None
            ctl2 = runs.capture(f"{tag}-ctl2", prompts, store, device="dither",
                                seed=2000 + k, ref=r32) if "2 controls" in columns else None
            for dev in devices:
                cand = runs.capture(f"{tag}-{dev}", prompts, store, device=dev, seed=k, ref=r32)
                how = {"fp32 ref": (r32, ()), "bf16 ref": (r16, ()), "control": (r32, (ctl,)),
                       "2 controls": (r32, (ctl, ctl2)), "plain control": (r32, (r16,))}
                row = {"pair": k, "store": store, "device": dev}
                row.update({m: judge(how[m][0], cand, how[m][1]) for m in columns})
                rows.append(row)
                print(f"pair {k} {store} {dev}: " + ", ".join(
                    f"{m}: {'ALARM ' + json.dumps(row[m]) if alarm(row[m]) else 'clean'}"
                    for m in columns), flush=True)
    return rows


def fault_rows(runs: Runs, devices: list[str], stores: list[str],
               layers: tuple[int, ...] = FAULT_LAYERS,
               strengths: tuple[float, ...] = STRENGTHS, controls: int = 1,
               kinds: tuple[str, ...] = FAULT_KINDS + ("rotary",)) -> list[dict]:
    """Graded faults (tests/planting.py) of `kinds` at `layers` (rotary: once), planted
    inside each emulated device, in each store mode, judged without and with `controls`
    control runs (1-3)."""
    prompts = POOL[:4]
    ref = {st: runs.capture("f-ref32", prompts, st, dtype="float32") for st in stores}
    full = runs.capture("f-ref32", prompts, "full", dtype="float32")
    ctls = {st: [runs.capture(f"f-ctl{i}", prompts, st, device="dither", seed=500 + i,
                              ref=full) for i in range(3)] for st in set(stores) | {"full"}}
    rows = []
    for kind, layer in [(k, ly) for k in FAULT_KINDS if k in kinds for ly in layers] \
            + [("rotary", 0)] * ("rotary" in kinds):
        _, site, expect = fault(kind, layer, 0.0)
        noise = natural_noise(full, ctls["full"], site)
        for s in strengths:
            def calibration(name, planted, include):
                return runs.capture(name, prompts, "full", dtype="float32", planted=planted,
                                    include=include)
            d = size_fault(calibration, full, kind, layer, s, noise)
            if not math.isfinite(d):
                continue
            for dev in devices:
                for st in stores:
                    cand = runs.capture(f"f-{dev}-{kind}{layer}-{s}", prompts, st, device=dev,
                                        seed=9, ref=full, planted=fault(kind, layer, d)[0])
                    row = {"device": dev, "store": st, "kind": kind, "layer": layer, "s": s,
                           "expect": expect, "none": judge(ref[st], cand, ()),
                           "control": judge(ref[st], cand, tuple(ctls[st][:controls]))}
                    rows.append(row)
                    print(f"fault {dev} {st} {kind}{layer} x{s}: none -> "
                          f"{row['none']['culprit']}, control -> {row['control']['culprit']}",
                          flush=True)
    return rows


def table(clean: list[dict], faulty: list[dict], controls: int = 1) -> str:
    cols = [m for m in COLUMNS if clean and m in clean[0]]
    ctl = [m for m in cols if "control" in m]
    out = ["| device | store | pairs | " + " | ".join(cols) + " | largest control margin |",
           "|---|---|---|" + "---|" * (len(cols) + 1)] if clean else []
    keys = sorted({(r["device"], r["store"]) for r in clean})
    for dev, store in keys:
        rows = [r for r in clean if (r["device"], r["store"]) == (dev, store)]
        cells = [f"{sum(alarm(r[m]) for r in rows)} / {len(rows)}" for m in cols]
        margin = max((r[m].get("margin", 0.0) for r in rows for m in ctl), default=0.0)
        out.append(f"| {dev} | {store} | {len(rows)} | " + " | ".join(cells)
                   + f" | {margin:.2f} |")
    if faulty:
        out += ["", "| device | store | strength | faults | no control: named / wrong | "
                f"{controls} control(s): named / wrong |", "|---|---|---|---|---|---|"]
        for dev in sorted({r["device"] for r in faulty}):
            for store in sorted({r["store"] for r in faulty}):
                for s in STRENGTHS:
                    rows = [r for r in faulty
                            if (r["device"], r["store"], r["s"]) == (dev, store, s)]
                    if not rows:
                        continue
                    cells = []
                    for m in ("none", "control"):
                        named = sum(r[m]["culprit"] == r["expect"] for r in rows)
                        wrong = sum(r[m]["culprit"] not in (None, r["expect"]) for r in rows)
                        cells.append(f"{named} / {wrong}")
                    out.append(f"| {dev} | {store} | x{s:g} | {len(rows)} | "
                               + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", type=Path, default=Path(os.environ.get(
        "ACCUCHECK_BENCH_CACHE", Path.home() / ".cache" / "accucheck-bench")) / "devices")
    ap.add_argument("--pairs", type=int, default=12)
    ap.add_argument("--first-pair", type=int, default=0,
                    help="start at this pair (several processes share one --work)")
    ap.add_argument("--prompts-per-pair", type=int, default=2)
    ap.add_argument("--devices", default="gpu,npu,mixed,dither")
    ap.add_argument("--stores", default="stats,full")
    ap.add_argument("--faults", action="store_true", help="also the graded faults")
    ap.add_argument("--only-faults", action="store_true", help="the graded faults alone")
    ap.add_argument("--fault-kinds", default=",".join(FAULT_KINDS + ("rotary",)))
    ap.add_argument("--fault-layers", default=",".join(map(str, FAULT_LAYERS)))
    ap.add_argument("--strengths", default=",".join(map(str, STRENGTHS)))
    ap.add_argument("--columns", default=",".join(COLUMNS[:3]),
                    help=f"the verdicts of a clean row, of: {', '.join(COLUMNS)}")
    ap.add_argument("--controls", type=int, default=1, choices=(1, 2, 3),
                    help="control runs a fault is judged with")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args(argv)
    runs = Runs(args.work)
    t0 = time.perf_counter()
    devices = args.devices.split(",")
    pairs = range(args.first_pair, args.first_pair + args.pairs)
    stores = args.stores.split(",")
    columns = tuple(args.columns.split(","))
    if set(columns) - set(COLUMNS):
        ap.error(f"--columns: one or more of {', '.join(COLUMNS)}")
    if set(args.fault_kinds.split(",")) - set(FAULT_KINDS + ("rotary",)):
        ap.error(f"--fault-kinds: one or more of {', '.join(FAULT_KINDS + ('rotary',))}")
    clean = [] if args.only_faults else clean_rows(runs, pairs, devices, stores,
                                                   args.prompts_per_pair, columns)
    faulty = fault_rows(runs, devices, stores,
                        tuple(int(x) for x in args.fault_layers.split(",")),
                        tuple(float(x) for x in args.strengths.split(",")), args.controls,
                        tuple(args.fault_kinds.split(","))) \
        if args.faults or args.only_faults else []
    print(table(clean, faulty, args.controls))
    print(f"\n{runs.made} captures made ({runs.seconds:.0f} s), total "
          f"{time.perf_counter() - t0:.0f} s")
    if args.json:
        args.json.write_text(json.dumps({"clean": clean, "faulty": faulty}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
