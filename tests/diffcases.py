"""Real captures of the tiny model for the diff / locate / report tests (not a test module).

`make(kind, model, tok, path, ref=None)` writes one capture: the reference, an identical rerun,
the whole model in another dtype, a planted fault, a numerically-equivalent fused RMSNorm, or
fp32 reordering noise ("fp32_dither"). Candidates follow the reference's tokens.

Every capture runs with exactly THREADS torch threads. Noise a test relies on is made here, not
hoped for from the BLAS: "fp32_dither" moves one ULP of a quarter of every rounding op's
float32 outputs (accucheck.capture.faults.dithered, seeded), the size of a reordered sum, on
every machine (1 vs 2 threads is bitwise equal on some CPUs).
"""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

PROMPTS = ["The quick brown fox jumps over the lazy dog", "Accuracy of large language models"]
STEPS = 2
NORM_FAULT = "model.layers.2.post_attention_layernorm"
THREADS = 2
ACT_FAULT = "model.layers.1.mlp.act_fn"


@contextmanager
def fused_rms_norm():
    """Every LlamaRMSNorm computed by torch.nn.functional.rms_norm (one fused call)."""
    import torch
    import transformers.models.llama.modeling_llama as ml

    orig = ml.LlamaRMSNorm.forward

    def fused(self, x):
        return torch.nn.functional.rms_norm(x, self.weight.shape, self.weight,
                                            self.variance_epsilon)
    ml.LlamaRMSNorm.forward = fused
    try:
        yield
    finally:
        ml.LlamaRMSNorm.forward = orig


@contextmanager
def fp16_softmax(model, layer: int):
    """Layer `layer`'s attention computes its softmax in float16 (a downgraded kernel)."""
    import torch
    import transformers.models.llama.modeling_llama as ml
    from transformers import AttentionInterface

    def attn(module, query, key, value, attention_mask, scaling, dropout=0.0, **kw):
        if module.layer_idx != layer:
            return ml.eager_attention_forward(module, query, key, value, attention_mask,
                                              scaling, dropout, **kw)
        k = ml.repeat_kv(key, module.num_key_value_groups)
        v = ml.repeat_kv(value, module.num_key_value_groups)
        w = torch.matmul(query, k.transpose(2, 3)) * scaling
        if attention_mask is not None:
            w = w + attention_mask
        w = torch.softmax(w.half(), dim=-1).to(query.dtype)
        return torch.matmul(w, v).transpose(1, 2).contiguous(), w

    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register("accucheck_fp16_softmax", attn)
    # the additive float mask eager attention expects (an unknown implementation gets another)
    AttentionMaskInterface.register("accucheck_fp16_softmax", eager_mask)
    model.set_attn_implementation("accucheck_fp16_softmax")
    try:
        yield
    finally:
        model.set_attn_implementation("eager")


@contextmanager
def threads(n: int):
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def make(kind: str, model, tok, path: Path, ref: Path | None = None, *, store: str = "full",
         record_inputs: bool = False, steps: int = STEPS) -> Path:
    from contextlib import nullcontext

    from accucheck.capture.runners.hf import capture_model
    from accucheck.capture.faults import dithered, planted

    kw = dict(tokenizer=tok, store=store, max_new_tokens=steps, record_inputs=record_inputs,
              tokens_from=str(ref) if ref is not None else None)
    ctx = {
        "ref": nullcontext(), "same": nullcontext(),
        "bf16": nullcontext(), "fp16": nullcontext(), "fp64": nullcontext(),
        "norm_bf16": planted(model, NORM_FAULT, "bf16"),
        "act_silu": planted(model, ACT_FAULT, "act:silu_fast"),
        "fused_norm": fused_rms_norm(),
        "fp32_dither": dithered(1),
    }[kind]
    dtype = {"bf16": "bfloat16", "fp16": "float16", "fp64": "float64"}.get(kind)
    with threads(THREADS), ctx:
        capture_model(model, PROMPTS, path, dtype=dtype, **kw)
    return path
