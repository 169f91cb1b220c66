"""The prepared device check (issue 34), run by scripts/device-check.sh: on the built-in tiny
Llama, HF eager and graph captures on the device, vLLM eager and graph captures (TP=1) when vLLM
for that device imports, each diffed against a CPU capture of the same prompts; a table of what
ran, what was skipped and why, each step's exit code and time, and the worker-side facts from
every capture's meta (scripts/device_check_facts.py). docs/devices.md says what to expect.

Every step is the accucheck CLI in a subprocess (`python -m accucheck`, this checkout's code
first on PYTHONPATH), its output in OUT/logs/STEP.log. Nothing is overwritten: OUT is new or
empty. Exit: 0 every step that ran passed, 1 a diff found a divergence, 2 bad flags or OUT,
3 a step crashed or timed out (3 wins over 1).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's accucheck reads the captures too
sys.path.insert(0, str(ROOT / "scripts"))

from device_check_facts import capture_facts, render, summary  # noqa: E402

PROMPTS = ("The quick brown fox jumps over the lazy dog",
           "Accuracy of large language models depends on every layer")
N_NEW = 4  # greedy decode steps after the prefill
# a tiny model: a small KV cache share, few CUDA / ACL graph sizes to capture
ENGINE = ("gpu_memory_utilization=0.3", "max_num_seqs=4")
STEP_TIMEOUT = 300
EXIT_OK, EXIT_DIFF, EXIT_USAGE, EXIT_CRASH = 0, 1, 2, 3
_PROBE = """\
import sys
want = sys.argv[1]
name = "vllm_ascend" if want == "npu" else "vllm"
try:
    if want == "npu":
        import vllm_ascend
    import vllm
    from vllm.platforms import current_platform
    kind = current_platform.device_type
except Exception as e:
    print(f"{name} does not import: {type(e).__name__}: {e}".splitlines()[0]); sys.exit(1)
if kind != want:
    print(f"vllm {vllm.__version__} imports, but its platform is {kind!r}, not {want!r}")
    sys.exit(1)
from importlib.metadata import entry_points
if "accucheck" not in {e.name for e in entry_points(group="vllm.general_plugins")}:
    print("accucheck's vLLM plugin is not registered: pip install -e . in this checkout")
    sys.exit(1)
print(f"vllm {vllm.__version__} on {kind}")
"""


class Usage(Exception):
    """A bad flag or --out: one line, exit 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's two-line usage error -> one line
        raise Usage(f"{message} (see --help)")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = _Parser(prog="device-check.sh", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", required=True, choices=("cuda", "npu", "cpu"),
                   help="the device to check (pick one with CUDA_VISIBLE_DEVICES / "
                        "ASCEND_RT_VISIBLE_DEVICES); cpu: only the steps the CPU can check")
    p.add_argument("--out", help="output folder, new or empty (default: a new temporary one)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="the device captures' dtype (default float32: a correct device passes "
                        "at float32's tolerance; bfloat16: diffed with a CPU control run)")
    p.add_argument("--no-vllm", action="store_true", help="skip the vLLM steps")
    p.add_argument("--no-graph", action="store_true", help="skip the graph-mode steps")
    p.add_argument("--step-timeout", type=int, default=STEP_TIMEOUT,
                   help=f"seconds one step may run (default {STEP_TIMEOUT})")
    args = p.parse_args(argv)
    if args.step_timeout < 1:
        raise Usage(f"--step-timeout {args.step_timeout}: give seconds >= 1")
    return args


def output_dir(out: str | None) -> Path:
    """A new temporary folder, or `out` when it is new or empty; anything else is refused."""
    if out is None:
        return Path(tempfile.mkdtemp(prefix="accucheck-device-check-"))
    d = Path(out)
    if d.exists() and not d.is_dir():
        raise Usage(f"--out {out}: exists and is not a folder; give a new or empty folder")
    if d.is_dir() and any(d.iterdir()):
        raise Usage(f"--out {out}: not empty; give a new or empty folder (nothing is "
                    f"overwritten)")
    d.mkdir(parents=True, exist_ok=True)
    return d


@dataclass(frozen=True)
class Step:
    name: str
    device: str
    argv: tuple[str, ...]   # accucheck's arguments
    needs: tuple[str, ...] = ()
    skip: str | None = None  # why it is not run, decided before anything runs
    output: str | None = None  # the capture file it writes, under OUT
    kind: str = "capture"  # "setup" | "capture" | "diff"


@dataclass(frozen=True)
class Outcome:
    step: Step
    status: str  # "ok" | "FAIL" (a diff found a divergence) | "crashed" | "timeout" | "skipped"
    rc: int | None = None
    seconds: float | None = None
    note: str = ""


