"""Whether captures can be compared at all: the same model. Imports errors only (a capture is
passed in as an open reader; nothing here imports h5py or torch).

Every capture's meta records `model.config_hash` (the architecture config without dtype and
paths, accucheck.capture.models.config_hash) and the config itself. Captures of two different
architectures (4 vs 2 layers, another hidden size) align only by accident of their key names:
a diff of them names a "culprit" that is nothing but the difference of the models. So the diff
refuses them (exit 3) unless the user says the models are meant to differ
(`--allow-model-mismatch`, e.g. for a checkpoint conversion).
"""
from __future__ import annotations

from typing import Any

from accucheck.errors import UserError

# config fields worth naming first when two configs differ
_TELLING = ("model_type", "num_hidden_layers", "n_layer", "hidden_size", "n_embd",
            "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size",
            "head_dim", "num_experts")
# recorded but not part of the architecture (see hf._VOLATILE_CONFIG)
_IGNORED = ("torch_dtype", "dtype", "_name_or_path", "transformers_version",
            "_attn_implementation_autoset", "_commit_hash", "architectures")


def _model(meta: dict) -> dict:
    m = meta.get("model")
    return m if isinstance(m, dict) else {}


def config_differences(a: dict | None, b: dict | None, limit: int = 3) -> list[str]:
    """Up to `limit` "field A vs B" strings, the telling fields first."""
    if not isinstance(a, dict) or not isinstance(b, dict):
        return []
    keys = [k for k in set(a) | set(b) if k not in _IGNORED and a.get(k) != b.get(k)]
    keys.sort(key=lambda k: (_TELLING.index(k) if k in _TELLING else len(_TELLING), k))
    return [f"{k} {_short(a.get(k))} vs {_short(b.get(k))}" for k in keys[:limit]]


def _short(v: Any) -> str:
    s = "-" if v is None else str(v)
    return s if len(s) <= 40 else s[:39] + "…"


def check_same_model(ref: Any, cand: Any, golden: Any = None, *,
                     allow_model_mismatch: bool = False) -> None:
    """UserError (exit 3) when `cand` (or `golden`) was captured from another model
    architecture than `ref` (different config hash in their meta), unless
    `allow_model_mismatch`. Readers need `.path` and `.meta`; a capture without a config hash
    (a plain nn.Module) is not judged."""
    if allow_model_mismatch:
        return
    ra = _model(ref.meta)
    for role, other in (("candidate", cand), ("golden", golden)):
        if other is None:
            continue
        ob = _model(other.meta)
        ha, hb = ra.get("config_hash"), ob.get("config_hash")
        if not ha or not hb or ha == hb:
            continue
        diffs = config_differences(ra.get("config"), ob.get("config"))
        why = "; ".join(diffs) if diffs else f"config hash {ha} vs {hb}"
        raise UserError(
            f"{ref.path} and {other.path} ({role}) were captured from different models ({why}):"
            f" compare captures of the same model, or pass --allow-model-mismatch if they are "
            f"meant to differ (e.g. a checkpoint conversion)")


def logits_notes(ref: Any, cand: Any) -> list[str]:
    """Which logits the two captures hold (meta "logits": "raw", before any logits processor,
    or "processed"): UserError (exit 3) for raw against processed, which measures the
    sampling processors, not the device; a note saying what is compared when the runners
    differ (transformers against vLLM); nothing when either side does not say."""
    ka = (ref.meta.get("logits") or {}) if isinstance(ref.meta.get("logits"), dict) else {}
    kb = (cand.meta.get("logits") or {}) if isinstance(cand.meta.get("logits"), dict) else {}
    a, b = ka.get("kind"), kb.get("kind")
    if not a or not b:
        return []
    if a != b:
        raise UserError(f"{ref.path} holds {a} logits, {cand.path} {b} ones: comparing them "
                        f"would measure the logits processors, not the device; capture both "
                        f"{'raw' if 'raw' in (a, b) else a} (accucheck records raw logits)")
    if ref.meta.get("runner") != cand.meta.get("runner"):
        return [f"logits compared: {a} on both sides (ref: {ka.get('source', '?')}; cand: "
                f"{kb.get('source', '?')})"]
    return []
