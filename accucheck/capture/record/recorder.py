"""Forward-hook recorder: copies what the selected modules produce, writes records.

Imports torch, accucheck.keys and accucheck.store (never h5py directly). Which modules are
selected and how a call's tensors are named: accucheck.capture.record.selection; which recorded
tensor an input is (producer links): accucheck.capture.record.links.

Hooks are a scoped resource: `Recorder.hooks()` registers them, keeps every handle and removes
them in `finally`, also when forward raises. The user's model is never modified beyond the
hooks and forward wrappers (which are removed) and tensors are copied before anything else
sees them.

Eager module records (`Recorder`, not its op / shadow subclasses) come from a forward wrapper
instead of two nn.Module hooks where that is equivalent: the module's `forward` instance
attribute is replaced while `hooks()` is open and put back on exit (a wrapper that someone
else wrapped again in the meantime is left in place and passes straight through). A module
without hooks of any kind is called on nn.Module's fast path, so the wrapper costs one Python
call: 0.005x of a seq-64 forward of the tiny Llama, where the dispatch of two hooks costs 0.05x
(bench/bench_capture.py's model, every module). The wrapper sees the call's inputs after every forward pre-hook and
its output before any forward hook, which is what our own hooks saw when they were the last
ones registered; a module that already has forward hooks when `hooks()` opens (a planted
fault replacing the output, a user's hook), and every module while a global forward hook is
registered, get the two hooks as before. A TorchScript module called from Python is wrapped
too (it takes no hooks); called from inside TorchScript, it records nothing.

One tensor, one set of statistics: a record of the very tensor an earlier record of the step
holds (same storage, version, view and dtype: o_proj's output is self_attn's, mlp's is
down_proj's; with --inputs, most inputs) reuses that record's statistics and, in full mode,
its dataset (CaptureWriter.add `share`). A weight recorded as an input (with --inputs; at op
level mm's transposed weight, the embedding table) has its statistics and values taken once
per capture and view, every record of it names the weight (/index/extra {"weight": NAME}) and
points to one dataset.

Statistics (accucheck.capture.record.stats.StepStats): taken in the hook, so an in-place change
after it cannot alter them; on the CPU one pass of a C kernel per record, on accelerators one copy
into a staging buffer per record and a dozen kernels per step and dtype / size group; the whole
step comes to the host once, in `end_step`.

Graph mode: hooks are registered BEFORE torch.compile and do not read Python state (request,
step and call counters are assigned afterwards, in `end_step`), so the compiled graph does not
guard on them. In graph mode a hook only appends a detached clone to a list that dynamo replays
as a side effect; statistics are computed after the forward. Tensor identity is not observable
inside compiled code: graph mode stores no links and records inputs only with `--inputs`. The
hooks are either the selected modules' outputs or `taps` (accucheck.capture.record.graph.Tap: the
default kernel-boundary taps, a Linear's first input or its output stored under the record
name the tap says).
"""
from __future__ import annotations

import functools
import json
import math
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
from torch import nn

from accucheck.capture.record.stats import StepStats, _no_modes, tensor_rows, to_host
from accucheck.capture.record.links import (Frame, Pending, Producers, identity, plain_storage,
                                            view_of, weak_expired, weak_free)
from accucheck.capture.record.selection import call_slots, flatten, inputs_of, token_cut
from accucheck.keys import LOGITS_MODULE, RecordKey
from accucheck.store import LOGITS_IDS_SLOT, CaptureWriter, bf16_bits_to_float32


