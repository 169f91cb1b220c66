"""Rule defects of code no record covers, each on an input where the right rule and the old
one answer differently: an input no record produced (the attention core at o_proj's input)
names its parent; the attention weights (a slot no child returned) are not explained by
o_proj; op records inside a module whose output is identical are no culprit (fused against
decomposed); a diffuse FAIL says when a suspicious record sits upstream."""
from __future__ import annotations

import numpy as np
import pytest

from accucheck.compare.tolerances import ToleranceTable

from accucheck.report.diff import render, to_json, verdict_line
from test_verdicts import Run


class SameRun(Run):
    def same(self, key: str, as_key: str) -> "SameRun":
        """A record of the very tensors `as_key` holds on both sides (o_proj's output is
        self_attn's out.0)."""
        r = next(x for x in self.ref if x[0] == as_key)
        c = next(x for x in self.cand if x[0] == as_key)
        self.ref.append((key, r[1], None, None))
        self.cand.append((key, c[1], None, None))
        return self


def attention(run: SameRun, *, qkv=0.0, core=0.0, o_proj=None, weights=0.0) -> SameRun:
    """embed -> input_layernorm -> self_attn(q, k, v, [core] -> o_proj) with links."""
    p = "r0.s0:model.layers.0"
    run.add("r0.s0:model.embed_tokens#0:out.0")
    run.add(f"{p}.input_layernorm#0:out.0", src={"0": "model.embed_tokens#0:out.0"})
    ln = {"0": "model.layers.0.input_layernorm#0:out.0"}
    for x in ("q", "k", "v"):
        run.add(f"{p}.self_attn.{x}_proj#0:out.0", qkv, src=ln)
    run.add(f"{p}.self_attn.o_proj#0:in.0", core)            # the attention core's output
    run.add(f"{p}.self_attn.o_proj#0:out.0", core if o_proj is None else o_proj)
    run.same(f"{p}.self_attn#0:out.0", f"{p}.self_attn.o_proj#0:out.0")
    run.add(f"{p}.self_attn#0:out.1", weights, shape=(1, 1, 3, 3))  # the attention weights
    return run


def test_an_error_the_attention_core_makes_names_self_attn_at_o_projs_input(tmp_path):
    """q / k / v exact, the core's output (o_proj in.0) off by 1e-3: the old rule called
    every "in" record inherited, so o_proj and self_attn were inherited and nothing was named
    (diffuse). The core is self_attn's own code: self_attn is the culprit, seen there."""
    a = attention(SameRun(), core=1e-3, weights=1e-3).analyze(tmp_path)
    fd = a.location.first_divergence
    assert str(fd.key) == "r0.s0:model.layers.0.self_attn.o_proj#0:in.0"
    assert fd.cause == "introduced" and not a.location.diffuse
    c = a.culprit
    assert c.where == "model.layers.0.self_attn#0"
    assert str(c.seen_at) == "r0.s0:model.layers.0.self_attn.o_proj#0:in.0"
    assert "code of model.layers.0.self_attn that no record covers" in render(a)
    assert to_json(a)["culprit"]["module"] == "model.layers.0.self_attn"
    # o_proj itself only carries what it was fed
    loc = {str(x.key): x for x in a.location.records}
    assert loc["r0.s0:model.layers.0.self_attn.o_proj#0:out.0"].cause == "inherited"


def test_a_core_error_explained_by_the_projections_is_inherited(tmp_path):
    """v_proj already off by 4e-4 (introduced there): the core's 1e-3 is 2.5x that,
    inherited; the culprit is v_proj, not self_attn."""
    a = attention(SameRun(), qkv=4e-4, core=1e-3, weights=1e-3).analyze(tmp_path)
    loc = {str(x.key): x for x in a.location.records}
    assert loc["r0.s0:model.layers.0.self_attn.o_proj#0:in.0"].cause == "inherited"
    assert a.culprit.where == "model.layers.0.self_attn.q_proj#0"  # the first of q / k / v


def test_the_attention_weights_are_not_explained_by_o_proj(tmp_path):
    """o_proj is faulty (1e-2 from an exact input); the weights are off by 1e-3 with q / k / v
    exact. The old rule explained out.1 by the largest child (o_proj, 1e-2: inherited); o_proj
    runs after the core and returns out.0, it cannot explain out.1: introduced."""
    a = attention(SameRun(), o_proj=1e-2, weights=1e-3).analyze(tmp_path)
    loc = {str(x.key): x for x in a.location.records}
    w = loc["r0.s0:model.layers.0.self_attn#0:out.1"]
    assert w.cause == "introduced" and w.inner_error == 0.0
    assert "r0.s0:model.layers.0.self_attn.o_proj#0:out.0" not in w.feeders
    # out.0 IS o_proj's output: explained by it alone
    o = loc["r0.s0:model.layers.0.self_attn#0:out.0"]
    assert o.cause == "inherited" and o.inner_error == pytest.approx(1e-2, rel=1e-6)
    assert a.culprit.where == "model.layers.0.self_attn.o_proj#0"  # the first in order


