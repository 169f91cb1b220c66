"""Default module selection and capture on other decoder architectures (tiny random configs):
the same keys scheme, a bf16-vs-fp32 diff with no invented culprit, MoE routers recorded."""
from __future__ import annotations

import pytest
import torch

from accucheck.capture.runners.hf import capture_model
from accucheck.capture.faults import planted
from accucheck.capture.record.selection import default_modules
from accucheck.verdict.locate import analyze

SMALL = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)
CONFIGS = {
    "qwen2": SMALL,
    "qwen3": dict(SMALL, head_dim=8),
    "mistral": SMALL,
    "gemma2": dict(SMALL, head_dim=8),
    "gpt2": dict(vocab_size=128, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0),
    "qwen2_moe": dict(SMALL, moe_intermediate_size=16, shared_expert_intermediate_size=32,
                      num_experts=4, num_experts_per_tok=2),
}
IDS = [[1, 2, 3, 4, 5, 6]]


def _model(kind: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, **CONFIGS[kind])).eval()


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_capture_and_bf16_diff_without_invented_culprit(kind, tmp_path):
    model = _model(kind)
    mods = default_modules(model)
    layer0 = "transformer.h.0" if kind == "gpt2" else "model.layers.0"
    assert layer0 in mods and any(m.startswith(layer0 + ".") for m in mods)
    ref = capture_model(model, IDS, tmp_path / "ref.h5", max_new_tokens=2, store="full")
    cand = capture_model(model, IDS, tmp_path / "bf16.h5", max_new_tokens=2, store="full",
                         dtype="bfloat16", tokens_from=str(ref))
    a = analyze(ref, cand)
    assert a.exit_code == 0, a.location.first_divergence
    assert analyze(ref, ref).diff.records[0].error == 0


def test_moe_router_is_recorded_and_a_router_fault_is_named(tmp_path):
    model = _model("qwen2_moe")
    assert "model.layers.0.mlp.gate" in default_modules(model)
    ref = capture_model(model, IDS, tmp_path / "ref.h5", store="full")
    with planted(model, "model.layers.1.mlp.gate", "scale:-1"):  # inverted routing scores
        cand = capture_model(model, IDS, tmp_path / "cand.h5", store="full",
                             tokens_from=str(ref))
    fd = analyze(ref, cand).location.first_divergence
    assert (fd.key.module, fd.cause) == ("model.layers.1.mlp.gate", "introduced")
