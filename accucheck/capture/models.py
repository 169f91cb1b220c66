"""Hugging Face runner: load a local model directory, run prefill + greedy decode steps.

Imports torch and transformers. Used by accucheck.capture.runners.hf; knows nothing about HDF5.
"""
from __future__ import annotations

import hashlib
import inspect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import nn

from accucheck.errors import UserError, one_line

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float64": torch.float64}
_VOLATILE_CONFIG = ("torch_dtype", "dtype", "_name_or_path", "transformers_version",
                    "_attn_implementation_autoset", "_commit_hash", "architectures")


def parse_dtype(name: str) -> torch.dtype:
    aliases = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "fp64": "float64",
               "half": "float16", "double": "float64", "float": "float32"}
    name = aliases.get(name, name)
    if name not in DTYPES:
        raise UserError.usage(f"unknown dtype {name!r}: use one of {', '.join(DTYPES)}")
    return DTYPES[name]


def is_causal_lm(model: nn.Module) -> bool:
    return hasattr(model, "get_output_embeddings") and model.get_output_embeddings() is not None \
        and bool(getattr(getattr(model, "config", None), "is_decoder", True)) \
        and not getattr(getattr(model, "config", None), "is_encoder_decoder", False) \
        and type(model).__name__.endswith(("ForCausalLM", "LMHeadModel"))


PICKLE_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.txt",
                   "vocab.json", "spiece.model", "sentencepiece.bpe.model")


def check_model_dir(model_dir: str | Path, *, trust_remote_code: bool = False) -> dict:
    """Check a local model directory before loading it (UserError, exit 3, naming what is
    wrong): config.json is a JSON object; the weights are safetensors (never a pickle: loading
    one runs code) and their headers are intact; a tokenizer is there. Returns the config."""
    path = Path(model_dir)
    if not path.is_dir():
        raise UserError(f"model directory {path} does not exist (give a local folder with "
                        f"config.json, or run `accucheck tiny-model DIR` for the built-in one)")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise UserError(f"{path} has no config.json: not a Hugging Face model directory")
    try:
        config = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{cfg_file} cannot be read: {one_line(e, 160)}") from None
    if not isinstance(config, dict):
        raise UserError(f"{cfg_file} is a JSON {type(config).__name__}, not an object: not a "
                        f"Hugging Face config")
    if config.get("auto_map") and not trust_remote_code and not _known_model_type(config):
        raise UserError(_custom_code(path))
    _check_weights(path)
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise UserError(f"{path} has no tokenizer (tokenizer.json or tokenizer_config.json): save "
                        f"the model's tokenizer into it with tokenizer.save_pretrained(), or "
                        f"capture token ids through the Python API (capture_model)")
    return config


def _check_weights(path: Path) -> None:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"]
                               .values()))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError,
                AttributeError):
            raise UserError(f"{index} is damaged (no weight_map): copy the model again") from None
        missing = [f for f in files if not (path / f).is_file()]
        if missing:
            raise UserError(f"{path} lacks {missing[0]} (named in model.safetensors.index.json"
                            f"{f' with {len(missing) - 1} more' if len(missing) > 1 else ''}): "
                            f"copy the model again")
        shards = [path / f for f in files]
    else:
        shards = sorted(path.glob("*.safetensors"))
    if not shards:
        pickles = sorted(p.name for pat in PICKLE_WEIGHTS for p in path.glob(pat))
        if pickles:
            raise UserError(
                f"{path} has pickle weights only ({pickles[0]}): accucheck loads safetensors "
                f"only (a pickle can run code when loaded); convert once where you trust the "
                f"file: python -c \"from transformers import AutoModelForCausalLM as M; "
                f"M.from_pretrained('{path}', use_safetensors=False).save_pretrained('{path}', "
                f"safe_serialization=True)\"")
        raise UserError(f"{path} has no weights (model.safetensors): copy the model again, or "
                        f"run `accucheck tiny-model DIR` for the built-in one")
    from safetensors import SafetensorError, safe_open

    for f in shards:
        try:
            with safe_open(str(f), framework="pt") as h:
                h.keys()
        except (SafetensorError, OSError) as e:
            raise UserError(f"{f} is not a readable safetensors file ({one_line(e, 120)}): "
                            f"truncated or damaged; copy the model again") from None


