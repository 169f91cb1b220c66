"""First divergence on real tiny-model captures (planted faults, dtype changes, equivalent fused
kernels) and on synthetic hierarchies (ops, gradual growth, statistics only)."""
from __future__ import annotations

import numpy as np
import pytest

import diffcases
from accucheck.compare.diff import diff_captures
from accucheck.keys import is_layer_block
from accucheck.verdict.locate import analyze, locate
from accucheck.report.diff import render, verdict_line
from test_diff import base, write


@pytest.fixture(scope="module")
def caps(tiny, tmp_path_factory):
    model, tok = tiny
    d = tmp_path_factory.mktemp("locate")
    ref = diffcases.make("ref", model, tok, d / "ref.h5")
    out = {"ref": ref}
    for k in ("same", "bf16", "norm_bf16", "act_silu", "fused_norm", "fp32_dither"):
        out[k] = diffcases.make(k, model, tok, d / f"{k}.h5", ref)
    return out


def test_identical_captures_pass(caps):
    a = analyze(caps["ref"], caps["same"])
    assert a and a.exit_code == 0 and a.verdict == "pass"
    assert a.location.first_divergence is None and not a.location.top


@pytest.mark.parametrize("kind", ["fused_norm", "fp32_dither"])
def test_equivalent_computation_names_no_culprit(caps, kind):
    """F.rms_norm for every RMSNorm, or fp32 reordering noise: pass, nobody blamed."""
    a = analyze(caps["ref"], caps[kind])
    assert a.exit_code == 0 and a.location.first_divergence is None
    assert all(x.cause is None for x in a.location.records)


def test_whole_model_bf16_reports_every_layer_and_invents_no_culprit(caps):
    a = analyze(caps["ref"], caps["bf16"])
    assert a.exit_code == 0 and a.location.first_divergence is None
    curve = [p for p in a.location.curve if p.req == 0 and p.step == 0]
    assert [p.layer for p in curve] == [0, 1, 2, 3]
    assert all(1e-4 < p.rel_l2 < 5e-2 and 0.99 < p.cosine < 1.0 for p in curve)
    # the error is spread over the model: every layer shows it, none "introduces" it alone
    steps = {p.step for p in a.location.curve}
    assert steps == set(range(diffcases.STEPS + 1))


@pytest.mark.parametrize("kind,module", [("norm_bf16", diffcases.NORM_FAULT),
                                         ("act_silu", diffcases.ACT_FAULT)])
def test_planted_fault_is_named_as_introduced(caps, kind, module):
    a = analyze(caps["ref"], caps[kind])
    assert a.exit_code == 1
    fd = a.location.first_divergence
    assert fd is not None
    assert (fd.key.module, fd.step, fd.cause) == (module, 0, "introduced")
    assert fd.error > fd.tolerance and (fd.input_error or 0) < fd.error / 4
    assert fd.path[-1] == module.rsplit(".", 1)[0]  # the enclosing decoder layer
    # records downstream are over tolerance but inherited, not new culprits
    intro = {x.key.module for x in a.location.records if x.cause == "introduced"
             and not is_layer_block(x.key.module)}
    assert intro == {module}, intro
    assert a.location.top[0].key.module == module


def test_recorded_inputs_are_preferred(tiny, tmp_path):
    model, tok = tiny
    ref = diffcases.make("ref", model, tok, tmp_path / "r.h5", record_inputs=True, steps=0)
    cand = diffcases.make("norm_bf16", model, tok, tmp_path / "c.h5", ref,
                          record_inputs=True, steps=0)
    a = analyze(ref, cand)
    fd = a.location.first_divergence
    assert fd.key.module == diffcases.NORM_FAULT and fd.cause == "introduced"
    assert fd.input_from and all(":in." in k for k in fd.input_from)
    assert fd.input_error == 0.0
    mlp = next(x for x in a.location.records
               if str(x.key) == "r0.s0:model.layers.2.mlp#0:out.0")
    norm = next(x for x in a.location.records
                if str(x.key) == f"r0.s0:{diffcases.NORM_FAULT}#0:out.0")
    # the mlp's recorded input IS the norm's output: the same error, from both sources
    assert mlp.cause == "inherited" and mlp.input_basis in ("inputs", "links")
    assert mlp.input_error == pytest.approx(norm.error, rel=1e-9)


