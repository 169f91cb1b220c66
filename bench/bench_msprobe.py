"""msprobe dumps of the tiny Llama, and `msprobe compare` vs `accucheck diff` on them.

    python bench/bench_msprobe.py [--workdir DIR] [--keep] [--repeat 3] [--big-tokens 70] \
        [--skip-pairs] [--skip-big]                                 # side-by-side + timings
    python bench/bench_msprobe.py dump OUT --task statistics --level mix \
        --variants ref,same,fault,fused,bf16 [--tokens 4] [--steps 1] [--model DIR]

`dump` runs msprobe's PyTorch dumper (PrecisionDebugger, mindstudio-probe) on the CPU, one
variant after the other in this process, and leaves one ordinary msprobe dump per variant:
OUT/<variant>/step<N>/proc<pid>/{dump.json, construct.json, stack.json, dump_tensor_data/}.
Run it in its own process (the tests and the bench do): msprobe patches torch functions
process-wide and its debugger is a per-process singleton. Variants (one fresh model each, the
same prompt, decode steps teacher-forced on the reference's greedy tokens):

    ref, same   the float32 model (two independent runs: `same` is the identical candidate)
    fault       ref with planted(model, FAULT_MODULE, FAULT) (accucheck.capture.faults)
    fused       every LlamaRMSNorm computed by one torch.nn.functional.rms_norm call
    bf16        the whole model in bfloat16

A planted fault is a forward hook; msprobe moves its own module hook to the front of each
module's forward hooks on the module's first call, so the fault is planted after one warm-up
forward (its dump is discarded): then msprobe records the faulty output, as it would record a
faulty kernel's. The fused variant patches LlamaRMSNorm before msprobe first sees the model
(msprobe wraps each module's bound forward on the first start).

The default command dumps ref / same / fault / fused / bf16 in statistics and tensor mode (mix
level, 4 tokens), runs on each (ref, candidate) pair `msprobe compare` and `msprobe compare
-da` (its first-diff-node analysis; both its CLI, one process each) and accucheck (the
library, in this process: `import_msprobe` of both dumps, then `analyze`, what `accucheck
diff` runs), and prints a markdown table: msprobe's rows and error rows, the node -da names
(with its enclosing module from construct.json), accucheck's verdict, failed records, culprit
and one-sided ops, and the times. Then a ~50 MiB tensor-mode dump (`--big-tokens` tokens)
and a second run of it: wall time of `accucheck import msprobe` (one dump), `accucheck diff`
(both dump directories: import + diff) and `msprobe compare` on the pair, each its own process
(start-up included), interleaved `--repeat` times (median and min). Numbers, not a test; the
machine's load moves them.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FAULT_MODULE = "model.layers.1.post_attention_layernorm"
FAULT = "scale:1.1"
VARIANTS = ("ref", "same", "fault", "fused", "bf16")
PROMPT = "The quick brown fox jumps over the lazy dog"


# ----------------------------------------------------------------------------- dumping

@contextmanager
def _fused_rms_norm():
    """Every LlamaRMSNorm as one torch.nn.functional.rms_norm call (tests/diffcases.py)."""
    import torch
    import transformers.models.llama.modeling_llama as ml

    orig = ml.LlamaRMSNorm.forward

    def fused(self, x):
        return torch.nn.functional.rms_norm(x, self.weight.shape, self.weight,
                                            self.variance_epsilon)
    ml.LlamaRMSNorm.forward = fused
    try:
        yield
    finally:
        ml.LlamaRMSNorm.forward = orig


def _config(path: Path, task: str, level: str, dump_path: Path, summary_mode: str) -> Path:
    cfg = {"task": task, "dump_path": str(dump_path), "rank": [], "step": [], "level": level,
           "async_dump": False,
           "statistics": {"scope": [], "list": [], "data_mode": ["all"],
                          "summary_mode": summary_mode},
           "tensor": {"scope": [], "list": [], "data_mode": ["all"]}}
    path.write_text(json.dumps(cfg), encoding="utf-8")
    return path


def dump_variants(out: Path, *, task: str = "statistics", level: str = "mix",
                  variants: tuple[str, ...] = VARIANTS, tokens: int = 4, steps: int = 1,
                  model_dir: str | None = None, summary_mode: str = "statistics",
                  fault_module: str = FAULT_MODULE, fault: str = FAULT) -> dict[str, Path]:
    """Dump each variant with msprobe into OUT/<variant>/ (see the module docstring). Imports
    torch, transformers and msprobe; call it in a process of its own."""
    import torch
    from msprobe.pytorch import PrecisionDebugger
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from accucheck.capture.faults import planted
    from accucheck.capture.tiny import tiny_model_dir

    torch.manual_seed(0)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    d = Path(model_dir) if model_dir else tiny_model_dir()
    tok = AutoTokenizer.from_pretrained(d, local_files_only=True)
    ids = tok(PROMPT, return_tensors="pt").input_ids
    ids = ids.repeat(1, -(-tokens // ids.shape[1]))[:, :tokens]

    def load(dtype=torch.float32):
        return AutoModelForCausalLM.from_pretrained(d, local_files_only=True,
                                                    dtype=dtype).eval()

    # teacher forcing: every variant decodes the reference's greedy tokens
    with torch.no_grad():
        m, forced, pkv, x = load(), [], None, ids
        for _ in range(steps):
            o = m(x, past_key_values=pkv, use_cache=True)
            pkv, x = o.past_key_values, o.logits[:, -1:].argmax(-1)
            forced.append(x)
        del m
    out.mkdir(parents=True, exist_ok=True)
    raw = out / ".msprobe-raw"
    shutil.rmtree(raw, ignore_errors=True)
    dbg = PrecisionDebugger(config_path=str(_config(out / ".msprobe-config.json", task, level,
                                                    raw, summary_mode)))
    step = 0
    done: dict[str, Path] = {}

    def run(model, x, pkv):
        dbg.start(model)
        o = model(x, past_key_values=pkv, use_cache=True)
        dbg.stop()
        dbg.step()
        return o.past_key_values

    for v in variants:
        if v not in VARIANTS:
            raise SystemExit(f"unknown variant {v!r}: use {', '.join(VARIANTS)}")
        with ExitStack() as stack, torch.no_grad():
            if v == "fused":
                stack.enter_context(_fused_rms_norm())  # before msprobe wraps forward
            model = load(torch.bfloat16 if v == "bf16" else torch.float32)
            if v == "fault":
                run(model, ids[:, :1], None)  # warm-up: msprobe installs its module hooks
                shutil.rmtree(raw / f"step{step}", ignore_errors=True)
                step += 1
                stack.enter_context(planted(model, fault_module, fault))
            first = step
            pkv = run(model, ids, None)
            step += 1
            for t in forced[:steps - 1]:  # decode steps after the prefill
                pkv = run(model, t, pkv)
                step += 1
        target = out / v
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        for s in range(first, step):
            shutil.move(str(raw / f"step{s}"), str(target / f"step{s - first}"))
        done[v] = target
    shutil.rmtree(raw, ignore_errors=True)
    return done


def dump_in_subprocess(out: Path, *, task: str, level: str, variants, tokens: int = 4,
                       steps: int = 1, model_dir: str | None = None,
                       summary_mode: str = "statistics", timeout: float = 900) -> float:
    """`dump_variants` in a child process (msprobe patches torch process-wide); seconds taken."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "dump", str(out), "--task", task,
           "--level", level, "--variants", ",".join(variants), "--tokens", str(tokens),
           "--steps", str(steps), "--summary-mode", summary_mode]
    if model_dir:
        cmd += ["--model", str(model_dir)]
    env = dict(os.environ, OMP_NUM_THREADS="2")
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if p.returncode:
        raise RuntimeError(f"msprobe dump failed ({p.returncode}):\n{p.stdout[-3000:]}\n"
                           f"{p.stderr[-3000:]}")
    return time.perf_counter() - t0


