"""Token flips between correct devices: how far over the logit noise their margins reach, the
measurement behind compare.tolerances.NEAR_TIE_FACTOR. Not a test: it reads the clean pairs
bench/bench_devices.py captured (run it first, with the stores and pairs asked here) and writes
the table of docs/control.md ("Token flips").

    python bench/bench_flips.py [--pairs 100] [--first-pair 0] [--store stats]
        [--devices gpu,npu,mixed,dither] [--json flips.json]

Every logits position of every request and step where the two runs' top-1 tokens differ, in
the diffs of each emulated device against the float32 reference, the bfloat16 reference and
the dithered bfloat16 control (bf16 against bf16, the everyday diff), and of the two controls:
its reference top-1 / top-2 margin over the logit noise (compare.metrics.logit_noise, or over
the tokens both sides hold with top-k logits, compare.topk). Prints how many flips reach each
multiple of the noise, the largest, and the share a Gaussian model of the errors expects
(margins spread evenly near 0, the margin's change N(0, 2 noise^2)).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # runnable from a source checkout
    sys.path.insert(0, str(ROOT))

FACTORS = (3.0, 3.5, 4.0, 4.5, 5.0, 6.0, 7.0, 8.0)


def flips(work: Path, pairs: range, store: str, devices: list[str]) -> list[dict]:
    from accucheck.compare.diff import diff_captures

    out = []
    for p in pairs:
        cases = [(ref, dev) for ref in ("ref32", "ref16", "ctl") for dev in devices]
        cases.append(("ctl", "ctl2"))
        for ref, cand in cases:
            a, b = (work / f"p{p}x2-{n}-{store}.h5" for n in (ref, cand))
            if not (a.exists() and b.exists()):
                sys.exit(f"{a if not a.exists() else b}: not captured; run bench/bench_devices.py "
                         f"--first-pair {p} --stores {store} first")
            for step in diff_captures(a, b, include=["logits"]).logits:
                out += [{"pair": p, "ref": ref, "cand": cand, "req": step.key.req,
                         "step": step.key.step, "position": q.position, "margin": q.margin,
                         "noise": q.noise} for q in step.positions if not q.agree]
        print(f"pair {p}: {len(out)} flips so far", file=sys.stderr, flush=True)
    return out


def gaussian_share(factor: float) -> float:
    """E[(Z - f / sqrt 2)+] / E[Z+]: the share of flips whose margin exceeds `factor` x the
    noise, for margins spread evenly near 0 and a margin change N(0, 2 noise^2)."""
    z = factor / math.sqrt(2.0)
    pdf = math.exp(-z * z / 2) / math.sqrt(2 * math.pi)
    sf = 0.5 * math.erfc(z / math.sqrt(2.0))
    return (pdf - z * sf) / (1 / math.sqrt(2 * math.pi))


def table(rows: list[dict]) -> str:
    ratios = [r["margin"] / r["noise"] if r["noise"] > 0 else math.inf for r in rows]
    out = ["| margin over the noise | flips | a Gaussian model expects |", "|---|---|---|"]
    for f in FACTORS:
        out.append(f"| > x{f:g} | {sum(x > f for x in ratios)} | "
                   f"{len(rows) * gaussian_share(f):.2f} |")
    top = max(ratios, default=0.0)
    out.append(f"\n{len(rows)} flips; the largest margin x{top:.2f} the noise")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", type=Path, default=Path(os.environ.get(
        "ACCUCHECK_BENCH_CACHE", Path.home() / ".cache" / "accucheck-bench")) / "devices")
    ap.add_argument("--pairs", type=int, default=100)
    ap.add_argument("--first-pair", type=int, default=0)
    ap.add_argument("--store", choices=("stats", "full"), default="stats")
    ap.add_argument("--devices", default="gpu,npu,mixed,dither")
    ap.add_argument("--json", type=Path, help="also write every flip here")
    args = ap.parse_args(argv)
    rows = flips(args.work, range(args.first_pair, args.first_pair + args.pairs), args.store,
                 args.devices.split(","))
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
