"""Forward-hook recorder: selects modules, copies what they produce, writes records.

Imports torch, accucheck.keys and accucheck.store (never h5py directly).

Hooks are a scoped resource: `Recorder.hooks()` registers them, keeps every handle and removes
them in `finally`, also when forward raises. The user's model is never modified beyond the
hooks (which are removed) and tensors are copied before anything else sees them.

Graph mode: hooks are registered BEFORE torch.compile and do not read Python state (request,
step and call counters are assigned afterwards, in `end_step`), so the compiled graph does not
guard on them. In graph mode a hook only appends a detached clone to a list that dynamo replays
as a side effect; statistics are computed after the forward. In eager mode the hook computes the
statistics at once on the device (one small tensor per record, moved to the host once per step).
"""
from __future__ import annotations

import fnmatch
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np
import torch
from torch import nn

from accucheck.keys import LOGITS_MODULE, RecordKey, clean_slot, is_layer_block, layer_of
from accucheck.store import SAMPLE_SIZE, CaptureWriter, bf16_bits_to_float32

_EMBED_NAMES = ("embed_tokens", "embeddings", "wte", "embed_in")
_FINAL_NORM_NAMES = ("norm", "final_layernorm", "ln_f", "final_layer_norm", "norm_f")
_ROUTER_NAMES = ("gate", "router")  # MoE routers inside a layer's MLP block
_SKIP_CLASSES = ("Dropout", "Identity", "RotaryEmbedding")
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def default_modules(model: nn.Module) -> list[str]:
    """Embeddings, every decoder layer and its direct children (attention, MLP, norms), MoE
    routers (a `gate` / `router` inside a layer's MLP: router logits, top-k weights and the
    chosen experts, where expert-selection flips show), the final norm. lm_head is left out:
    its output is the `logits` record."""
    layer_blocks = {name for name, _ in model.named_modules() if is_layer_block(name)}
    picked = []
    for name, mod in model.named_modules():
        if not name or type(mod).__name__.endswith(_SKIP_CLASSES):
            continue
        leaf = name.split(".")[-1]
        parent = name.rsplit(".", 1)[0] if "." in name else ""
        grandparent = parent.rsplit(".", 1)[0] if "." in parent else ""
        if (leaf in _EMBED_NAMES and layer_of(name) is None) or name in layer_blocks \
                or parent in layer_blocks \
                or (leaf in _ROUTER_NAMES and grandparent in layer_blocks) \
                or (leaf in _FINAL_NORM_NAMES and layer_of(name) is None):
            picked.append(name)
    return picked


def select_modules(model: nn.Module, include: Sequence[str] | None = None,
                   exclude: Sequence[str] | None = None) -> list[str]:
    """Module paths to hook, in `named_modules` order. `include` globs replace the default
    selection; `exclude` globs then remove paths."""
    if include:
        names = [n for n, _ in model.named_modules()
                 if n and any(fnmatch.fnmatchcase(n, p) for p in include)]
    else:
        names = default_modules(model)
    if exclude:
        names = [n for n in names if not any(fnmatch.fnmatchcase(n, p) for p in exclude)]
    return names


def flatten(obj: Any, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    """Tensors inside tensors / tuples / lists / dicts / ModelOutput, with their slot names.
    None and non-tensor leaves (caches, ints) are skipped."""
    if isinstance(obj, torch.Tensor):
        return [(prefix or "0", obj)]
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


def tensor_stats(t: torch.Tensor) -> torch.Tensor:
    """Raw statistics [min, max, sum, l2, nan, inf, zero, checksum] followed by SAMPLE_SIZE
    values at fixed positions (store.py, /index/sample), as one float64 tensor on t's device: a
    few fused reductions and one gather, no host sync. `finish_stats` turns the row into the
    stored one on the host. With NaN/Inf present, min..l2 are NaN-poisoned here (the counts are
    exact); `finish_stats` recomputes them over the finite values when the tensor is at hand."""
    x = t.detach()
    xf = x if x.dtype in (torch.float32, torch.float64) else x.to(torch.float32)
    n = xf.numel()
    if n:
        mn, mx = torch.aminmax(xf)
    else:
        mn = mx = xf.sum()
    bits = x.view(_BITS[x.element_size()]) if x.is_floating_point() else x
    vals = torch.stack([mn, mx, xf.sum(), torch.linalg.vector_norm(xf)]).to(torch.float64)
    counts = torch.stack([torch.isnan(xf).sum(), torch.isinf(xf).sum(), (xf == 0).sum(),
                          torch.remainder(bits.sum(), 2**52)]).to(torch.float64)
    flat = xf.reshape(-1)
    if n >= SAMPLE_SIZE:
        idx = torch.arange(SAMPLE_SIZE, device=xf.device) * (n - 1) // (SAMPLE_SIZE - 1)
        sample = flat[idx].to(torch.float64)
    else:
        sample = torch.cat([flat.to(torch.float64),
                            torch.full((SAMPLE_SIZE - n,), float("nan"), dtype=torch.float64,
                                       device=xf.device)])
    return torch.cat([vals, counts, sample])


def finish_stats(raw: np.ndarray, numel: int, host: np.ndarray | None = None) -> np.ndarray:
    """Stored statistics row (store.STAT_FIELDS, then the SAMPLE_SIZE sampled values) from a
    `tensor_stats` row. `host` (the exact values, when captured) lets a NaN/Inf-holding tensor
    get finite-only min..l2."""
    mn, mx, s, l2, nan, inf, zero = (float(v) for v in raw[:7])
    if nan + inf and host is not None:
        f = host.astype(np.float64).ravel()
        f = f[np.isfinite(f)]
        nf = f.size
        mn, mx, s, l2 = (f.min(), f.max(), f.sum(), np.sqrt(f @ f)) if nf else (np.nan,) * 4
    else:
        nf = numel - nan - inf
    mean = s / nf if nf else np.nan
    var = max(l2 * l2 - s * mean, 0.0) / (nf - 1) if nf > 1 else 0.0
    absmax = max(abs(mn), abs(mx))
    return np.concatenate([
        np.array([mn, mx, mean, np.sqrt(var), absmax, l2, nan, inf, zero, numel], dtype=np.float64),
        np.asarray(raw[8:8 + SAMPLE_SIZE], dtype=np.float64)])


def to_host(t: torch.Tensor) -> tuple[np.ndarray, str]:
    """Copy to a numpy array in the stored representation (bfloat16 -> uint16 bits)."""
    x = t.detach().to("cpu", copy=True).contiguous()
    dtype = str(x.dtype).replace("torch.", "")
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16).numpy().view(np.uint16), dtype
    return x.numpy(), dtype


