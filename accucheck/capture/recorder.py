"""Forward-hook recorder: selects modules, copies what they produce, writes records.

Imports torch, accucheck.keys and accucheck.store (never h5py directly).

Hooks are a scoped resource: `Recorder.hooks()` registers them, keeps every handle and removes
them in `finally`, also when forward raises. The user's model is never modified beyond the
hooks (which are removed) and tensors are copied before anything else sees them.

Producer links (eager mode): every recorded tensor is remembered for the rest of the step by
its storage identity, `(untyped_storage().data_ptr(), _version)`, with a weak reference to the
storage (a freed storage never matches, even when a new tensor reuses its address; nothing is
kept alive). When a selected module is called, each floating-point tensor input is looked up:

- it IS a recorded tensor (or a view of one): the link `slot -> producer site` is stored in the
  /index/extra JSON of the call's first output record, `{"src": {"0": "model.layers.0#0:out.0",
  "position_embeddings.0": "model.rotary_emb#0:out.0"}}` (a site is `RecordKey.site`: the key
  without request and step; the producer is in the same request and step). When one tensor was
  recorded several times (o_proj's output is also self_attn's output), the last record wins:
  the outermost module that returned it;
- it is a parameter or buffer of the model: skipped (weights are never recorded per call);
- otherwise (a residual sum, `act(gate) * up`, an additive attention mask, a tensor made
  outside the selected modules) it is recorded as an "in" record of this call, also without
  `--inputs`, and remembered like an output: the next call that gets the same tensor (the mask
  passed to every layer) links to that "in" record instead of recording it again.

Integer / bool inputs are neither linked nor recorded (with `--inputs`, every tensor input is
recorded, as before, and links are stored for those that match). An input modified in place
since it was recorded has another `_version` and does not match (it is recorded). Inference
tensors (torch.inference_mode) have no version counter: they are never linked, always recorded.
Call indices of eager module records count the calls of the module in the step (assigned at
hook time, so "in" records of a call share its index).

Graph mode: hooks are registered BEFORE torch.compile and do not read Python state (request,
step and call counters are assigned afterwards, in `end_step`), so the compiled graph does not
guard on them. In graph mode a hook only appends a detached clone to a list that dynamo replays
as a side effect; statistics are computed after the forward. Tensor identity is not observable
inside compiled code: graph mode stores no links and records inputs only with `--inputs`. In
eager mode the hook computes the statistics at once on the device (one small tensor per record,
moved to the host once per step).
"""
from __future__ import annotations

import fnmatch
import json
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import numpy as np
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from accucheck.keys import LOGITS_MODULE, RecordKey, clean_slot, is_layer_block, layer_of
from accucheck.store import SAMPLE_SIZE, CaptureWriter, bf16_bits_to_float32

_EMBED_NAMES = ("embed_tokens", "embeddings", "wte", "embed_in")
_FINAL_NORM_NAMES = ("norm", "final_layernorm", "ln_f", "final_layer_norm", "norm_f")
# rotary / position embeddings, wherever they sit (HF Llama: model.rotary_emb, called once per
# forward; its (cos, sin) reach every layer's attention as `position_embeddings`)
_POSITION_NAMES = ("rotary_emb", "rotary_pos_emb", "wpe", "embed_positions")
_POSITION_CLASSES = ("RotaryEmbedding",)
_HEAD_NAMES = ("lm_head",)  # its output is the `logits` record
# never recorded: pass-through modules, and containers that are never called
_SKIP_CLASSES = ("Dropout", "Identity", "ModuleList", "ModuleDict")
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


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
                or type(mod).__name__.endswith(_POSITION_CLASSES):
            picked.update(sub for sub, _ in mod.named_modules(prefix=name))
    return [name for name, mod in by_name.items()
            if name in picked and not type(mod).__name__.endswith(_SKIP_CLASSES)
            and name.split(".")[-1] not in _HEAD_NAMES]


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


def dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


@dataclass(eq=False)
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
    # op-level records (accucheck.capture.ops), shadow replays and eager module records carry
    # their own key parts
    op: str | None = None
    op_index: int | None = None
    call: int | None = None
    extra: dict | None = None  # JSON object for /index/extra (op call details)
    src: dict | None = None    # input slot -> producer _Pending (links, see module docstring)
    producer: bool = False     # some link may point here: its site is needed at end_step


@dataclass(eq=False)
class _Frame:
    """One open module call: its call index and, for a selected module, the input links."""
    module: str
    call: int
    src: dict | None = None
    n_ops: int = 0
    occurrence: dict = field(default_factory=dict)


def _identity(t: torch.Tensor) -> tuple[int, int] | None:
    """(storage address, version) of `t`; None when it cannot be told apart reliably (inference
    tensors have no version counter; an empty storage has no address)."""
    if t.is_inference():
        return None
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensor subclasses without a storage
        return None
    return (ptr, t._version) if ptr else None


