"""Real captures of the tiny model for the diff / locate / report tests (not a test module).

`make(kind, model, tok, path, ref=None)` writes one capture: the reference, an identical rerun,
the whole model in another dtype, a planted fault, a numerically-equivalent fused RMSNorm, or
fp32 reordering noise (one CPU thread). Candidates follow the reference's tokens.

Every capture runs with exactly THREADS torch threads, "threads1" with one: the reordering noise
is then 1 vs 2 threads on every machine (with the machine's default, a one-core box would make
"threads1" equal to the reference).
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

    from accucheck.capture.api import capture_model
    from accucheck.capture.faults import planted

    kw = dict(tokenizer=tok, store=store, max_new_tokens=steps, record_inputs=record_inputs,
              tokens_from=str(ref) if ref is not None else None)
    ctx = {
        "ref": nullcontext(), "same": nullcontext(),
        "bf16": nullcontext(), "fp16": nullcontext(), "fp64": nullcontext(),
        "norm_bf16": planted(model, NORM_FAULT, "bf16"),
        "act_silu": planted(model, ACT_FAULT, "act:silu_fast"),
        "fused_norm": fused_rms_norm(),
        "threads1": nullcontext(),
    }[kind]
    dtype = {"bf16": "bfloat16", "fp16": "float16", "fp64": "float64"}.get(kind)
    with threads(1 if kind == "threads1" else THREADS), ctx:
        capture_model(model, PROMPTS, path, dtype=dtype, **kw)
    return path