def test_stats_only_capture_finds_a_scale_fault_weaker(tiny, tmp_path):
    from accucheck.capture.runners.hf import capture_model
    from accucheck.capture.faults import planted

    model, tok = tiny
    ref = diffcases.make("ref", model, tok, tmp_path / "r.h5", store="stats", steps=1)
    with planted(model, "model.layers.1.self_attn", "scale:1.01"):
        capture_model(model, diffcases.PROMPTS, tmp_path / "c.h5", tokenizer=tok,
                      store="stats", max_new_tokens=1, tokens_from=str(ref))
    a = analyze(ref, tmp_path / "c.h5")
    assert a.exit_code == 1
    # every record sampled but the logits (top-k, kept in the stats store: --logits auto)
    assert {r.basis for r in a.diff.records if r.kind != "logits"} == {"sample"}
    assert {r.basis for r in a.diff.records if r.kind == "logits"} == {"tensor"}
    fd = a.location.first_divergence
    assert (fd.key.module, fd.cause, fd.basis) == ("model.layers.1.self_attn", "introduced",
                                                   "sample")


def test_stats_mode_samples_catch_a_bf16_rounded_norm(tiny, tmp_path):
    """Stats mode (64 sampled values per record + statistics) names the bf16-rounded norm, and
    the sampled estimate of its rel_l2 is close to the exact value from full captures."""
    model, tok = tiny
    ref = diffcases.make("ref", model, tok, tmp_path / "r.h5", store="stats", steps=0)
    same = diffcases.make("same", model, tok, tmp_path / "s.h5", ref, store="stats", steps=0)
    cand = diffcases.make("norm_bf16", model, tok, tmp_path / "c.h5", ref, store="stats",
                          steps=0)
    assert analyze(ref, same).exit_code == 0
    a = analyze(ref, cand)
    fd = a.location.first_divergence
    assert a.exit_code == 1 and fd.basis == "sample"
    assert (fd.key.module, fd.cause) == (diffcases.NORM_FAULT, "introduced")
    rec = next(r for r in a.diff.records if r.key == fd.key)
    full_ref = diffcases.make("ref", model, tok, tmp_path / "fr.h5", steps=0)
    full = diffcases.make("norm_bf16", model, tok, tmp_path / "fc.h5", full_ref, steps=0)
    exact = next(r for r in analyze(full_ref, full).diff.records if r.key == fd.key)
    assert exact.basis == "tensor"
    assert 0.5 < rec.metrics.rel_l2 / exact.metrics.rel_l2 < 2.0


# --------------------------------------------------------------------------- synthetic

def _perturb(t, key, rel, rng):
    x = t[key]
    return x + rng.standard_normal(x.shape) * rel * np.sqrt(np.mean(x ** 2))


def test_op_records_walk_layer_module_op(tmp_path):
    """Ops (recorded before their module) are walked first: the op that introduces is named."""
    rng = np.random.default_rng(0)
    t = {}
    h = lambda: rng.standard_normal((1, 3, 16))  # noqa: E731
    t["r0.s0:model.embed_tokens#0:out.0"] = h()
    t["r0.s0:model.layers.0.mlp#0/aten.mm.default@0:out.0"] = h()
    t["r0.s0:model.layers.0.mlp#0/aten.silu.default@1:out.0"] = h()
    t["r0.s0:model.layers.0.mlp#0/aten.mul.Tensor@2:out.0"] = h()
    t["r0.s0:model.layers.0.mlp#0:out.0"] = h()
    t["r0.s0:model.layers.0#0:out.0"] = h()
    c = dict(t)
    c["r0.s0:model.layers.0.mlp#0/aten.silu.default@1:out.0"] = _perturb(
        t, "r0.s0:model.layers.0.mlp#0/aten.silu.default@1:out.0", 1e-3, rng)
    c["r0.s0:model.layers.0.mlp#0/aten.mul.Tensor@2:out.0"] = _perturb(
        t, "r0.s0:model.layers.0.mlp#0/aten.mul.Tensor@2:out.0", 1.5e-3, rng)
    c["r0.s0:model.layers.0.mlp#0:out.0"] = _perturb(t, "r0.s0:model.layers.0.mlp#0:out.0",
                                                     1.5e-3, rng)
    c["r0.s0:model.layers.0#0:out.0"] = _perturb(t, "r0.s0:model.layers.0#0:out.0", 1e-3, rng)
    a = analyze(write(tmp_path / "a.h5", t), write(tmp_path / "b.h5", c))
    fd = a.location.first_divergence
    assert fd.key.op == "aten.silu.default" and fd.cause == "introduced"
    assert fd.module == "model.layers.0.mlp/aten.silu.default"
    assert fd.path == ("model.layers.0", "model.layers.0.mlp")
    locs = {str(x.key): x for x in a.location.records}
    assert locs["r0.s0:model.layers.0.mlp#0/aten.mul.Tensor@2:out.0"].cause == "inherited"
    assert locs["r0.s0:model.layers.0.mlp#0:out.0"].cause == "inherited"