class _Producers:
    """Recorded tensors of the current step by storage identity (see the module docstring).

    Entries hold a weak reference to the storage, never the tensor: an expired one (its storage
    freed, maybe reused by a new tensor at the same address) never matches. Among live entries
    of one storage, the one with the same view (offset, shape, strides) wins, else the latest.
    """

    def __init__(self) -> None:
        self._by_id: dict[tuple[int, int], list[list]] = {}

    def clear(self) -> None:
        self._by_id.clear()

    def add(self, t: torch.Tensor, p: _Pending) -> None:
        ident = _identity(t)
        if ident is None:
            return
        view = (t.storage_offset(), tuple(t.shape), tuple(t.stride()))
        entries = self._by_id.setdefault(ident, [])
        entries[:] = [e for e in entries if not e[0].expired() and e[1] != view]
        entries.append([StorageWeakRef(t.untyped_storage()), view, p])
        p.producer = True

    def find(self, t: torch.Tensor) -> _Pending | None:
        ident = _identity(t)
        entries = self._by_id.get(ident) if ident is not None else None
        if not entries:
            return None
        live = [e for e in entries if not e[0].expired()]
        if len(live) != len(entries):
            entries[:] = live
        if not live:
            return None
        view = (t.storage_offset(), tuple(t.shape), tuple(t.stride()))
        for e in reversed(live):
            if e[1] == view:
                return e[2]
        return live[-1][2]