# ----------------------------------------------------------------------------- msprobe compare

@dataclass(frozen=True)
class MsprobeCompare:
    rows: int
    errors: int          # rows whose Result is "error"
    warnings: int        # rows whose Result is "warning"
    seconds: float       # wall time of the `msprobe compare` command
    first_error: str     # the first error row's NPU name ("" when none)


def _dump_json(d: Path) -> Path:
    """The dump.json of a step folder (or of the folder itself)."""
    if (d / "dump.json").is_file():
        return d / "dump.json"
    found = sorted(d.glob("*/dump.json"))
    if len(found) != 1:
        raise RuntimeError(f"{d}: expected one rank/proc folder with dump.json, found "
                           f"{len(found)}")
    return found[0]


def msprobe_compare(golden: Path, target: Path, out: Path) -> MsprobeCompare:
    """Run `msprobe compare -tp TARGET -gp GOLDEN -o OUT` (its CLI, a child process) on two
    step folders and count its result rows."""
    exe = Path(sys.executable).with_name("msprobe")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "msprobe.msprobe"]
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    t0 = time.perf_counter()
    p = subprocess.run(cmd + ["compare", "-tp", str(_dump_json(target)), "-gp",
                              str(_dump_json(golden)), "-o", str(out)],
                       capture_output=True, text=True, timeout=1800)
    dt = time.perf_counter() - t0
    if p.returncode:
        raise RuntimeError(f"msprobe compare failed ({p.returncode}):\n{p.stdout[-3000:]}\n"
                           f"{p.stderr[-3000:]}")
    res = sorted(out.glob("compare_result_*.csv"))
    if not res:
        raise RuntimeError(f"msprobe compare wrote no compare_result_*.csv in {out}")
    with open(res[-1], newline="", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    result = [str(r.get("Result", "")).strip().lower() for r in rows]
    first = next((r.get("NPU Name", "") for r, x in zip(rows, result) if x == "error"), "")
    return MsprobeCompare(len(rows), result.count("error"), result.count("warning"), dt, first)


def main_dump(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="bench_msprobe.py dump")
    ap.add_argument("out", type=Path)
    ap.add_argument("--task", default="statistics", choices=["statistics", "tensor"])
    ap.add_argument("--level", default="mix", choices=["L0", "L1", "mix"])
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--tokens", type=int, default=4, help="prompt length in tokens")
    ap.add_argument("--steps", type=int, default=1, help="forwards: the prefill + steps-1 "
                                                         "decode steps")
    ap.add_argument("--summary-mode", default="statistics", choices=["statistics", "md5"])
    ap.add_argument("--model", default=None, help="tiny model directory (default: the cache)")
    a = ap.parse_args(argv)
    done = dump_variants(a.out, task=a.task, level=a.level,
                         variants=tuple(a.variants.split(",")), tokens=a.tokens, steps=a.steps,
                         model_dir=a.model, summary_mode=a.summary_mode)
    print(json.dumps({k: str(v) for k, v in done.items()}))


def msprobe_first_diff(golden: Path, target: Path, out: Path) -> tuple[str, str]:
    """`msprobe compare -da` (its first-diff-node analysis) on two step folders: (the node it
    names, that node's enclosing module from construct.json). It wants rank{R} folders: the
    proc folders are linked as rank0."""
    exe = Path(sys.executable).with_name("msprobe")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "msprobe.msprobe"]
    shutil.rmtree(out, ignore_errors=True)
    for side, d in (("t", target), ("g", golden)):
        (out / side).mkdir(parents=True)
        (out / side / "rank0").symlink_to(_dump_json(d).parent.resolve())
    (out / "res").mkdir()
    p = subprocess.run(cmd + ["compare", "-tp", str(out / "t"), "-gp", str(out / "g"), "-o",
                              str(out / "res"), "-da"], capture_output=True, text=True,
                       timeout=1800)
    if p.returncode:
        raise RuntimeError(f"msprobe compare -da failed:\n{p.stdout[-3000:]}{p.stderr[-3000:]}")
    found = sorted((out / "res").glob("diff_analyze_*.json"))
    if not found:
        return "(none)", ""
    nodes = json.loads(found[-1].read_text(encoding="utf-8"))
    first = next((n for v in nodes.values() for n in v), None)
    if first is None:
        return "(none)", ""
    name = first.get("op_name", "?")
    construct = json.loads((_dump_json(target).parent / "construct.json").read_text())
    parent = construct.get(name) or ""
    m = re.match(r"^Module\.(.+)\.[^.]+\.forward\.\d+$", parent)
    return name, m.group(1) if m else parent