def test_diffuse_fail_headline_names_the_suspicious_record_upstream(tmp_path):
    """Layer 5's down_proj amplifies x20 (within the bf16 tolerance: suspicious); layer 6
    carries it over tolerance, inherited: a diffuse FAIL. The headline, the JSON summary and
    the suspicious list say where the lead is."""
    run = Run(2)
    run.add("r0.s0:model.embed_tokens#0:out.0", 1e-3)
    for i in range(8):
        prev = f"model.layers.{i - 1}#0:out.0" if i else "model.embed_tokens#0:out.0"
        e_in, e_out = (2e-2, 6e-2) if i == 6 else (1e-3, 2e-2 if i == 5 else 1e-3)
        run.add(f"r0.s0:model.layers.{i}.mlp.down_proj#0:in.0", e_in)
        run.add(f"r0.s0:model.layers.{i}.mlp.down_proj#0:out.0", e_out)
        run.add(f"r0.s0:model.layers.{i}#0:out.0", 6e-2 if i == 6 else 1e-3, src={"0": prev})
    # bf16's tolerance on a float16 run (tests/test_verdicts.py BF16_LIKE): 1e-3 is a rounding
    a = run.analyze(tmp_path, cand_run_dtype="float16", tolerances=ToleranceTable.from_options(rel_l2=5e-2))
    assert a.exit_code == 1 and a.location.diffuse and a.culprit is None
    line = verdict_line(a)
    assert "no record introduces the error (diffuse / inherited)" in line
    assert "SUSPICIOUS upstream" in line and "model.layers.5.mlp.down_proj" in line
    j = to_json(a)
    assert j["summary"] == line and j["suspicious"][0]["module"] == "model.layers.5.mlp.down_proj"


def test_fused_against_decomposed_norm_at_op_level_is_no_culprit(tiny, tmp_path):
    """One side F.rms_norm (one fused op), the other pow / mean / add / rsqrt / mul; every
    norm's output is bitwise identical. Op alignment pairs ops that compute different things
    (add.Tensor against add_.Scalar: 1.6e-4 > 5e-5): the old verdict named that add as the
    culprit op. The module computes the same: PASS, no culprit, a note."""
    from accucheck.capture.runners.hf import capture_model
    from accucheck.verdict.locate import analyze
    from diffcases import PROMPTS, fused_rms_norm

    model, tok = tiny
    kw = dict(tokenizer=tok, store="full", level="op", include=("*input_layernorm",),
              max_new_tokens=1)
    capture_model(model, PROMPTS[:1], tmp_path / "ref.h5", **kw)
    with fused_rms_norm():
        capture_model(model, PROMPTS[:1], tmp_path / "cand.h5",
                      tokens_from=str(tmp_path / "ref.h5"), **kw)
    a = analyze(tmp_path / "ref.h5", tmp_path / "cand.h5")
    ops = [r for r in a.diff.records if r.key.op is not None and not r.identical]
    assert ops and all(r.absorbed and not r.within_tolerance or r.within for r in ops)
    assert any(not r.within_tolerance for r in ops)  # the mismatched pairing is still there
    mods = [r for r in a.diff.records if r.key.op is None and r.key.module.endswith("norm")]
    assert mods and all(r.identical for r in mods)
    assert a.exit_code == 0 and a.culprit is None and a.location.first_divergence is None
    assert a.location.first_difference is None
    assert any("inside module calls whose outputs are identical" in n for n in a.diff.notes)


def test_fp16_softmax_inside_fp32_attention_at_module_level_names_self_attn(tiny, tmp_path):
    """The default module level records no op inside the attention core: the old verdict was
    diffuse, no culprit. The core's output (o_proj in.0) is made by self_attn's own code."""
    from accucheck.capture.runners.hf import capture_model
    from accucheck.verdict.locate import analyze
    from diffcases import PROMPTS, fp16_softmax

    model, tok = tiny
    model = __import__("copy").deepcopy(model)
    model.set_attn_implementation("eager")
    kw = dict(tokenizer=tok, store="full", max_new_tokens=1)
    capture_model(model, PROMPTS, tmp_path / "ref.h5", **kw)
    with fp16_softmax(model, 1):
        capture_model(model, PROMPTS, tmp_path / "cand.h5",
                      tokens_from=str(tmp_path / "ref.h5"), **kw)
    a = analyze(tmp_path / "ref.h5", tmp_path / "cand.h5")
    c = a.culprit
    assert c is not None and c.where == "model.layers.1.self_attn#0"
    assert str(c.seen_at).endswith("model.layers.1.self_attn.o_proj#0:in.0")
    assert np.isfinite(c.error) and c.error > c.tolerance


def test_an_op_input_no_dumped_op_produced_names_the_module_and_that_op(tmp_path):
    """msprobe-style op records without links: a norm casts to bf16 between its dumped ops
    (Tensor.to is not dumped), so mul's input already differs while rsqrt's output does not.
    The old rule called every "in" record inherited: mul's output was explained by its input,
    the norm by mul, and nothing was named. The cast is the norm's code before mul."""
    run = Run()
    n = "r0.s0:model.layers.0.post_attention_layernorm#0"
    run.add("r0.s0:model.embed_tokens#0:out.0")
    for i, op in enumerate(("Tensor.pow", "torch.rsqrt")):
        run.add(f"{n}/{op}@{i}:in.0").add(f"{n}/{op}@{i}:out.0")
    run.add(f"{n}/Tensor.__mul__@2:in.0", 1e-3).add(f"{n}/Tensor.__mul__@2:out.0", 1e-3)
    run.add(f"{n}:out.0", 1e-3)
    a = run.analyze(tmp_path)
    c = a.culprit
    assert c.where == "model.layers.0.post_attention_layernorm#0 / Tensor.__mul__@2"
    assert str(c.seen_at) == f"{n}/Tensor.__mul__@2:in.0"
    assert "between its recorded ops" in render(a)
