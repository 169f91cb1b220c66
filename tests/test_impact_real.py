"""accucheck impact (issue 38) on the real SmolLM2-135M-Instruct (30 layers; tests/smollm2.py):
the reference in float32 (--store full), candidates in float32 or bfloat16 with a planted fault
or none, controls made of a correct device (the CPU's kernels with their last bit dithered,
accucheck.capture.faults.dithered) forced to the reference's tokens. Slow (CI: `-m ""`); the
numbers are in docs/impact.md "On SmolLM2" (run with -s to print the tables)."""
from __future__ import annotations

import copy
from contextlib import nullcontext

import pytest
import torch

from accucheck.capture.faults import dithered, planted
from accucheck.capture.runners.hf import capture_model
from accucheck.impact.api import ImpactOptions, impact_model
from accucheck.impact.join import impact_line
from accucheck.impact.result import render
from accucheck.verdict.locate import analyze

pytestmark = pytest.mark.slow

PROMPTS = ["def fibonacci(n):", "The capital of France is"]
STEPS = 1
LAYERS = 30
BLOCKS = [f"model.layers.{i}" for i in range(LAYERS)]
# a token flip: layer 20's post-attention norm scaled by 1.5 (float32 candidate)
FLIP = ("model.layers.20.post_attention_layernorm", "scale:1.5")
# damped: layer 5's v_proj with its first K tile of 64 input features weighted 1.5
DAMPED = ("model.layers.5.self_attn.v_proj", "tile:0.5")


@pytest.fixture(scope="module")
def real(smollm2, tmp_path_factory):
    model, tok = smollm2
    d = tmp_path_factory.mktemp("impact-real")
    cache = {}

    def cap(name, dtype="float32", seed=None, fault=None):
        if name not in cache:
            with (dithered(seed) if seed is not None else nullcontext()), \
                    (planted(model, *fault) if fault else nullcontext()):
                capture_model(model, PROMPTS, d / f"{name}.h5", tokenizer=tok, store="full",
                              max_new_tokens=STEPS, dtype=dtype,
                              tokens_from=str(cache["ref"]) if "ref" in cache else None)
            cache[name] = d / f"{name}.h5"
        return cache[name]

    cap("ref", "float32")
    return model, cap


@pytest.fixture(scope="module")
def bf16(smollm2):
    return copy.deepcopy(smollm2[0]).to(torch.bfloat16)


def row(res, site):
    return next(s for s in list(res.sites) + list(res.children) if s.site == site)


def show(res) -> None:
    print("\n" + render(res))


def test_a_token_flip_is_recovered_at_the_planted_module(real):
    """float32 candidate, layer 20's norm x1.5 (flips a token); control: float32 dithered."""
    model, cap = real
    ref, ctl = cap("ref"), cap("ctl32", "float32", seed=1000)
    res = impact_model(ref, model, ImpactOptions(plant=(FLIP,), control=str(ctl), bisect=1))
    show(res)
    assert res.baseline.flips >= 1 and res.baseline.logprob > 0.05
    planted_block = row(res, "model.layers.20")
    for m in ("logprob", "kl", "flips"):
        assert planted_block.recovered[m] > 0.5, (m, planted_block.recovered)
    # bisect inside the top block: the planted norm (and the MLP it feeds) recover it
    assert res.top().site.startswith("model.layers.20")
    assert row(res, FLIP[0]).recovered["logprob"] > 0.5
    assert abs(row(res, "model.layers.20.self_attn").recovered["logprob"]) < 0.02
    # no unrelated site above its noise band (what a correct device's tensor recovers there)
    for s in res.sites:
        if s.site == "model.layers.20":
            continue
        for m in ("logprob", "kl"):
            assert s.recovered[m] <= s.band[m] + 0.02, (s.site, m, s.recovered, s.band)
    assert res.runs == 1 + 2 * LAYERS + 1 + 2 * 4
    # diff --impact beside a culprit that explains little (an unrelated upstream module)
    data = res.to_json()
    line = impact_line(data, "model.layers.10.mlp.down_proj", "i.json")
    assert "(its enclosing model.layers.10) recovers 0.0% of the logit gap" in line, line
    assert "it explains little: model.layers.20" in line and "recovers 100.0%" in line, line
    assert "explains little" not in impact_line(data, FLIP[0], "i.json")


def test_a_damped_fault_is_more_than_noise_but_recovers_little(real, bf16):
    """bf16 candidate, layer 5's v_proj with one K tile mis-scaled: `diff` with two bf16
    controls names it (z ~50); impact: its block recovers little of the bf16 candidate's gap,
    which is within the control's own (the residual stream damps it)."""
    model, cap = real
    ref = cap("ref")
    ctls = [cap(f"ctl16-{i}", "bfloat16", seed=1000 + i) for i in range(2)]
    cand = cap("damped", "bfloat16", fault=DAMPED)
    a = analyze(ref, cand, controls=ctls)
    noise = a.location.noise
    assert noise.flagged and noise.flagged[0].site.startswith(DAMPED[0]), \
        [x.site for x in noise.flagged]
    assert a.culprit is not None and a.culprit.module == DAMPED[0]
    res = impact_model(ref, bf16, ImpactOptions(plant=(DAMPED,), control=str(ctls[0])))
    show(res)
    block = row(res, "model.layers.5")
    print("damped block", block.recovered, block.band, "z", noise.flagged[0].z)
    assert block.recovered["logprob"] < 0.25 and block.recovered["kl"] < 0.25
    assert block.band["logprob"] < 0.25 and block.band["kl"] < 0.25
    # the whole gap is within a correct device's: nothing is named, and the join says so
    assert res.within_noise and res.leaders() == []
    line = impact_line(res.to_json(), DAMPED[0], "i.json")
    print(line)
    assert line.startswith(f"impact: {DAMPED[0]} does not move the output beyond the noise"), line


def test_a_clean_bf16_pair_recovers_nothing_above_the_band(real, bf16):
    """bf16 candidate without a fault; control: bf16 dithered (another correct device)."""
    model, cap = real
    ref, ctl = cap("ref"), cap("ctl16-0", "bfloat16", seed=1000)
    res = impact_model(ref, bf16, ImpactOptions(control=str(ctl)))
    show(res)
    assert not res.no_gap and res.baseline.flips == 0
    # what holds (docs/impact.md "On SmolLM2"): no block recovers a gap that is rounding only
    # the way a culprit does (the planted fault's block: 100 % of both metrics). The shares are
    # ratios of small noisy gaps and depend on the CPU's bf16 kernels: at most +20 % |Δ logprob|
    # / +29 % KL on one machine, +43 % / +53 % on another (AMD EPYC), most negative.
    # The dithered control is a noisier correct device (its own gap is 2x the candidate's):
    # the whole gap is within the noise, and no site is named
    assert res.within_noise and res.leaders() == [] and "no site to blame" in res.headline()
    for s in res.sites:
        assert not (s.recovered["logprob"] > 0.75 and s.recovered["kl"] > 0.75), \
            (s.site, s.recovered)
    assert res.together.recovered["logprob"] < 0.5