def plan(args: argparse.Namespace, out: Path, vllm_why: str | None) -> list[Step]:
    """Every step in order, with its skip reason when it will not run."""
    model, ref = str(out / "model"), str(out / "cpu.h5")
    common = ("--store", "full", "--prompts", str(out / "prompts.txt"),
              "--max-new-tokens", str(N_NEW))
    steps = [Step("tiny-model", "-", ("tiny-model", model), kind="setup"),
             Step("cpu-reference", "cpu", ("capture", model, "--device", "cpu", "--dtype",
                                           "float32", *common, "-o", ref),
                  needs=("tiny-model",), output="cpu.h5")]
    control = ("--control", "auto:1") if args.dtype != "float32" else ()  # one: device time
    for runner, mode in (("hf", "eager"), ("hf", "graph"), ("vllm", "eager"), ("vllm", "graph")):
        name = f"{runner}-{mode}"
        skip = None
        if runner == "hf" and mode == "eager" and args.device == "cpu":
            skip = "--device cpu is the reference itself (cpu-reference)"
        elif runner == "vllm" and (args.no_vllm or vllm_why):
            skip = "--no-vllm" if args.no_vllm else vllm_why
        elif mode == "graph" and args.no_graph:
            skip = "--no-graph"
        engine = sum((("--engine-arg", e) for e in ENGINE), ()) if runner == "vllm" else ()
        steps.append(Step(name, args.device,
                          ("capture", model, "--runner", runner, "--device", args.device,
                           "--dtype", args.dtype, "--mode", mode, *common, "--tokens-from", ref,
                           *engine, "-o", str(out / f"{name}.h5")),
                          needs=("cpu-reference",), skip=skip, output=f"{name}.h5"))
        steps.append(Step(f"diff {name}", "-", ("diff", ref, str(out / f"{name}.h5"), *control,
                                                "-o", str(out / f"diff-{name}.txt")),
                          needs=("cpu-reference", name), skip=skip, kind="diff"))
    return steps


def probe_vllm(device: str, env: dict) -> str | None:
    """None when vLLM for `device` imports here (vllm_ascend on npu, vLLM's platform the
    device, accucheck's plugin registered), else why not, in one line."""
    try:
        p = subprocess.run([sys.executable, "-c", _PROBE, device], env=env, text=True,
                           capture_output=True, timeout=180)
    except subprocess.TimeoutExpired:
        return "importing vllm took over 180 s"
    lines = [ln for ln in p.stdout.splitlines() if ln.strip()]
    return None if p.returncode == 0 else (lines[-1] if lines else f"probe exit {p.returncode}")


def _note(step: Step, log: Path, rc: int) -> str:
    """The line that says what happened: a diff's verdict, a capture's coverage or error."""
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    prefixes = {"diff": ("PASS", "FAIL"), "capture": ("coverage",), "setup": ("wrote",)}
    errors = [ln for ln in lines if ln.startswith("accucheck: error:")]
    picks = errors[-1:] or [ln for ln in lines if ln.startswith(prefixes[step.kind])][:1] \
        or lines[-1:]
    text = picks[0] if picks else f"exit {rc}, no output"
    return text if len(text) <= 200 else text[:197] + "..."


def _stop(proc: subprocess.Popen, sig: int, grace: float) -> None:
    """Signal the step's process group (vLLM's engine core and workers with it), then kill."""
    for s, wait in ((sig, grace), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, s)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_step(step: Step, out: Path, env: dict, timeout: int) -> Outcome:
    cmd = [sys.executable, "-m", "accucheck", *step.argv]
    log = out / "logs" / f"{step.name.replace(' ', '-')}.log"
    t0 = time.monotonic()
    with open(log, "w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=out,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _stop(proc, signal.SIGTERM, 15)
            return Outcome(step, "timeout", None, time.monotonic() - t0,
                           f"stopped after {timeout} s (--step-timeout); log {log.name}")
        except KeyboardInterrupt:
            _stop(proc, signal.SIGINT, 20)
            raise
    seconds = time.monotonic() - t0
    status = "ok" if rc == 0 else "FAIL" if rc == 1 and step.kind == "diff" else "crashed"
    return Outcome(step, status, rc, seconds, _note(step, log, rc))


def run_all(steps: list[Step], out: Path, env: dict, timeout: int, echo) -> list[Outcome]:
    done: dict[str, Outcome] = {}
    for step in steps:
        failed = [n for n in step.needs if done[n].status != "ok"]
        if step.skip is not None:
            o = Outcome(step, "skipped", note=step.skip)
        elif failed:
            o = Outcome(step, "skipped", note=f"needs {failed[0]}, which "
                        f"{'was skipped' if done[failed[0]].status == 'skipped' else 'failed'}")
        else:
            echo(f"device-check: {step.name} ...")
            o = run_step(step, out, env, timeout)
            echo(f"device-check: {step.name}: {o.status} (exit {o.rc}, {o.seconds:.1f} s)")
        done[step.name] = o
    return list(done.values())


def exit_code(outcomes: list[Outcome]) -> int:
    if any(o.status in ("crashed", "timeout") for o in outcomes):
        return EXIT_CRASH
    return EXIT_DIFF if any(o.status == "FAIL" for o in outcomes) else EXIT_OK


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
        out = output_dir(args.out)
    except Usage as e:
        print(f"device-check: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    echo = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    (out / "logs").mkdir()
    (out / "prompts.txt").write_text("".join(p + "\n" for p in PROMPTS))
    echo(f"device-check: --device {args.device}, {args.dtype}, writing into {out}")
    t0 = time.monotonic()
    why = None
    if not args.no_vllm:
        echo("device-check: probing vLLM ...")
        why = probe_vllm(args.device, env)
    try:
        outcomes = run_all(plan(args, out, why), out, env, args.step_timeout, echo)
    except KeyboardInterrupt:
        echo(f"device-check: interrupted; what ran is in {out}")
        return EXIT_CRASH
    code = exit_code(outcomes)
    facts = {o.step.name: capture_facts(out / o.step.output) for o in outcomes
             if o.step.output and (out / o.step.output).is_file()}
    text = render(outcomes, facts, code, time.monotonic() - t0, args, out)
    (out / "device-check.txt").write_text(text)
    (out / "device-check.json").write_text(
        json.dumps(summary(outcomes, facts, code, time.monotonic() - t0), indent=1) + "\n")
    print(text, end="")
    return code


if __name__ == "__main__":
    sys.exit(main())