class Recorder:
    """Records module outputs (and inputs) of one model into a CaptureWriter.

    Call `begin_step(req, step)` before each forward and `end_step(logits=...)` after it.
    In eager mode, also stores producer links and records the inputs no link explains (see
    the module docstring).
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
        self._pause = 0
        self._stack: list[_Frame] = []      # open module calls, innermost last (eager)
        self._calls: dict[str, int] = {}    # calls of each module in this step (eager)
        self._closed: dict[str, _Frame] = {}  # the call of each module that returned last
        self._producers = _Producers()
        self._weights = {t.untyped_storage().data_ptr()
                         for t in (*model.parameters(), *model.buffers())}

    # -- pausing -------------------------------------------------------------------------
    @contextmanager
    def paused(self) -> Iterator[None]:
        """Hooks record nothing while paused (shadow replays, the recorder's own work)."""
        self._pause += 1
        try:
            yield
        finally:
            self._pause -= 1

    # -- records -------------------------------------------------------------------------
    def item(self, module: str, role: str, slot: str, t: torch.Tensor, call: int | None,
             op: str | None = None, op_index: int | None = None, extra: dict | None = None,
             kind: str = "module") -> _Pending:
        """A record with its key parts fixed now (statistics on the device, copy to the host
        in full mode)."""
        host, dtype = to_host(t) if self.full else (None, dtype_name(t))
        return _Pending(module, role, slot, kind, None, tensor_stats(t), host, dtype,
                        tuple(t.shape), op, op_index, call, extra)

    def is_weight(self, t: torch.Tensor) -> bool:
        """A parameter or buffer of the model, or a view of one."""
        try:
            return t.untyped_storage().data_ptr() in self._weights
        except (RuntimeError, NotImplementedError):
            return False

    def link_inputs(self, slots: list[tuple[str, torch.Tensor]], module: str, call: int,
                    op: str | None = None, kind: str = "module"
                    ) -> tuple[dict[str, _Pending], list[_Pending]]:
        """Producer links of a call's inputs, and the "in" records it needs: the unexplained
        floating-point inputs (every input with --inputs). New "in" records become producers.
        The caller appends the records to the step (op records get their op_index later)."""
        src: dict[str, _Pending] = {}
        ins: list[_Pending] = []
        for slot, t in slots:
            # an empty tensor (the prefill's empty KV cache) holds nothing to compare
            floating = (t.is_floating_point() or t.is_complex()) and t.numel() > 0
            weight = floating and self.is_weight(t)
            producer = self._producers.find(t) if floating and not weight else None
            if producer is not None:
                src[slot] = producer
            if self.record_inputs or (floating and not weight and producer is None):
                p = self.item(module, "in", slot, t, call, op, -1 if op else None, kind=kind)
                ins.append(p)
                if floating and not weight and producer is None:
                    self._producers.add(t, p)
        return src, ins

    def outputs(self, slots: list[tuple[str, torch.Tensor]], module: str, call: int,
                src: dict | None, op: str | None = None, op_index: int | None = None,
                extra: dict | None = None, kind: str = "module") -> list[_Pending]:
        """Output records of a call (links and `extra` on the first one), registered as
        producers."""
        outs = []
        for j, (slot, t) in enumerate(slots):
            p = self.item(module, "out", slot, t, call, op, op_index,
                          extra if j == 0 else None, kind=kind)
            if j == 0:
                p.src = src or None
            if t.is_floating_point() or t.is_complex():
                self._producers.add(t, p)
            outs.append(p)
        return outs

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

        if role == "in":
            def enter_eager(_mod, *args):
                if self._pause:
                    return None
                call = self._calls.get(name, 0)
                self._calls[name] = call + 1
                with self.paused():
                    src, ins = self.link_inputs(flatten(inputs_of(args)), name, call)
                pending.extend(ins)
                self._stack.append(_Frame(name, call, src))
                return None
            return enter_eager

        def out_eager(_mod, *args):
            if self._pause:
                return None
            frame = self._closed.get(name)
            if frame is None:
                return None
            with self.paused():
                pending.extend(self.outputs(flatten(args[-1]), name, frame.call, frame.src))
            return None
        return out_eager

    def _exit_hook(self, name: str):
        """Closes the call's frame (also when forward raises), before the output hooks run."""
        def exit_eager(_mod, _args, _out):
            if self._pause:
                return None
            frame = self.pop_frame(name)
            if frame is not None:
                self._closed[name] = frame
            return None
        return exit_eager

    def pop_frame(self, name: str) -> _Frame | None:
        """Remove `name`'s innermost open call (and any call left open above it by a child that
        raised); None when `name` has no open call."""
        for i in range(len(self._stack) - 1, -1, -1):
            if self._stack[i].module == name:
                frame = self._stack[i]
                del self._stack[i:]
                return frame
        return None

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
                if self.record_inputs or not self.graph:
                    self.handles.append(mod.register_forward_pre_hook(
                        self._make_hook(name, "in"), with_kwargs=True))
                if not self.graph:
                    self.handles.append(mod.register_forward_hook(
                        self._exit_hook(name), prepend=True, always_call=True))
                self.handles.append(mod.register_forward_hook(self._make_hook(name, "out")))
            yield self
        finally:
            for h in self.handles:
                h.remove()
            self.handles.clear()
            self._pending.clear()
            self._reset_step_state()

    # -- steps ---------------------------------------------------------------------------
    def _reset_step_state(self) -> None:
        self._stack.clear()
        self._calls.clear()
        self._closed.clear()
        self._producers.clear()

    def begin_step(self, req: int, step: int) -> None:
        self._pending.clear()
        self._reset_step_state()
        self._req, self._step = req, step

    def end_step(self, logits: torch.Tensor | None = None) -> int:
        """Turn what the hooks collected (plus the step's logits) into records; flush.
        Returns the number of records written."""
        items = list(self._pending)
        self._pending.clear()
        self._producers.clear()  # links never cross a step
        if logits is not None:
            items.append(_Pending(LOGITS_MODULE, "out", "0", "logits", logits.detach(), None,
                                  None, "", ()))
        for p in items:
            if p.stats is None:  # graph mode / logits: statistics now
                t = p.tensor
                p.stats = tensor_stats(t)
                p.dtype, p.shape = dtype_name(t), tuple(t.shape)
                if self.full:
                    p.host, _ = to_host(t)
                p.tensor = None
        if not items:
            return 0
        rows = torch.stack([p.stats for p in items]).to("cpu").numpy()  # one transfer per step
        calls: dict[tuple[str, str, str], int] = {}
        sites: dict[int, str] = {}
        for p, row in zip(items, rows):
            if p.call is not None:
                key = RecordKey(self._req, self._step, p.module, p.call, p.role, p.slot, p.op,
                                p.op_index)
            else:  # graph mode: counted here, hooks there must not read Python state
                n = calls.get((p.module, p.role, p.slot), 0)
                calls[(p.module, p.role, p.slot)] = n + 1
                key = RecordKey(self._req, self._step, p.module, n, p.role, p.slot)
            if p.producer:
                sites[id(p)] = key.site
            extra = p.extra
            if p.src:
                links = {slot: sites[id(q)] for slot, q in p.src.items() if id(q) in sites}
                if links:
                    extra = {**(extra or {}), "src": links}
            n_el = int(np.prod(p.shape)) if p.shape else 1
            host = p.host
            if host is not None and p.dtype == "bfloat16":
                host = bf16_bits_to_float32(host)
            self.writer.add(key, p.kind, p.dtype, p.shape, finish_stats(row, n_el, host),
                            int(row[7]), p.host,
                            json.dumps(extra, separators=(",", ":")) if extra else "")
        self.writer.flush()
        return len(items)


def inputs_of(args: tuple) -> dict:
    """Forward-pre-hook (with_kwargs) arguments `(positional, kwargs)` as one dict."""
    pos, kw = args
    out = {str(i): v for i, v in enumerate(pos)}
    out.update(kw or {})
    return out