def finish_stats(raw: np.ndarray, numel: int, host: np.ndarray | None = None) -> np.ndarray:
    """Stored statistics row (store.STAT_FIELDS, the SAMPLE_SIZE sampled values, the sketch row
    of accucheck.store.sketch) from a `tensor_stats` row. `host` (the exact values, when captured) lets a NaN/Inf-holding tensor
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
        np.asarray(raw[8:], dtype=np.float64)])


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def stats_rows(tensors: list[torch.Tensor], hosts: list[np.ndarray | None]
               ) -> list[tuple[np.ndarray, int]]:
    """(stored statistics row, checksum) per tensor, with one device-to-host transfer
    (accucheck.capture.record.stats: a staging copy per tensor and a dozen kernels per dtype / size
    on the GPU / NPU, one C pass per tensor on the CPU)."""
    if not tensors:
        return []
    raw = tensor_rows(tensors)
    out = []
    for t, host, row in zip(tensors, hosts, raw):
        vals = bf16_bits_to_float32(host) if host is not None and t.dtype == torch.bfloat16 \
            else host
        out.append((finish_stats(row, t.numel(), vals), int(row[7])))
    return out


def dtype_name(t: torch.Tensor) -> str:
    name = _DTYPE_NAMES.get(t.dtype)
    if name is None:
        name = _DTYPE_NAMES[t.dtype] = str(t.dtype).replace("torch.", "")
    return name


def finish_rows(raw: np.ndarray, numel: np.ndarray) -> np.ndarray:
    """`finish_stats` of many `tensor_stats` rows at once, without `host`: [n, STAT_FIELDS +
    SAMPLE_SIZE + SKETCH_WIDTH] float64 (the caller redoes rows holding NaN / Inf whose values it has)."""
    raw = np.asarray(raw, dtype=np.float64)
    n = np.asarray(numel, dtype=np.float64)
    mn, mx, s, l2, nan, inf = (raw[:, j] for j in range(6))
    nf = n - nan - inf
    with np.errstate(divide="ignore", invalid="ignore"):
        mean = np.where(nf > 0, s / np.where(nf > 0, nf, 1.0), np.nan)
        var = np.where(nf > 1, np.maximum(l2 * l2 - s * mean, 0.0)
                       / np.where(nf > 1, nf - 1, 1.0), 0.0)
    out = np.empty((raw.shape[0], 10 + raw.shape[1] - 8))
    out[:, 0], out[:, 1], out[:, 2], out[:, 3] = mn, mx, mean, np.sqrt(var)
    out[:, 4], out[:, 5] = np.maximum(np.abs(mn), np.abs(mx)), l2
    out[:, 6], out[:, 7], out[:, 8], out[:, 9] = nan, inf, raw[:, 6], n
    out[:, 10:] = raw[:, 8:]
    return out


def _json(obj: dict) -> str:
    return json.dumps(obj, separators=(",", ":"))


def _can_wrap(mod: nn.Module) -> bool:
    """Whether a forward wrapper sees what our hooks would (module docstring): no forward hook
    on `mod` or registered globally (it could replace the output after the wrapper returned)."""
    from torch.nn.modules import module as _m

    return not (mod._forward_hooks or _m._global_forward_hooks)


class _ForwardWrap:
    """The handle of one forward wrapper (`Recorder.hooks`): `remove()` puts the module's own
    `forward` back, the instance attribute it had (accelerate's, say) or none. A wrapper that
    was wrapped again meanwhile cannot be taken out: it is switched to pass straight through."""

    def __init__(self, mod: nn.Module, wrapper, live: list) -> None:
        self.mod, self.wrapper, self.live = mod, wrapper, live
        self.had = "forward" in mod.__dict__
        self.old = mod.__dict__.get("forward")
        mod.forward = wrapper

    def remove(self) -> None:
        d = self.mod.__dict__
        if d.get("forward") is self.wrapper:
            if self.had:
                d["forward"] = self.old
            else:
                del d["forward"]
        else:
            self.live[0] = False


class _CutStats:
    """The step's StepStats seen through a token cut (--positions last:N at a prefill): every
    tensor taken is cut first; `shapes` maps a row to its cut shape where the cut changed it."""

    def __init__(self, stats: StepStats, cut: Callable[[torch.Tensor], torch.Tensor]):
        self._stats, self.cut, self.shapes = stats, cut, {}

    def add(self, t: torch.Tensor) -> int:
        c = self.cut(t)
        i = self._stats.add(c)
        if c is not t:
            self.shapes[i] = tuple(c.shape)
        return i

    def now(self, t: torch.Tensor):
        return self._stats.now(t)  # weights: never cut

    def compute(self):
        return self._stats.compute()


class Recorder:
    """Records module outputs (and inputs) of one model into a CaptureWriter.

    Call `begin_step(req, step)` before each forward and `end_step(logits=...)` after it.
    In eager mode, also stores producer links and records the inputs no link explains
    (accucheck.capture.record.links). Statistics: accucheck.capture.record.stats (`stats_kernel`:
    "c" / "torch" for CPU tensors, default the C kernel when it builds).

    Eager, per selected module: a forward wrapper (`_wrapped_forward`, see the module
    docstring for when), else a pre-hook (call index, input links, "in" records) and one
    always-called forward hook that closes the call and records its outputs; both go through
    `_open_call` / `_close_call`. Subclasses that
    attribute work to the innermost open call (the op and shadow recorders) set
    `_merged_exit = False`: a separate exit hook, prepended, closes the call before any other
    forward hook runs (a planted fault's ops are then not the module's).

    Cost (bench/bench_capture.py): at short sequences a record costs Python, not bandwidth. The
    usual calls take fast paths with the same result as the general ones: one tensor in
    (`_link_one`) or out (`_one_output`), a storage with a single entry; the step's records
    reach the writer in one `add_rows` call. Links and "in" statistics are taken before forward
    runs (the wrapper's first half, or the pre-hook): forward may change its inputs in place.
    """

    _merged_exit = True
    _wrap_forward = True  # eager, merged exit: a forward wrapper where equivalent (module doc)

    def __init__(self, model: nn.Module, writer: CaptureWriter, modules: Sequence[str], *,
                 record_inputs: bool = False, graph: bool = False,
                 stats_kernel: str | None = None, taps: Sequence | None = None,
                 keep: Sequence[str] = (), last_positions: int | None = None):
        self.model = model
        # --positions last:N: a prefill's tensors cut to its last N positions (token_cut)
        self.last_positions = last_positions
        self._skipping = False
        # modules whose outputs keep their values whatever the store mode (MoE routers: small,
        # and the diff needs them whole; accucheck.capture.record.moe)
        self.keep = frozenset(keep)
        self.taps = list(taps) if taps is not None else None  # graph mode: capture.record.graph.Tap
        self.writer = writer
        self.modules = list(modules)
        self.record_inputs = record_inputs
        self.graph = graph
        self.full = writer.store == "full"
        self.stats = self._all_stats = StepStats(keep=self.full, kernel=stats_kernel)
        self._pending: list[Pending] = []
        self._req = 0
        self._step = 0
        self.handles: list[Any] = []
        self._pause = 0
        self._stack: list[Frame] = []      # open module calls, innermost last (eager)
        self._calls: dict[str, int] = {}    # calls of each module in this step (eager)
        self._closed: dict[str, Frame] = {}  # the call of each module that returned last
        self._producers = Producers()
        # parameters and buffers by storage: (storage offset, name); a weight seen as an input
        # is recorded (with --inputs) with statistics and values kept once per capture
        self._weights: dict[int, list[tuple[int, str]]] = {}
        for name, w in (*model.named_parameters(), *model.named_buffers()):
            ptr = w.untyped_storage().data_ptr()
            if ptr:
                self._weights.setdefault(ptr, []).append((w.storage_offset(), name))
        self._weight_rows: dict[tuple, tuple] = {}  # weight view -> (raw row, host, share)
        self._n_shared = 0
        self._links_json: dict[tuple, str] = {}  # ((slot, site), ...) -> its /index/extra

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
             kind: str = "module") -> Pending:
        """A record with its key parts fixed now; its statistics (and, in full mode, its
        values) are taken now (StepStats.add: a copy or a finished reduction)."""
        return Pending(module, role, slot, kind, self.stats.add(t), dtype_name(t), t.shape,
                        t.numel(), op, op_index, call, extra)

    def weight_name(self, t: torch.Tensor, ptr: int | None = None) -> str | None:
        """The parameter / buffer name of `t` (or of the weight it is a view of), else None."""
        if ptr is None:
            try:
                ptr = t.untyped_storage().data_ptr()
            except (RuntimeError, NotImplementedError):
                return None
        entries = self._weights.get(ptr)
        if not entries:
            return None
        off = t.storage_offset()
        return next((name for o, name in entries if o == off), entries[0][1])

    def is_weight(self, t: torch.Tensor) -> bool:
        """A parameter or buffer of the model, or a view of one."""
        return self.weight_name(t) is not None

    def weight_item(self, module: str, role: str, slot: str, t: torch.Tensor, call: int | None,
                    name: str, op: str | None = None, op_index: int | None = None,
                    kind: str = "module") -> Pending:
        """A record of a weight (mm's transposed weight as an op input, ...): statistics and
        values taken once per capture and view; every record of it shares one dataset and
        names the weight in /index/extra ({"weight": "model.layers.0.mlp.up_proj.weight"})."""
        ck = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
              tuple(t.stride()), t.dtype)
        hit = self._weight_rows.get(ck)
        if hit is None:
            with _no_modes():
                row = self.stats.now(t)
                host = to_host(t)[0] if self.full else None
            hit = self._weight_rows[ck] = (row, host, f"w{len(self._weight_rows)}")
        p = Pending(module, role, slot, kind, hit[0], dtype_name(t), tuple(t.shape),
                     t.numel(), op, op_index, call, {"weight": name})
        p.host, p.share = hit[1], hit[2]
        return p

    def same_item(self, q: Pending, module: str, role: str, slot: str, call: int | None,
                  op: str | None = None, op_index: int | None = None,
                  extra: dict | None = None, kind: str = "module") -> Pending:
        """A record of the very tensor `q` recorded (o_proj's output is self_attn's): its
        statistics, and in full mode its dataset, are q's."""
        p = Pending(module, role, slot, kind, q.stats, q.dtype, q.shape, q.numel, op,
                     op_index, call, extra)
        p.host = q.host
        if self.full:
            if q.share is None:
                q.share = f"a{self._n_shared}"
                self._n_shared += 1
            p.share = q.share
        return p

    def link_inputs(self, slots: list[tuple[str, torch.Tensor]], module: str, call: int,
                    op: str | None = None, kind: str = "module"
                    ) -> tuple[dict[str, Pending], list[Pending]]:
        """Producer links of a call's inputs, and the "in" records it needs: the unexplained
        floating-point inputs (every input with --inputs). New "in" records become producers.
        The caller appends the records to the step (op records get their op_index later)."""
        src: dict[str, Pending] = {}
        ins: list[Pending] = []
        every = self.record_inputs
        op_index = -1 if op else None
        producers = self._producers
        by_id = producers.by_id
        for slot, t in slots:
            # an empty tensor (the prefill's empty KV cache) holds nothing to compare
            if not (t.is_floating_point() or t.is_complex()) or t.numel() == 0:
                if every:
                    ins.append(self.item(module, "in", slot, t, call, op, op_index, kind=kind))
                continue
            ident = identity(t)
            wname = self.weight_name(t, ident[0] if ident is not None else None) \
                if ident is None or ident[0] in self._weights else None
            if wname is not None:  # weights are never linked; recorded once with --inputs
                if every:
                    ins.append(self.weight_item(module, "in", slot, t, call, wname, op,
                                                op_index, kind))
                continue
            if ident is not None:
                if not every:  # find() of a storage with one live entry: that entry
                    entries = by_id.get((ident[0], ident[1]))
                    if entries is not None and len(entries) == 1 \
                            and not weak_expired(entries[0][0]):
                        src[slot] = entries[0][2]
                        continue
                view = view_of(t)
                producer = producers.find(t, ident, view)
                if producer is not None:
                    src[slot] = producer
                    if every:
                        q = producers.same(t, ident, view)
                        ins.append(self.same_item(q, module, "in", slot, call, op, op_index,
                                                  kind=kind) if q is not None else
                                   self.item(module, "in", slot, t, call, op, op_index,
                                             kind=kind))
                    continue
            p = self.item(module, "in", slot, t, call, op, op_index, kind=kind)
            ins.append(p)
            if ident is not None:
                producers.add(t, p, ident, view)
        return src, ins

    def outputs(self, slots: list[tuple[str, torch.Tensor]], module: str, call: int,
                src: dict | None, op: str | None = None, op_index: int | None = None,
                extra: dict | None = None, kind: str = "module") -> list[Pending]:
        """Output records of a call (links and `extra` on the first one), registered as
        producers. An output that IS an earlier record's tensor shares its statistics."""
        outs = []
        producers = self._producers
        add = self.stats.add
        for j, (slot, t) in enumerate(slots):
            x = extra if j == 0 else None
            ident = identity(t) if t.is_floating_point() or t.is_complex() else None
            if ident is not None:
                view = (t.storage_offset(), t.shape, t.stride(), t.dtype)
                q = producers.same(t, ident, view) if (ident[0], ident[1]) in producers.by_id \
                    else None
                p = self.same_item(q, module, "out", slot, call, op, op_index, x, kind) \
                    if q is not None else \
                    Pending(module, "out", slot, kind, add(t), dtype_name(t), t.shape,
                             t.numel(), op, op_index, call, x)
                producers.add(t, p, ident, view)
            else:
                p = self.item(module, "out", slot, t, call, op, op_index, x, kind)
            if j == 0:
                p.src = src or None
            if module in self.keep and not self.full:
                with _no_modes():
                    p.host = to_host(self.stats.cut(t) if isinstance(self.stats, _CutStats)
                                     else t)[0]
            outs.append(p)
        return outs

    def _one_output(self, t: torch.Tensor, module: str, call: int, src: dict | None
                    ) -> Pending:
        """`outputs([("0", t)], module, call, src)[0]`: the usual module output, faster
        (`identity` and `Producers.add` inlined for a storage without a live entry)."""
        st = plain_storage(t)
        ptr = st.data_ptr() if st is not None else 0
        if not ptr:
            return self.outputs([("0", t)], module, call, src)[0]
        key = (ptr, t._version)
        dt = t.dtype
        view = (t.storage_offset(), t.shape, t.stride(), dt)
        producers = self._producers
        by_id = producers.by_id
        entries = by_id.get(key)
        if entries is not None and len(entries) == 1 and weak_expired(entries[0][0]):
            weak_free(entries[0][0])  # a freed tensor's address, reused: what _live drops
            del by_id[key]
            entries = None
        if entries is None:  # the usual case: a new tensor, its storage's only entry
            p = Pending(module, "out", "0", "module", self.stats.add(t),
                         _DTYPE_NAMES.get(dt) or dtype_name(t), t.shape, t.numel(), None, None,
                         call)
            by_id[key] = [(st._weak_ref(), view, p)]  # what producers.add does here
            p.producer = True
        else:
            ident = (key[0], key[1], st)
            q = producers.same(t, ident, view)
            p = self.same_item(q, module, "out", "0", call) if q is not None else \
                Pending(module, "out", "0", "module", self.stats.add(t), dtype_name(t),
                         t.shape, t.numel(), None, None, call)
            producers.add(t, p, ident, view)
        p.src = src or None
        return p

    def _link_one(self, t: torch.Tensor, module: str, call: int) -> dict | None:
        """The usual leaf call without --inputs (one tensor argument): `link_inputs([("0", t)],
        module, call)`, faster. Appends the "in" record, if one is needed, to the step;
        returns the links (None for none)."""
        st = plain_storage(t) if t.numel() else None
        ptr = st.data_ptr() if st is not None else 0
        if ptr and ptr not in self._weights:
            producers = self._producers
            by_id = producers.by_id
            key = (ptr, t._version)
            entries = by_id.get(key)
            if entries is not None and len(entries) == 1:
                if not weak_expired(entries[0][0]):
                    return {"0": entries[0][2]}  # find(): the one live entry, any view
                weak_free(entries[0][0])  # a freed tensor's address, reused
                del by_id[key]
                entries = None
            dt = t.dtype
            view = (t.storage_offset(), t.shape, t.stride(), dt)
            ident = (ptr, key[1], st)
            producer = producers.find(t, ident, view) if entries is not None else None
            if producer is not None:
                return {"0": producer}
            p = Pending(module, "in", "0", "module", self.stats.add(t),
                         _DTYPE_NAMES.get(dt) or dtype_name(t), t.shape, t.numel(), None, None,
                         call)
            self._pending.append(p)
            if entries is None:  # what producers.add does for a storage without entries
                by_id[key] = [(st._weak_ref(), view, p)]
                p.producer = True
            else:
                producers.add(t, p, ident, view)
            return None
        src, ins = self.link_inputs([("0", t)], module, call)
        if ins:
            self._pending.extend(ins)
        return src or None

    # -- hooks ---------------------------------------------------------------------------
    def _tap_hook(self, tap):
        """Graph mode, one accucheck.capture.record.graph.Tap: a copy of the hooked module's first
        input (pre-hook) or its output, stored as record (tap.module, tap.role, tap.slot)."""
        pending, module, role, slot = self._pending, tap.module, tap.role, tap.slot
        if tap.where == "in":
            def tap_in(_mod, args):
                if args and isinstance(args[0], torch.Tensor):
                    pending.append(Pending(module, role, slot, "module", None, "", (), 0,
                                            tensor=args[0].detach().clone()))
            return tap_in

        def tap_out(_mod, _args, out):
            t = out if isinstance(out, torch.Tensor) else next(
                (v for s, v in flatten(out) if s == slot), None)
            if t is not None:
                pending.append(Pending(module, role, slot, "module", None, "", (), 0,
                                        tensor=t.detach().clone()))
        return tap_out

    def _make_hook(self, name: str, role: str):
        pending = self._pending
        if self.graph:
            def hook_graph(_mod, *args):
                obj = args[-1] if role == "out" else inputs_of(args)
                for slot, t in flatten(obj):
                    pending.append(Pending(name, role, slot, "module", None, "", (), 0,
                                            tensor=t.detach().clone()))
            return hook_graph

        stack, closed, open_call = self._stack, self._closed, self._open_call
        if role == "in":
            def enter_eager(_mod, args, kwargs):
                if self._pause:
                    return None
                stack.append(Frame(name, *open_call(name, args, kwargs)))
                return None
            return enter_eager

        if self._merged_exit:
            # one always-called hook closes the call's frame (also when forward raises: then
            # `out` is None) and records the outputs
            close_call = self._close_call

            def exit_out_eager(_mod, _args, out):
                if self._pause:
                    return None
                if stack and stack[-1].module == name:
                    frame = stack.pop()
                else:
                    frame = self.pop_frame(name)
                    if frame is None:
                        return None
                if out is not None:
                    close_call(out, name, frame.call, frame.src)
                return None
            return exit_out_eager

        outputs = self.outputs

        def out_eager(_mod, _args, out):
            if self._pause:
                return None
            frame = closed.get(name)
            if frame is None:
                return None
            pending.extend(outputs([("0", out)] if isinstance(out, torch.Tensor)
                                   else flatten(out), name, frame.call, frame.src))
            return None
        return out_eager

    def _open_call(self, name: str, args: tuple, kwargs: dict | None) -> tuple[int, dict | None]:
        """A call of selected module `name` begins (eager): its call index, and the producer
        links of its inputs (the "in" records it needs go to the step)."""
        calls = self._calls
        call = calls.get(name, 0)
        calls[name] = call + 1
        if not kwargs and len(args) == 1 and isinstance(args[0], torch.Tensor) \
                and not self.record_inputs and not args[0].is_complex():  # a leaf's usual call
            return call, self._link_one(args[0], name, call)
        src, ins = self.link_inputs(call_slots(args, kwargs), name, call)
        if ins:
            self._pending.extend(ins)
        return call, src

    def _close_call(self, out: Any, name: str, call: int, src: dict | None) -> None:
        """A call opened by `_open_call` returned `out` (not None): its output records."""
        if isinstance(out, torch.Tensor) and not out.is_complex():
            self._pending.append(self._one_output(out, name, call, src))
            return
        slots = flatten(out)
        if len(slots) == 1 and slots[0][0] == "0":  # (attn_output, None)
            self._pending.append(self._one_output(slots[0][1], name, call, src))
        else:
            self._pending.extend(self.outputs(slots, name, call, src))

    def _wrapped_forward(self, name: str, mod: nn.Module):
        """Eager, merged exit: `mod.forward` wrapped to do what the pre-hook `enter_eager` and
        the forward hook `exit_out_eager` of `_make_hook` do, in one Python call (no frame on
        the stack: the call index and links are locals; a forward that raises records
        nothing). Paused when called: nothing is recorded. Returns the wrapper and its switch
        (`[True]`; False: pass straight through)."""
        forward = mod.forward
        open_call, close_call = self._open_call, self._close_call
        live = [True]  # False: left wrapped by someone else after hooks() closed (_ForwardWrap)

        @functools.wraps(forward)
        def recorded_forward(*args, **kwargs):
            if self._pause or not live[0]:
                return forward(*args, **kwargs)
            call, src = open_call(name, args, kwargs)
            out = forward(*args, **kwargs)
            if out is not None:
                close_call(out, name, call, src)
            return out
        return recorded_forward, live

    def _exit_hook(self, name: str):
        """Closes the call's frame (also when forward raises), before the output hooks run."""
        stack, closed = self._stack, self._closed

        def exit_eager(_mod, _args, _out):
            if self._pause:
                return None
            if stack and stack[-1].module == name:  # the usual case: the innermost call
                closed[name] = stack.pop()
                return None
            frame = self.pop_frame(name)
            if frame is not None:
                closed[name] = frame
            return None
        return exit_eager

    def pop_frame(self, name: str) -> Frame | None:
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
        for name in self.modules:  # keys are built as strings at end_step: check names now
            RecordKey(0, 0, name, 0, "out", "0")
        try:
            for tap in (self.taps if self.graph and self.taps is not None else ()):
                mod = by_name[tap.hook]
                self.handles.append(mod.register_forward_pre_hook(self._tap_hook(tap))
                                    if tap.where == "in" else
                                    mod.register_forward_hook(self._tap_hook(tap)))
            for name in (self.modules if not (self.graph and self.taps is not None) else ()):
                mod = by_name[name]
                if not self.graph and self._merged_exit and self._wrap_forward \
                        and _can_wrap(mod):
                    self.handles.append(_ForwardWrap(mod, *self._wrapped_forward(name, mod)))
                    continue
                if self.record_inputs or not self.graph:
                    self.handles.append(mod.register_forward_pre_hook(
                        self._make_hook(name, "in"), with_kwargs=True))
                if self.graph or not self._merged_exit:
                    if not self.graph:
                        self.handles.append(mod.register_forward_hook(
                            self._exit_hook(name), prepend=True, always_call=True))
                    self.handles.append(mod.register_forward_hook(self._make_hook(name, "out")))
                else:
                    self.handles.append(mod.register_forward_hook(
                        self._make_hook(name, "out"), always_call=True))
            yield self
        finally:
            for h in self.handles:
                h.remove()
            self.handles.clear()
            self._pending.clear()
            self._reset_step_state()
            self.stats.compute()  # drop what a failed step left staged

    # -- steps ---------------------------------------------------------------------------
    def _reset_step_state(self) -> None:
        self._stack.clear()
        self._calls.clear()
        self._closed.clear()
        self._producers.clear()

    def begin_step(self, req: int, step: int, *, tokens: int | None = None,
                   record: bool = True) -> None:
        """A forward begins: request `req`, step `step` of `tokens` input positions (for
        --positions last:N; None: not cut). `record=False` (a request or prefill the
        selection leaves out): the forward runs unrecorded and end_step writes nothing."""
        if self._skipping:  # a skipped step that never ended
            self._pause -= 1
        self._skipping = not record
        if not record:
            self._pause += 1
        self._pending.clear()
        self._reset_step_state()
        self._all_stats.compute()  # a step that never ended leaves nothing behind
        self._req, self._step = req, step
        cut = token_cut(tokens, self.last_positions) if tokens is not None else None
        self.stats = _CutStats(self._all_stats, cut) if cut is not None else self._all_stats

    def end_step(self, logits: torch.Tensor | None = None,
                 logit_ids: torch.Tensor | None = None) -> int:
        """Turn what the hooks collected (plus the step's logits; with `logit_ids`, top-k
        log-probabilities and their token ids: store.logits_topk) into records; flush.
        Returns the number of records written."""
        if self._skipping:
            self._skipping = False
            self._pause -= 1
            self._pending.clear()
            self._producers.clear()
            self._all_stats.compute()
            return 0
        items = list(self._pending)
        self._pending.clear()
        self._producers.clear()  # links never cross a step
        if logits is not None:
            items.append(Pending(LOGITS_MODULE, "out", "0", "logits", None, "", (), 0,
                                  tensor=logits.detach()))
            if logit_ids is not None:
                items.append(Pending(LOGITS_MODULE, "out", LOGITS_IDS_SLOT, "logits", None, "",
                                     (), 0, tensor=logit_ids))
        cut = self.stats.cut if isinstance(self.stats, _CutStats) else None
        for p in items:
            t = p.tensor
            if t is not None:  # graph mode / logits: statistics now
                if cut is not None:
                    t = cut(t)
                if p.module in self.keep and not self.full:
                    p.host = to_host(t)[0]
                p.stats = self.stats.add(t)
                p.dtype, p.shape, p.numel = dtype_name(t), tuple(t.shape), t.numel()
                p.tensor = None
        if cut is not None:  # the eager hooks' records: their shapes as cut
            for p in items:
                shape = self.stats.shapes.get(p.stats) if type(p.stats) is int else None
                if shape is not None:
                    p.shape, p.numel = shape, math.prod(shape)
        raw, hosts = self.stats.compute()  # every record of the step, one transfer
        if not items:
            return 0
        final, checksums = self._stat_rows(items, raw, hosts)
        keys, texts = self._keys_texts(items)
        self._write(items, keys, texts, final, checksums)
        return len(items)

    @staticmethod
    def _stat_rows(items: list[Pending], raw: np.ndarray, hosts) -> tuple[np.ndarray, list[int]]:
        """The step's finished statistics rows and checksums, in `items` order (each item's
        `host` set from `hosts` where the stats kernel kept its values)."""
        index = [p.stats for p in items]
        if all(type(s) is int for s in index):
            rows = raw[index]
            if hosts:
                for p, s in zip(items, index):
                    p.host = hosts[s]
        else:  # weights: their row is kept once per capture
            rows = np.empty((len(items), raw.shape[1]))
            for k, (p, s) in enumerate(zip(items, index)):
                if type(s) is int:
                    rows[k] = raw[s]
                    if hosts:
                        p.host = hosts[s]
                else:
                    rows[k] = s
        numel = np.fromiter((p.numel for p in items), dtype=np.float64, count=len(items))
        final = finish_rows(rows, numel)
        for k in np.flatnonzero(rows[:, 4] + rows[:, 5]):  # NaN / Inf: finite-only min..l2
            h = items[k].host
            if h is not None:
                final[k] = finish_stats(rows[k], items[k].numel,
                                        bf16_bits_to_float32(h) if items[k].dtype == "bfloat16"
                                        else h)
        return final, rows[:, 7].astype(np.int64).tolist()

    def _keys_texts(self, items: list[Pending]) -> tuple[list[str], list[str]]:
        """Each item's record key (its call counted here in graph mode) and its attrs JSON (the
        input links to producers earlier in the step, and any extra)."""
        calls: dict[tuple[str, str, str], int] = {}
        sites: dict[Pending, str] = {}  # producers' sites (Pending hashes by identity)
        head = f"r{self._req}.s{self._step}:"
        links_json = self._links_json
        keys: list[str] = []
        texts: list[str] = []
        for p in items:
            call = p.call
            if call is None:  # graph mode: counted here, hooks there must not read Python state
                ck = (p.module, p.role, p.slot)
                call = calls.get(ck, 0)
                calls[ck] = call + 1
            site = f"{p.module}#{call}/{p.op}@{p.op_index}:{p.role}.{p.slot}" \
                if p.op is not None else f"{p.module}#{call}:{p.role}.{p.slot}"
            if p.producer:
                sites[p] = site
            keys.append(head + site)
            extra = p.extra
            if p.src:
                links = tuple((slot, sites[q]) for slot, q in p.src.items() if q in sites)
                if links and extra is None:  # the same links every step: JSON made once
                    text = links_json.get(links)
                    if text is None:
                        text = links_json[links] = _json({"src": dict(links)})
                elif links:
                    text = _json({**extra, "src": dict(links)})
                else:
                    text = _json(extra) if extra else ""
            else:
                text = _json(extra) if extra else ""
            texts.append(text)
        return keys, texts

    def _write(self, items: list[Pending], keys: list[str], texts: list[str],
               final: np.ndarray, checksums: list[int]) -> None:
        """Write the step's records and flush: statistics only in runs of rows (a kept module's
        record with its values), or each record with its tensor (full store)."""
        if not self.full:  # no tensors to write: runs of rows in one call each
            start = 0
            for k in [k for k, p in enumerate(items) if p.host is not None] + [len(items)]:
                if k > start:
                    self.writer.add_rows(keys[start:k], [p.kind for p in items[start:k]],
                                         [p.dtype for p in items[start:k]],
                                         [p.shape for p in items[start:k]], final[start:k],
                                         checksums[start:k], texts[start:k])
                if k < len(items):  # a kept record (self.keep): with its values
                    p = items[k]
                    self.writer.add(keys[k], p.kind, p.dtype, p.shape, final[k], checksums[k],
                                    p.host, texts[k], keep=True)
                start = k + 1
        else:
            add = self.writer.add
            for k, p in enumerate(items):
                add(keys[k], p.kind, p.dtype, p.shape, final[k], checksums[k], p.host, texts[k],
                    share=p.share)
        self.writer.flush()