def _accucheck(ref: Path, cand: Path, work: Path) -> dict:
    from accucheck.importers.msprobe import import_msprobe
    from accucheck.verdict.locate import analyze

    t0 = time.perf_counter()
    a = import_msprobe(ref, work / "ref.h5", force=True)
    b = import_msprobe(cand, work / "cand.h5", force=True)
    t1 = time.perf_counter()
    an = analyze(a.path, b.path)
    t2 = time.perf_counter()
    c = an.culprit
    fo = an.location.first_over
    return {"records": len(an.diff.records), "failed": len(an.diff.failed),
            "verdict": an.verdict.upper(), "culprit": c.where if c is not None else "-",
            "first_over": fo.module if fo is not None and c is None else "",
            "one_sided": len(an.diff.ops.one_sided) if an.diff.ops else 0,
            "import_s": t1 - t0, "diff_s": t2 - t1, "dtypes": an.diff.compute_dtypes}


def _du(d: Path) -> int:
    return sum(f.stat().st_size for f in d.rglob("*") if f.is_file())


def _timed(cmd: list[str]) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    return time.perf_counter() - t0, p


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="bench_msprobe.py")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--keep", action="store_true", help="keep the dumps and captures")
    ap.add_argument("--big-tokens", type=int, default=70,
                    help="prompt length of the large tensor-mode dump (~50 MiB per run at 70)")
    ap.add_argument("--repeat", type=int, default=3, help="timings of the large dump: runs")
    ap.add_argument("--skip-big", action="store_true")
    ap.add_argument("--skip-pairs", action="store_true")
    a = ap.parse_args(argv)
    work = a.workdir or Path(tempfile.mkdtemp(prefix="bench-msprobe-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"workdir {work}", file=sys.stderr)
    try:
        if not a.skip_pairs:
            _pairs(work)
        if not a.skip_big:
            _big(work, a.big_tokens, a.repeat)
    finally:
        if not a.keep and a.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


def _pairs(work: Path) -> None:
    lines = ["| dump | candidate | msprobe compare: rows / error rows | msprobe -da first diff "
             "(its module) | accucheck diff: verdict, failed records / compared | accucheck "
             "culprit | ops fused / absent | msprobe compare s (CLI) | accucheck import x2 + "
             "diff s (in-process) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for task in ("statistics", "tensor"):
        root = work / task
        if not (root / "ref").is_dir():
            s = dump_in_subprocess(root, task=task, level="mix", variants=VARIANTS)
            print(f"msprobe dump, {task} mode, {len(VARIANTS)} variants: {s:.0f} s",
                  file=sys.stderr)
        for cand in VARIANTS[1:]:
            mc = msprobe_compare(root / "ref" / "step0", root / cand / "step0",
                                 work / "cmp" / task / cand)
            node, mod = msprobe_first_diff(root / "ref" / "step0", root / cand / "step0",
                                           work / "da" / task / cand)
            ac = _accucheck(root / "ref", root / cand, work)
            culprit = ac["culprit"] if ac["culprit"] != "-" else (
                f"none (diffuse; first over: {ac['first_over']})" if ac["first_over"] else "none")
            lines.append(
                f"| {task} | {cand} | {mc.rows} / {mc.errors} | {node}"
                f"{f' ({mod})' if mod else ''} | {ac['verdict']}, {ac['failed']} / "
                f"{ac['records']} | {culprit} | {ac['one_sided']} | {mc.seconds:.1f} | "
                f"{ac['import_s']:.2f} + {ac['diff_s']:.2f} |")
            print(f"{task}/{cand}: msprobe compare {mc.seconds:.1f} s, accucheck import x2 "
                  f"{ac['import_s']:.2f} s + diff {ac['diff_s']:.2f} s", file=sys.stderr)
    print("\n".join(lines))


def _big(work: Path, tokens: int, repeat: int) -> None:
    root = work / "big"
    if not (root / "ref").is_dir():
        s = dump_in_subprocess(root, task="tensor", level="mix", variants=("ref", "same"),
                               tokens=tokens)
        print(f"msprobe dump, tensor mode, {tokens} tokens, 2 runs: {s:.0f} s", file=sys.stderr)
    size = _du(root / "ref")
    n_files = sum(1 for _ in (root / "ref").rglob("*.pt"))
    acc = [sys.executable, "-m", "accucheck"]
    out = work / "big.h5"
    times: dict[str, list[float]] = {"import": [], "diff": [], "msprobe": []}
    verdict, mc = "?", None
    for _ in range(repeat):  # interleaved, so load on a shared machine hits all three alike
        out.unlink(missing_ok=True)
        t, p = _timed(acc + ["import", "msprobe", str(root / "ref"), "-o", str(out)])
        if p.returncode:
            raise RuntimeError(p.stderr[-2000:])
        times["import"].append(t)
        t, p = _timed(acc + ["diff", str(root / "ref"), str(root / "same")])
        if p.returncode not in (0, 1):
            raise RuntimeError(p.stderr[-2000:])
        times["diff"].append(t)
        verdict = p.stdout.split(":", 1)[0]
        mc = msprobe_compare(root / "ref" / "step0", root / "same" / "step0",
                             work / "cmp" / "big")
        times["msprobe"].append(mc.seconds)

    def fmt(xs: list[float]) -> str:
        return f"{statistics.median(xs):.1f} (min {min(xs):.1f})"
    print(f"\nlarge tensor-mode dump: {size / 2**20:.1f} MiB per run ({n_files} .pt files, "
          f"{tokens} tokens), capture {out.stat().st_size / 2**20:.1f} MiB; wall seconds, "
          f"median of {repeat} (min), one process per command")
    print("| command | seconds |\n|---|---|")
    print(f"| `accucheck import msprobe ref/ -o ref.h5` | {fmt(times['import'])} |")
    print(f"| `accucheck diff ref/ same/` (imports both, then diffs: {verdict}) | "
          f"{fmt(times['diff'])} |")
    print(f"| `msprobe compare -tp same/.../dump.json -gp ref/.../dump.json` ({mc.rows} rows, "
          f"{mc.errors} error) | {fmt(times['msprobe'])} |")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "dump":
        main_dump(sys.argv[2:])
    else:
        main(sys.argv[1:])
