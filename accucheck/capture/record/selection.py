"""What a capture records: which modules are hooked by default, and the tensors of a module
call by slot name.

Imports torch and accucheck.keys. Used by the recorder, the op / shadow / graph recorders and
the vLLM plugin.
"""
from __future__ import annotations

import fnmatch
from typing import Any, Callable, Sequence

import torch
from torch import nn

from accucheck.keys import clean_slot, is_layer_block, layer_of

_EMBED_NAMES = ("embed_tokens", "embeddings", "wte", "embed_in")
_FINAL_NORM_NAMES = ("norm", "final_layernorm", "ln_f", "final_layer_norm", "norm_f")
# rotary / position embeddings, wherever they sit (HF Llama: model.rotary_emb, called once per
# forward; its (cos, sin) reach every layer's attention as `position_embeddings`)
_POSITION_NAMES = ("rotary_emb", "rotary_pos_emb", "wpe", "embed_positions")
_POSITION_CLASSES = ("RotaryEmbedding",)
_HEAD_NAMES = ("lm_head",)  # its output is the `logits` record
# never recorded: pass-through modules, and containers that are never called
_SKIP_CLASSES = ("Dropout", "Identity", "ModuleList", "ModuleDict")


def default_modules(model: nn.Module) -> list[str]:
    """Module paths recorded by default, in `named_modules` order: the embeddings, every
    decoder layer block, the final norm and the rotary / position embedding module(s), each
    with ALL its descendants (attention, MLP, norms, the leaf Linear q/k/v/o_proj and
    gate/up/down_proj, activations, MoE routers and experts, BERT's `embeddings.LayerNorm`,
    ...), so a divergence can be blamed at the leaf that introduces it.

    Left out: the root and the base model container (`model` of LlamaForCausalLM), lm_head
    (its output is the `logits` record), Dropout / Identity, ModuleList / ModuleDict. A selected
    module that is never called (a container) simply produces no record. Children are recorded
    before their parent (forward hooks fire when a call returns)."""
    by_name = dict(model.named_modules())
    layer_blocks = {name for name in by_name if is_layer_block(name)}
    picked: set[str] = set()
    for name, mod in by_name.items():
        if not name or name in picked:
            continue
        leaf = name.split(".")[-1]
        top = layer_of(name) is None
        if (leaf in _EMBED_NAMES and top) or name in layer_blocks \
                or (leaf in _FINAL_NORM_NAMES and top) or leaf in _POSITION_NAMES \
                or is_kind(mod, _POSITION_CLASSES):
            picked.update(sub for sub, _ in mod.named_modules(prefix=name))
    return [name for name, mod in by_name.items()
            if name in picked and not is_kind(mod, _SKIP_CLASSES)
            and name.split(".")[-1] not in _HEAD_NAMES]


def is_kind(mod: nn.Module, suffixes: tuple[str, ...]) -> bool:
    """Whether a class in `mod`'s MRO has a name ending with one of `suffixes`. By the bases,
    not the class's own name: vllm-ascend swaps in subclasses whose names do not end like
    vLLM's (AscendRotaryEmbedding310 for RotaryEmbedding)."""
    return any(c.__name__.endswith(suffixes) for c in type(mod).__mro__)


def select_modules(model: nn.Module, include: Sequence[str] | None = None,
                   exclude: Sequence[str] | None = None,
                   layers: Sequence[tuple[int, int]] | None = None) -> list[str]:
    """Module paths to hook, in `named_modules` order. `include` globs replace the default
    selection; `exclude` globs then remove paths; `layers` (--layers, inclusive ranges) then
    removes the paths inside decoder layers outside them (paths outside layers stay)."""
    if include:
        names = [n for n, _ in model.named_modules()
                 if n and any(fnmatch.fnmatchcase(n, p) for p in include)]
    else:
        names = default_modules(model)
    if exclude:
        names = [n for n in names if not any(fnmatch.fnmatchcase(n, p) for p in exclude)]
    if layers:
        names = [n for n in names if (k := layer_of(n)) is None
                 or any(lo <= k <= hi for lo, hi in layers)]
    return names


