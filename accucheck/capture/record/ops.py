"""Op-level capture: every operator dispatched inside the selected modules, attributed to its
innermost nn.Module call. Imports torch and the capture recorders (never h5py directly).

`--level op` records, for each operator call that runs inside a selected module:

    r{req}.s{step}:{module}#{call}/{op}@{op_index}:out.{slot}   its outputs
    r{req}.s{step}:{module}#{call}/{op}@{op_index}:in.{slot}    inputs no link explains (below),
                                                                every tensor input with --inputs
    r{req}.s{step}:{module}#{call}/{op}@{op_index}:shadow.{slot}  with --shadow REF.h5

`module` is the innermost nn.Module whose call is running, selected or not: with
`--include 'model.layers.3.mlp'` the matmuls are `model.layers.3.mlp.down_proj#0/aten.mm...`
(every descendant of a selected module gets tracking hooks: a per-step call counter, no
record of its own), so an op is named at its leaf on every device. `op` is the dispatched
overload as torch names it ("aten.mm.default", "aten._softmax.default", torch_npu's
"npu.npu_rms_norm.default", a vLLM custom op "_C.rms_norm.default"): anything that reaches the
dispatcher, custom ops included. `op_index` counts the RECORDED ops of that module call, in
order. Input slots: positional argument i is "i", a keyword argument is its name, list elements
add ".j" ("0.1" = second tensor of a cat's list). The first output record of each op call
carries in /index/extra: {"site": "<file>:<line> in <function>" (the innermost Python frame
outside torch and accucheck), "args": [...], "kwargs": {...}, "src": {...}} with tensors as
{"t": slot} and dtypes / devices / layouts as {"dtype": "float32"}, ...: enough to call the op
again (`accucheck replay`). "src" (absent when empty) links input slots to the records that
hold those tensors, as module records do (accucheck.capture.record.recorder); the MLP's product
`model.layers.0.mlp#0/aten.mul.Tensor@0` has {"0": "model.layers.0.mlp.act_fn#0:out.0",
"1": "model.layers.0.mlp.up_proj#0:out.0"} (a module's output record is registered after the
ops inside it: the outermost record of a tensor is its producer). A floating-point input that
is neither linked nor a weight is recorded as an "in" record of the op (a copy made by an
unrecorded clone / contiguous, a tensor from outside the selection).

Not recorded, so views and metadata do not flood the file: view ops (func.is_view: view,
transpose, slice, expand, ...), pure copies and allocations (clone, copy_, detach, _unsafe_view,
empty / zeros / full factories, fill_), ops with no floating-point tensor input and ops with no
floating-point tensor output (masks, argmax, index arithmetic). Dtype casts (_to_copy) ARE
recorded: a cast to bfloat16 is where precision is lost.

Footguns: op level needs mode eager (a compiled graph does not dispatch ops one by one); it costs
one statistics pass per op output (and input with --inputs) - see bench/bench_ops.py. A weight
that enters an op (mm's transposed weight, the embedding table) is an "in" record of every call
with --inputs, but its values and statistics are taken once per capture: all its records name it
(/index/extra {"weight": "model.layers.0.mlp.up_proj.weight"}) and share one dataset.
"""
from __future__ import annotations

import math
import os
import sys
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from accucheck.capture.record.selection import flatten
from accucheck.capture.record.shadow import (ShadowRecorder, ShadowSource, Unreplayable,
                                             _no_dispatch_modes, ref_tensor_lookup)
from accucheck.errors import UserError
from accucheck.keys import clean_slot
from accucheck.store import CaptureWriter

SKIP_OPS = frozenset({
    "aten.clone", "aten.copy_", "aten.copy", "aten.detach", "aten.detach_", "aten.lift_fresh",
    "aten.lift_fresh_copy", "aten._unsafe_view", "aten.alias", "aten.contiguous",
    "aten.empty_like", "aten.zeros_like", "aten.ones_like", "aten.full_like", "aten.new_empty",
    "aten.new_empty_strided", "aten.new_zeros", "aten.new_ones", "aten.new_full", "aten.fill_",
    "aten.zero_", "aten.empty_strided", "aten.empty", "aten.set_", "aten.resize_",
    "aten._local_scalar_dense", "aten.item", "aten.is_nonzero", "aten.size", "aten.stride",
    "aten.sym_size", "aten.sym_stride", "aten.sym_numel", "aten.dim", "aten.is_contiguous",
    "aten.is_same_size", "aten._has_compatible_shallow_copy_type", "aten.record_stream",
})
_OWN_DIRS = (os.path.dirname(torch.__file__) + os.sep,
             os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep)


def op_name(func: Any) -> str:
    """"aten.mm.default": namespace, operator, overload."""
    return str(func)


def op_packet(name: str) -> str:
    """"aten.mm.default" -> "aten.mm" (the operator without its overload)."""
    return name.rsplit(".", 1)[0] if name.count(".") >= 2 else name


def skipped(func: Any) -> bool:
    """True for views, copies, allocations and metadata ops (see the module docstring)."""
    if getattr(func, "is_view", False):
        return True
    return op_packet(op_name(func)) in SKIP_OPS


def _float_tensors(obj: Any) -> bool:
    if isinstance(obj, torch.Tensor):
        return obj.is_floating_point() or obj.is_complex()
    if isinstance(obj, (tuple, list)):
        return any(_float_tensors(v) for v in obj)
    if isinstance(obj, dict):
        return any(_float_tensors(v) for v in obj.values())
    return False


