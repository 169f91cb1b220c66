"""The control rule on the real SmolLM2-135M (30 layers) in bfloat16: a float32 reference,
three control runs and every candidate bf16 on the CPU, each rounding like another device
(a dither of its own seed, accucheck.capture.faults.dithered). Graded faults, sized to a
multiple of their record's natural noise (tests/planting.py, as bench/bench_control.py does),
in code no record covers; the exact module named; the controls (no fault, a fused but
equivalent RMSNorm) clean. Each verdict is asserted with the margin it has (z against the
threshold), measured here. Slow: run in CI (`-m ""`)."""
from __future__ import annotations

import math
from contextlib import nullcontext

import pytest

from accucheck.capture.runners.hf import capture_model
from accucheck.capture.faults import dithered, planted
from accucheck.compare.tolerances import CONTROL_Z
from accucheck.report.diff import render, to_json, verdict_line
from accucheck.verdict.locate import analyze
from diffcases import fused_rms_norm
from planting import fault, natural_noise, site_rel_l2, size_fault

pytestmark = pytest.mark.slow

PROMPTS = ["def fibonacci(n):", "The capital of France is", "Once upon a time, a small robot",
           "Q: What is 17 times 23?\nA:", "The mitochondria is the powerhouse of",
           "import numpy as np\nx = np.arange(10)\n"]
STEPS = 2
CONTROLS = 3


@pytest.fixture(scope="module")
def runs(smollm2, tmp_path_factory):
    model, tok = smollm2
    d = tmp_path_factory.mktemp("control")
    cache = {}

    def cap(name, *, dtype="bfloat16", seed=None, fault_=None, ctx=None, include=()):
        if name not in cache:
            with (dithered(seed) if seed is not None else nullcontext()), \
                    (planted(model, *fault_) if fault_ else nullcontext()), \
                    (ctx or nullcontext()):
                capture_model(model, PROMPTS, d / f"{name}.h5", tokenizer=tok, store="full",
                              max_new_tokens=STEPS, dtype=dtype, include=include,
                              tokens_from=str(cache["ref"]) if "ref" in cache else None)
            cache[name] = d / f"{name}.h5"
        return cache[name]

    cap("ref", dtype="float32")
    controls = [cap(f"ctl{i}", seed=1000 + i) for i in range(CONTROLS)]
    return cap, controls


def faulty(runs, kind, layer, s):
    """A bf16 candidate (its own dither) with `kind` at `layer` sized to s x the noise."""
    cap, controls = runs
    _, site, expect = fault(kind, layer, 0.0)
    ref = cap("ref")
    noise = natural_noise(ref, controls, site)

    def calibration(name, planted_, include):
        return cap(name, dtype="float32", fault_=planted_, include=include)
    d = size_fault(calibration, ref, kind, layer, s, noise)
    cand = cap(f"{kind}{layer}-{s}", seed=3000, fault_=fault(kind, layer, d)[0])
    return cand, site, expect, site_rel_l2(ref, cand, site) / noise


@pytest.mark.parametrize("kind, layer, s", [("linear", 14, 2.0), ("act", 26, 2.0),
                                            ("core", 14, 2.0), ("rotary", 0, 2.0),
                                            ("norm", 3, 4.0), ("linear", 3, 1.5)])
def test_a_fault_near_the_noise_is_named_exactly_with_a_control(runs, kind, layer, s):
    cap, controls = runs
    cand, site, expect, measured = faulty(runs, kind, layer, s)
    # the fault is what it says: its record's rel_l2 is about s x its natural noise
    assert 0.75 * s < measured < 1.3 * s, measured
    a = analyze(cap("ref"), cand, controls=controls)
    noise = a.location.noise
    first = noise.flagged[0]
    assert first.site == site, [x.site for x in noise.flagged]
    assert first.z > CONTROL_Z * 1.2, first  # a margin on the rule, measured here
    c = a.culprit
    assert c.module == expect and c.step == 0
    if kind == "core":  # the attention core: self_attn's own code, seen at o_proj's input
        assert str(c.seen_at).endswith(f"{expect}.o_proj#0:in.0")
    line = verdict_line(a)
    assert line.startswith("FAIL: more than noise from step 0, ") and "introduced here" in line
    assert "CULPRIT: step 0, " in render(a) and to_json(a)["culprit"]["module"] == expect


@pytest.mark.parametrize("name, ctx", [("clean", None), ("fused-norm", "fused")])
def test_no_fault_and_an_equivalent_fused_kernel_stay_clean(runs, name, ctx):
    """A clean bf16 candidate, and one whose every RMSNorm is F.rms_norm (one fused op,
    numerically equivalent): within the noise of the controls, with room to spare."""
    cap, controls = runs
    cand = cap(name, seed=2000, ctx=fused_rms_norm() if ctx else None)
    a = analyze(cap("ref"), cand, controls=controls)
    noise = a.location.noise
    assert a.exit_code == 0 and not noise.flagged and a.culprit is None, verdict_line(a)
    closest = noise.sites[0]
    assert closest.excess < 0.95 * closest.threshold or closest.z < 0.8 * CONTROL_Z, closest
    assert verdict_line(a).startswith("PASS: ") and "within the noise of 3 control runs" in \
        verdict_line(a)
    # without the control the same clean candidate passes too: bf16 noise is over 5e-2 in
    # places, accumulated, and nothing introduces it (it was a FAIL before issue 33)
    plain = analyze(cap("ref"), cand)
    assert plain.exit_code == 0 and plain.culprit is None and not plain.location.suspicious


def test_one_control_is_enough_for_a_clear_fault(runs):
    cap, controls = runs
    cand, site, expect, _ = faulty(runs, "linear", 14, 2.0)
    a = analyze(cap("ref"), cand, controls=controls[:1])
    assert a.culprit.module == expect and a.location.noise.flagged[0].site == site


def test_the_ratio_is_steady_where_rel_l2_is_not(runs):
    """Why errors are compared by their mean elementwise relative error: between two equally
    good bf16 runs, the residual sum's rel_l2 (dominated by a few massive activations) can
    differ several-fold, its mean elementwise relative error much less."""
    from accucheck.compare.diff import diff_captures

    cap, controls = runs
    d0 = diff_captures(cap("ref"), controls[0])
    d1 = diff_captures(cap("ref"), controls[1])
    e0 = {str(r.key): r for r in d0.records}
    spread_l2, spread_elem = [], []
    for r in d1.records:
        if r.key.module.endswith("post_attention_layernorm") and r.key.role == "in":
            q = e0[str(r.key)]
            spread_l2.append(abs(math.log(r.error / q.error)))
            spread_elem.append(abs(math.log(r.elem_error / q.elem_error)))
    assert max(spread_elem) < max(spread_l2) / 2, (max(spread_elem), max(spread_l2))