def load_model_dir(model_dir: str | Path, dtype: torch.dtype, device: torch.device, *,
                   trust_remote_code: bool = False, attn_implementation: str | None = None):
    """(model, tokenizer) from a local directory; AutoModelForCausalLM when the config says it is
    a causal LM, AutoModel otherwise (encoders such as BERT). Never downloads anything, loads
    safetensors only (see `check_model_dir`), shows no progress bars."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    path = Path(model_dir)
    check_model_dir(path, trust_remote_code=trust_remote_code)
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True,
                                            trust_remote_code=trust_remote_code)
    except (ValueError, OSError, KeyError, TypeError, json.JSONDecodeError) as e:
        raise UserError(_load_error(path, "config.json cannot be read", e,
                                    trust_remote_code)) from None
    archs = getattr(config, "architectures", None) or []
    causal = any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs)
    cls = AutoModelForCausalLM if causal else AutoModel
    kwargs = dict(local_files_only=True, trust_remote_code=trust_remote_code, dtype=dtype,
                  use_safetensors=True)
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model = cls.from_pretrained(path, **kwargs)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise UserError(_load_error(path, "cannot load the model", e,
                                    trust_remote_code)) from None
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True,
                                                  trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(_load_error(path, "cannot load the tokenizer", e,
                                    trust_remote_code)) from None
    return model.to(device).eval(), tokenizer


def load_tokenizer(model_dir: str | Path, *, trust_remote_code: bool = False):
    """The model directory's tokenizer, offline; a UserError in one line when it cannot load."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir, local_files_only=True,
                                             trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot load the tokenizer in {model_dir}: "
                        f"{str(e).splitlines()[0]}") from None


def _known_model_type(config: dict) -> bool:
    """Whether transformers has its own code for this config's model_type (then an auto_map
    is not needed to load it)."""
    try:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    except ImportError:
        return True
    return config.get("model_type") in CONFIG_MAPPING


def _custom_code(path: Path) -> str:
    return (f"{path} contains custom model code (auto_map in config.json) that runs only with "
            f"--trust-remote-code: pass --trust-remote-code if you trust the code in {path}")


def _load_error(path: Path, what: str, e: BaseException, trust_remote_code: bool) -> str:
    text = str(e)
    if not trust_remote_code and ("trust_remote_code" in text or "custom code" in text):
        return _custom_code(path)
    return f"{what} in {path}: {one_line(text, 240)}"


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
               causal: bool = True, model: object | None = None) -> Generation:
    """Step 0 = prefill over the prompt; steps 1..N each feed one token with the KV cache.
    The token fed at step k is `forced[k-1]` when teacher forcing, else the argmax of step k-1's
    last logits. `on_step(step)` is called before and `on_logits(logits)` after each forward.
    `model`: the module `forward` runs (compiled or wrapped), for its cache argument's name."""
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)
    generated: list[int] = []
    cache_arg = cache_argument(forward, model) if causal else None
    with torch.no_grad():
        on_step(0)
        out = forward(input_ids=ids, use_cache=causal) if causal else forward(input_ids=ids)
        logits = getattr(out, "logits", None) if causal else None
        on_logits(logits)
        past = _cache_of(out) if causal else None
        for k in range(1, max_new_tokens + 1 if causal else 1):
            nxt = int(forced[k - 1]) if forced is not None else int(logits[0, -1].argmax())
            generated.append(nxt)
            on_step(k)
            out = forward(input_ids=torch.tensor([[nxt]], dtype=torch.long, device=device),
                          use_cache=True, **{cache_arg: past})
            logits = out.logits
            on_logits(logits)
            past = _cache_of(out)
    return Generation(list(prompt_ids), generated)


def cache_argument(forward: Callable, model: object | None = None) -> str:
    """The name under which this model's forward takes the KV cache: `past_key_values` in
    transformers up to 5.23, `cache` from 5.24 (which deprecates the old name); in general the
    parameter annotated with a Cache type, so that no deprecated argument is ever passed.
    Read from `model`'s class when given (a wrapper of the forward, `fwd(*a, **k)`, hides the
    parameters), else from `forward` through torch.compile's `_orig_mod` and functools.wraps
    chains."""
    if model is not None:
        fn = type(model).forward
    else:
        fn = getattr(getattr(forward, "_orig_mod", forward), "forward", forward)
    try:
        params = inspect.signature(inspect.unwrap(fn)).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    if "past_key_values" in params:
        return "past_key_values"
    for name, prm in params.items():
        ann = prm.annotation if isinstance(prm.annotation, str) else \
            getattr(prm.annotation, "__name__", str(prm.annotation))
        if "Cache" in str(ann) or name in ("cache", "kv_cache", "past_key_value"):
            return name
    return "past_key_values"


def _cache_of(out) -> object | None:
    """The KV cache a forward returned: the output field `cache` (transformers 5.24 and later,
    where reading `past_key_values` warns that it is deprecated), else `past_key_values`,
    else whichever field holds a transformers Cache."""
    if hasattr(out, "keys"):
        keys = list(out.keys())
        for name in ("cache", "past_key_values"):
            if name in keys:
                return out[name]
        for k in keys:
            if type(out[k]).__name__.endswith("Cache"):
                return out[k]
        return None
    return getattr(out, "past_key_values", None)