def call_site(depth: int = 2) -> str:
    """The innermost Python frame outside torch and accucheck: "pkg/file.py:123 in fn"."""
    f = sys._getframe(depth)
    while f is not None and f.f_code.co_filename.startswith(_OWN_DIRS):
        f = f.f_back
    if f is None:
        return "?"
    path = f.f_code.co_filename
    i = path.rfind("site-packages" + os.sep)
    short = path[i + 14:] if i >= 0 else os.sep.join(path.split(os.sep)[-3:])
    return f"{short}:{f.f_lineno} in {f.f_code.co_name}"


def encode_args(obj: Any, slot: str) -> Any:
    """JSON description of an op argument; tensors become {"t": slot}."""
    if isinstance(obj, torch.Tensor):
        return {"t": slot}
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else {"float": repr(obj)}
    if isinstance(obj, (tuple, list)):
        return [encode_args(v, f"{slot}.{i}") for i, v in enumerate(obj)]
    if isinstance(obj, torch.dtype):
        return {"dtype": str(obj).replace("torch.", "")}
    if isinstance(obj, torch.device):
        return {"device": str(obj)}
    if isinstance(obj, torch.layout):
        return {"layout": str(obj).replace("torch.", "")}
    if isinstance(obj, torch.memory_format):
        return {"memory_format": str(obj).replace("torch.", "")}
    return {"repr": repr(obj)[:120]}


def arg_slots(args: tuple, kwargs: dict) -> list[tuple[str, torch.Tensor]]:
    """Tensor inputs of an op with their slots (positional "i", keyword name, list ".j")."""
    out = []
    for i, a in enumerate(args):
        out.extend(flatten(a, str(i)))
    for k, v in kwargs.items():
        out.extend(flatten(v, clean_slot(k)))
    return out


def call_info(args: tuple, kwargs: dict, site: str) -> dict:
    """The /index/extra object of an op call's first output record (the recorder adds the
    input links under "src")."""
    return {
        "site": site,
        "args": [encode_args(a, str(i)) for i, a in enumerate(args)],
        "kwargs": {k: encode_args(v, clean_slot(k)) for k, v in kwargs.items()},
    }


def _rebuild_op_args(obj: Any, slot: str, tensor_for) -> Any:
    if isinstance(obj, torch.Tensor):
        return tensor_for(slot, obj)
    if isinstance(obj, (tuple, list)):
        items = [_rebuild_op_args(v, f"{slot}.{i}", tensor_for) for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else tuple(items)
    return obj


class _OpMode(TorchDispatchMode):
    """Sees every dispatched op while active; records those inside a selected module call."""

    def __init__(self, rec: "OpRecorder"):
        super().__init__()
        self.rec = rec

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        rec = self.rec
        if rec._pause or not rec._stack or skipped(func) or not _float_tensors((args, kwargs)):
            return func(*args, **kwargs)
        return rec.record_op(func, args, kwargs)


class OpRecorder(ShadowRecorder):
    """Module-level recorder plus every op inside the selected modules (see module docstring).
    Op records are interleaved with module records in execution order: a module call's ops come
    before its output record, a child's records before its parent's."""

    def __init__(self, model: nn.Module, writer: CaptureWriter, modules: Sequence[str], *,
                 record_inputs: bool = False, graph: bool = False,
                 shadow: ShadowSource | None = None, keep: Sequence[str] = (),
                 last_positions: int | None = None):
        if graph:
            raise UserError("--level op needs --mode eager: a compiled graph does not dispatch "
                            "operators one by one; capture graph mode at --level module")
        super().__init__(model, writer, modules, record_inputs=record_inputs, graph=False,
                         shadow=shadow, keep=keep, last_positions=last_positions)
        self.n_ops = 0

    def record_op(self, func, args: tuple, kwargs: dict):
        frame = self._stack[-1]
        name = op_name(func)
        # before the call: in-place ops overwrite their inputs
        with self.paused(), _no_dispatch_modes():
            src, ins = self.link_inputs(arg_slots(args, kwargs), frame.module, frame.call,
                                        op=name, kind="op")
        out = func(*args, **kwargs)
        outs = flatten(out)
        if not any(t.is_floating_point() or t.is_complex() for _, t in outs):
            return out
        idx = frame.n_ops
        frame.n_ops += 1
        if frame.occurrence is None:
            frame.occurrence = {}
        occ = frame.occurrence.get(name, 0)
        frame.occurrence[name] = occ + 1
        self.n_ops += 1
        for p in ins:
            p.op_index = idx
        self._pending.extend(ins)
        with self.paused(), _no_dispatch_modes():
            self._pending.extend(self.outputs(outs, frame.module, frame.call, src, name, idx,
                                              call_info(args, kwargs, call_site(3)), kind="op"))
        if self.shadow is not None:
            self._shadow_op(func, name, occ, frame, args, kwargs)
        return out

    def _shadow_op(self, func, name: str, occ: int, frame, args: tuple, kwargs: dict) -> None:
        hit = self.shadow.op_call(self._req, self._step, frame.module, frame.call, name, occ)
        if hit is None:
            self._skip("op call without recorded inputs in the reference")
            return
        ref_index, slots = hit
        lookup = ref_tensor_lookup(self.shadow, slots)
        try:
            a = tuple(_rebuild_op_args(v, str(i), lookup) for i, v in enumerate(args))
            kw = {k: _rebuild_op_args(v, clean_slot(k), lookup) for k, v in kwargs.items()}
        except Unreplayable as e:
            self._skip(str(e).split(":")[0])
            return
        out = func(*a, **kw)
        self.shadow_counts["replayed"] += 1
        for slot, t in flatten(out):
            self._pending.append(self.item(frame.module, "shadow", slot, t, frame.call, name,
                                           ref_index, kind="op"))

    @contextmanager
    def hooks(self) -> Iterator["OpRecorder"]:
        with super().hooks():
            with _OpMode(self):
                yield self
