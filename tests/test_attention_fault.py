"""The planted attention-core fault `attn:scale:F` (accucheck.capture.faults): the softmax scale
of one attention module off by a factor, in whichever attention implementation runs (sdpa's
fused kernel calls no `aten._softmax`, so `op:aten._softmax:inscale` is inert there). It lives
in code no record covers: q/k/v_proj are untouched, o_proj's input carries it, and it grows
with F - 1 (bench/bench_devices.py sizes it to a multiple of the noise)."""
from __future__ import annotations

import pytest
import torch

from accucheck.capture.faults import planted
from accucheck.errors import UserError

PROMPT = "The quick brown fox jumps over the lazy dog"
L = "model.layers.1.self_attn"


def _run(model, tok, fault=None) -> dict[str, torch.Tensor]:
    """The recorded leaves of layer 1's attention (inputs of o_proj, outputs of q/k/v/o)."""
    seen: dict[str, torch.Tensor] = {}
    mods = dict(model.named_modules())
    hooks = [mods[f"{L}.{p}"].register_forward_hook(
        lambda m, a, o, p=p: seen.update({p: o.detach().clone(), f"{p}:in": a[0].clone()}))
        for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
    try:
        with (planted(model, *fault) if fault else torch.no_grad()), torch.no_grad():
            model(**tok(PROMPT, return_tensors="pt"))
    finally:
        for h in hooks:
            h.remove()
    return seen


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_the_attention_scale_fault_is_in_the_core_and_grows_with_its_factor(tiny, impl):
    model, tok = tiny
    old = model.config._attn_implementation
    model.config._attn_implementation = impl
    try:
        clean = _run(model, tok)
        errs = []
        for f in (1.01, 1.02, 1.04):
            bad = _run(model, tok, (L, f"attn:scale:{f}"))
            for p in ("q_proj", "k_proj", "v_proj"):  # what feeds the core: untouched
                assert torch.equal(bad[p], clean[p]), p
            core = clean["o_proj:in"]
            errs.append(float((bad["o_proj:in"] - core).norm() / core.norm()))
    finally:
        model.config._attn_implementation = old
    assert errs[0] > 0, errs
    # graded: about linear in F - 1 (a factor of 2 in F - 1 is a factor of 1.7-2.3 in error)
    assert 1.7 < errs[1] / errs[0] < 2.3 and 1.7 < errs[2] / errs[1] < 2.3, errs
    attn = dict(model.named_modules())[L]
    assert attn.scaling == attn.head_dim ** -0.5  # restored
    assert not attn._forward_hooks and not attn._forward_pre_hooks


def test_the_attention_scale_fault_is_refused_where_there_is_no_softmax_scale(tiny):
    model, _ = tiny
    with pytest.raises(UserError, match="not an attention module"):
        with planted(model, "model.layers.1.mlp", "attn:scale:1.1"):
            pass
    with pytest.raises(UserError, match="attn:scale:F"):
        with planted(model, L, "attn:scale:x"):
            pass