@dataclass
class _Pending:
    module: str
    role: str
    slot: str
    kind: str
    tensor: torch.Tensor | None  # graph mode: clone awaiting statistics
    stats: torch.Tensor | None   # eager mode: statistics already on the device
    host: np.ndarray | None
    dtype: str
    shape: tuple[int, ...]
    # op-level records (accucheck.capture.ops) and shadow replays carry their own key parts
    op: str | None = None
    op_index: int | None = None
    call: int | None = None
    extra: str = ""


class Recorder:
    """Records module outputs (and inputs) of one model into a CaptureWriter.

    Call `begin_step(req, step)` before each forward and `end_step(logits=...)` after it.
    """

    def __init__(self, model: nn.Module, writer: CaptureWriter, modules: Sequence[str], *,
                 record_inputs: bool = False, graph: bool = False):
        self.model = model
        self.writer = writer
        self.modules = list(modules)
        self.record_inputs = record_inputs
        self.graph = graph
        self.full = writer.store == "full"
        self._pending: list[_Pending] = []
        self._req = 0
        self._step = 0
        self.handles: list[Any] = []

    # -- hooks ---------------------------------------------------------------------------
    def _make_hook(self, name: str, role: str):
        pending = self._pending
        if self.graph:
            def hook_graph(_mod, *args):
                obj = args[-1] if role == "out" else inputs_of(args)
                for slot, t in flatten(obj):
                    pending.append(_Pending(name, role, slot, "module", t.detach().clone(),
                                            None, None, "", ()))
            return hook_graph

        full = self.full

        def hook_eager(_mod, *args):
            obj = args[-1] if role == "out" else inputs_of(args)
            for slot, t in flatten(obj):
                host, dtype = to_host(t) if full else (None, str(t.dtype).replace("torch.", ""))
                pending.append(_Pending(name, role, slot, "module", None, tensor_stats(t), host,
                                        dtype, tuple(t.shape)))
        return hook_eager

    @contextmanager
    def hooks(self) -> Iterator["Recorder"]:
        """Register hooks on the selected modules; remove every one on exit, also on error."""
        by_name = dict(self.model.named_modules())
        missing = [n for n in self.modules if n not in by_name]
        if missing:
            raise ValueError(f"modules not in model: {missing[:5]}")
        try:
            for name in self.modules:
                mod = by_name[name]
                if self.record_inputs:
                    self.handles.append(mod.register_forward_pre_hook(
                        self._make_hook(name, "in"), with_kwargs=True))
                self.handles.append(mod.register_forward_hook(self._make_hook(name, "out")))
            yield self
        finally:
            for h in self.handles:
                h.remove()
            self.handles.clear()
            self._pending.clear()

    # -- steps ---------------------------------------------------------------------------
    def begin_step(self, req: int, step: int) -> None:
        self._pending.clear()
        self._req, self._step = req, step

    def end_step(self, logits: torch.Tensor | None = None) -> int:
        """Turn what the hooks collected (plus the step's logits) into records; flush.
        Returns the number of records written."""
        items = list(self._pending)
        self._pending.clear()
        if logits is not None:
            items.append(_Pending(LOGITS_MODULE, "out", "0", "logits", logits.detach(), None,
                                  None, "", ()))
        for p in items:
            if p.stats is None:  # graph mode / logits: statistics now
                t = p.tensor
                p.stats = tensor_stats(t)
                p.dtype, p.shape = str(t.dtype).replace("torch.", ""), tuple(t.shape)
                if self.full:
                    p.host, _ = to_host(t)
                p.tensor = None
        if not items:
            return 0
        rows = torch.stack([p.stats for p in items]).to("cpu").numpy()  # one transfer per step
        calls: dict[tuple[str, str, str], int] = {}
        for p, row in zip(items, rows):
            if p.call is not None:
                key = RecordKey(self._req, self._step, p.module, p.call, p.role, p.slot, p.op,
                                p.op_index)
            else:
                n = calls.get((p.module, p.role, p.slot), 0)
                calls[(p.module, p.role, p.slot)] = n + 1
                key = RecordKey(self._req, self._step, p.module, n, p.role, p.slot)
            n_el = int(np.prod(p.shape)) if p.shape else 1
            host = p.host
            if host is not None and p.dtype == "bfloat16":
                host = bf16_bits_to_float32(host)
            self.writer.add(key, p.kind, p.dtype, p.shape, finish_stats(row, n_el, host),
                            int(row[7]), p.host, p.extra)
        self.writer.flush()
        return len(items)


def inputs_of(args: tuple) -> dict:
    """Forward-pre-hook (with_kwargs) arguments `(positional, kwargs)` as one dict."""
    pos, kw = args
    out = {str(i): v for i, v in enumerate(pos)}
    out.update(kw or {})
    return out