def test_gradual_growth_is_inherited_not_blamed(tmp_path):
    """Every record adds a little (x1.5 per record): the first one over tolerance is reported
    as inherited, and no record is called 'introduced'."""
    rng = np.random.default_rng(1)
    t = base(rng, layers=6)
    c, rel = {}, 5e-6
    for k in t:
        if k.endswith("logits#0:out.0"):
            c[k] = t[k]
            continue
        rel *= 1.5
        c[k] = _perturb(t, k, rel, rng)
    c["r0.s0:model.embed_tokens#0:out.0"] = t["r0.s0:model.embed_tokens#0:out.0"]
    a = analyze(write(tmp_path / "a.h5", t), write(tmp_path / "b.h5", c))
    L = a.location
    assert L.first_divergence is None and L.diffuse and a.culprit is None
    assert L.first_over.cause == "inherited" and not L.first_over.key.is_logits
    assert not any(x.cause == "introduced" for x in L.records)
    assert "no record introduces the error (diffuse / inherited)" in verdict_line(a)
    # it fails on the noise floor: layer 0's norm is 7.5e-6 off from an exact input, ~180
    # float32 roundings (over one rounding of the dtype, an exact input is no excuse)
    assert a.exit_code == 1 and not a.accumulated
    assert [s.key.module for s in L.suspicious] == ["model.layers.0.input_layernorm"]
    assert "CULPRIT" not in render(a)


def test_locate_walks_earliest_step_first(tmp_path):
    rng = np.random.default_rng(2)
    t = base(rng, steps=(0, 1))
    c = dict(t)
    c["r0.s1:model.layers.0.mlp#0:out.0"] = _perturb(t, "r0.s1:model.layers.0.mlp#0:out.0",
                                                     1e-2, rng)
    c["r0.s0:model.layers.1.mlp#0:out.0"] = _perturb(t, "r0.s0:model.layers.1.mlp#0:out.0",
                                                     1e-2, rng)
    d = diff_captures(write(tmp_path / "a.h5", t, gen=((4, 5),)),
                      write(tmp_path / "b.h5", c, gen=((4, 5),)))
    fd = locate(d).first_divergence
    assert (fd.step, fd.key.module) == (0, "model.layers.1.mlp")


def test_amplification_threshold_decides(tmp_path):
    rng = np.random.default_rng(3)
    t = base(rng, layers=1)
    c = dict(t)
    c["r0.s0:model.layers.0.self_attn#0:out.0"] = _perturb(
        t, "r0.s0:model.layers.0.self_attn#0:out.0", 1e-3, rng)
    c["r0.s0:model.layers.0.post_attention_layernorm#0:out.0"] = _perturb(
        t, "r0.s0:model.layers.0.post_attention_layernorm#0:out.0", 3e-3, rng)
    d = diff_captures(write(tmp_path / "a.h5", t), write(tmp_path / "b.h5", c))
    key = "r0.s0:model.layers.0.post_attention_layernorm#0:out.0"
    lo = {str(x.key): x for x in locate(d, amplification=2).records}[key]
    hi = {str(x.key): x for x in locate(d, amplification=4).records}[key]
    assert lo.cause == "introduced" and hi.cause == "inherited"
    assert hi.input_from == ("r0.s0:model.layers.0.self_attn#0:out.0",)
    assert 2.5 < hi.error / hi.explained < 3.5