def token_cut(tokens: int, last: int | None) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """--positions last:N at a forward of `tokens` input positions (one request: a batch of
    one, or vLLM's flat tokens): the cut of a tensor to its last N positions, None where
    nothing is cut (every position kept, or `tokens` <= N: a decode step). The position axis
    is axis 1 after a batch axis of 1 ([1, tokens, ...]: hidden states, rotary cos / sin,
    logits), else axis 0 when its length is `tokens` ([tokens, experts]: router logits); a
    tensor with neither is kept whole (an attention mask, the heads-first q / k / v of
    op-level records). An MoE expert's gathered tokens are cut only if every token reached
    it (then they are the positions, in order); both runs apply the same rule, so records
    pair alike."""
    if last is None or tokens <= last:
        return None
    start = tokens - last

    def cut(t: torch.Tensor) -> torch.Tensor:
        s = t.shape
        if len(s) >= 2 and s[0] == 1 and s[1] == tokens:
            return t[:, start:]
        if len(s) >= 1 and s[0] == tokens:
            return t[start:]
        return t
    return cut


def topk_logprobs(logits: torch.Tensor, k: int, follow: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw logits [..., positions, vocab] -> (log-probabilities [..., positions, k + 1] float32,
    token ids [..., positions, k + 1] int64): column 0 the token that follows each position
    (`follow` [..., positions] int64; -1 where none follows: id -1, NaN), columns 1..k the k
    largest in descending order (store.logits_topk: what `--logits topk:K` keeps, the layout
    vLLM's logprobs have)."""
    lp = torch.log_softmax(logits.detach().float(), dim=-1)
    values, ids = torch.topk(lp, min(k, lp.shape[-1]), dim=-1)
    follow = follow.to(device=lp.device, dtype=torch.long)
    at = lp.gather(-1, follow.clamp(min=0).unsqueeze(-1))
    at = torch.where(follow.unsqueeze(-1) >= 0, at, torch.full_like(at, float("nan")))
    return torch.cat([at, values], dim=-1), torch.cat([follow.unsqueeze(-1), ids], dim=-1)


def flatten(obj: Any, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    """Tensors inside tensors / tuples / lists / dicts / ModelOutput, with their slot names.
    None and non-tensor leaves (caches, ints) are skipped. A complex tensor (DeepSeek-V2's
    rotary frequencies) is its real view: a float tensor with a last dimension of 2."""
    if isinstance(obj, torch.Tensor):
        return [(prefix or "0", torch.view_as_real(obj) if obj.is_complex() else obj)]
    out: list[tuple[str, torch.Tensor]] = []
    if isinstance(obj, dict):  # ModelOutput is an OrderedDict
        items = [(clean_slot(k), v) for k, v in obj.items()]
    elif isinstance(obj, (tuple, list)):
        items = [(str(i), v) for i, v in enumerate(obj)]
    else:
        return out
    for k, v in items:
        out.extend(flatten(v, f"{prefix}.{k}" if prefix else k))
    return out


_SLOTS: dict[Any, str] = {}


def _slot(k: Any) -> str:
    s = _SLOTS.get(k)
    if s is None:
        s = clean_slot(k)
        if len(_SLOTS) < 4096:
            _SLOTS[k] = s
    return s


def call_slots(args: tuple, kwargs: dict | None) -> list[tuple[str, torch.Tensor]]:
    """`flatten(inputs_of((args, kwargs)))`, faster: the tensor inputs of a module call with
    their slots."""
    out: list[tuple[str, torch.Tensor]] = []
    for i, v in enumerate(args):
        if isinstance(v, torch.Tensor):
            out.append((_slot(i), torch.view_as_real(v) if v.is_complex() else v))
        elif isinstance(v, (tuple, list, dict)):
            out.extend(flatten(v, _slot(i)))
    if kwargs:
        for k, v in kwargs.items():
            if isinstance(v, torch.Tensor):
                out.append((_slot(k), torch.view_as_real(v) if v.is_complex() else v))
            elif isinstance(v, (tuple, list, dict)):
                out.extend(flatten(v, _slot(k)))
    return out


def inputs_of(args: tuple) -> dict:
    """Forward-pre-hook (with_kwargs) arguments `(positional, kwargs)` as one dict."""
    pos, kw = args
    out = {str(i): v for i, v in enumerate(pos)}
    out.update(kw or {})
    return out
