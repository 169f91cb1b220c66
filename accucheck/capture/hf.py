"""Hugging Face runner: load a local model directory, run prefill + greedy decode steps.

Imports torch and transformers. Used by accucheck.capture.api; knows nothing about HDF5.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import nn

from accucheck.errors import UserError

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float64": torch.float64}
_VOLATILE_CONFIG = ("torch_dtype", "dtype", "_name_or_path", "transformers_version",
                    "_attn_implementation_autoset", "_commit_hash", "architectures")


def parse_dtype(name: str) -> torch.dtype:
    aliases = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "fp64": "float64",
               "half": "float16", "double": "float64", "float": "float32"}
    name = aliases.get(name, name)
    if name not in DTYPES:
        raise UserError(f"unknown dtype {name!r}: use one of {', '.join(DTYPES)}")
    return DTYPES[name]


def is_causal_lm(model: nn.Module) -> bool:
    return hasattr(model, "get_output_embeddings") and model.get_output_embeddings() is not None \
        and bool(getattr(getattr(model, "config", None), "is_decoder", True)) \
        and not getattr(getattr(model, "config", None), "is_encoder_decoder", False) \
        and type(model).__name__.endswith(("ForCausalLM", "LMHeadModel"))


def load_model_dir(model_dir: str | Path, dtype: torch.dtype, device: torch.device, *,
                   trust_remote_code: bool = False, attn_implementation: str | None = None):
    """(model, tokenizer) from a local directory; AutoModelForCausalLM when the config says it is
    a causal LM, AutoModel otherwise (encoders such as BERT). Never downloads anything."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

    path = Path(model_dir)
    if not path.is_dir():
        raise UserError(f"model directory {path} does not exist (give a local folder with "
                        f"config.json, or run `accucheck tiny-model DIR` for the built-in one)")
    if not (path / "config.json").is_file():
        raise UserError(f"{path} has no config.json: not a Hugging Face model directory")
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True,
                                            trust_remote_code=trust_remote_code)
    except (ValueError, OSError, json.JSONDecodeError) as e:
        raise UserError(f"{path}/config.json cannot be read: {str(e).splitlines()[0]}") from None
    archs = getattr(config, "architectures", None) or []
    causal = any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs)
    cls = AutoModelForCausalLM if causal else AutoModel
    kwargs = dict(local_files_only=True, trust_remote_code=trust_remote_code, dtype=dtype)
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    try:
        model = cls.from_pretrained(path, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True,
                                                  trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot load the model in {path}: {str(e).splitlines()[0]}") from None
    return model.to(device).eval(), tokenizer


def config_hash(model: nn.Module) -> str | None:
    """Hash of the architecture config, independent of dtype and paths."""
    cfg = getattr(model, "config", None)
    if cfg is None:
        return None
    d = {k: v for k, v in cfg.to_dict().items() if k not in _VOLATILE_CONFIG}
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


def weight_hash(model: nn.Module, sample: int = 4096) -> str:
    """Dtype-independent fingerprint of the weights: names, shapes and a strided sample of
    values rounded to bfloat16 (so fp32 and bf16 copies of one checkpoint hash the same)."""
    h = hashlib.sha256()
    with torch.no_grad():
        for name, p in model.state_dict().items():
            flat = p.detach().reshape(-1)
            stride = max(1, flat.numel() // sample)
            vals = flat[::stride][:sample].to("cpu", torch.float32).to(torch.bfloat16)
            h.update(f"{name}:{tuple(p.shape)}".encode())
            h.update(vals.view(torch.int16).numpy().tobytes())
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class Generation:
    prompt_ids: list[int]
    generated_ids: list[int]


def greedy_run(forward: Callable, prompt_ids: Sequence[int], device: torch.device,
               max_new_tokens: int, *, forced: Sequence[int] | None = None,
               on_step: Callable[[int], None], on_logits: Callable[[torch.Tensor | None], None],
               causal: bool = True) -> Generation:
    """Step 0 = prefill over the prompt; steps 1..N each feed one token with the KV cache.
    The token fed at step k is `forced[k-1]` when teacher forcing, else the argmax of step k-1's
    last logits. `on_step(step)` is called before and `on_logits(logits)` after each forward."""
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)
    generated: list[int] = []
    with torch.no_grad():
        on_step(0)
        out = forward(input_ids=ids, use_cache=causal) if causal else forward(input_ids=ids)
        logits = getattr(out, "logits", None) if causal else None
        on_logits(logits)
        past = getattr(out, "past_key_values", None)
        for k in range(1, max_new_tokens + 1 if causal else 1):
            nxt = int(forced[k - 1]) if forced is not None else int(logits[0, -1].argmax())
            generated.append(nxt)
            on_step(k)
            out = forward(input_ids=torch.tensor([[nxt]], dtype=torch.long, device=device),
                          past_key_values=past, use_cache=True)
            logits = out.logits
            on_logits(logits)
            past = out.past_key_values
    return Generation(list(prompt_ids), generated)
