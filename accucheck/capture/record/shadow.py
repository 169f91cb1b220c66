"""Shadow replay: re-run each selected module on the reference's recorded inputs, on this device.

Imports torch, accucheck.keys, accucheck.store and the recorder (never h5py directly).

`capture ... --shadow REF.h5` (REF: a `--store full --inputs` capture of the same model and
prompts) makes every selected module call run a second time, right after its real call, on
the inputs REF recorded for the same key (request, step, module, call). The result is stored
under role "shadow" with the slots of the real output. In the diff, REF out vs CAND shadow is
the error the module introduces on this device, free of inherited error. With `--level op`
each recorded operator is shadowed the same way (see accucheck.capture.record.ops).

How a call is rebuilt: the live call's structure (positional args, kwargs, tuples, dicts) is
walked in the recorder's slot order; every tensor leaf is replaced by REF's tensor of the same
slot (cast to the live tensor's dtype and device: a bfloat16 candidate sees the reference's
inputs rounded to bfloat16, as its own kernels would). Non-tensor leaves come from the live
call. What cannot be replayed (documented footguns):

- a call whose tensor input REF did not record (REF without --inputs, or another model);
- stateful arguments (KV-cache objects such as transformers' DynamicCache): at step 0 (the
  prefill) they are replaced by None, which gives the same result as the empty cache the
  prefill starts from and leaves the live cache untouched; at decode steps (step > 0) the
  reference's cache content is not recorded, so calls with such an argument are skipped (their
  count is in the capture's meta under "shadow"). Modules without a cache argument (MLP, norms)
  and all ops (whose cache reads are recorded op inputs) replay at every step;
- mode "graph" (the shadow call runs eagerly; it is refused there).

The user's model is not modified: the shadow call goes through the module's own __call__
(so planted faults apply, as they would on the device), with this recorder's hooks paused.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
from torch import nn

from accucheck.capture.record.links import Frame
from accucheck.capture.record.recorder import Recorder
from accucheck.capture.record.selection import flatten
from accucheck.errors import UserError
from accucheck.keys import clean_slot
from accucheck.store import CaptureReader, CaptureWriter, Selection, open_capture


def _no_dispatch_modes():
    """Statistics and copies run below every Python dispatch mode (op recorder, op faults):
    they are not ops of the model, and the modes' per-op Python overhead is skipped."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


class ShadowSource:
    """A reference capture opened for shadow replay: where its recorded inputs are.

    `module_inputs(req, step, module, call)` -> {slot: key} or None; `op_call(req, step, module,
    call, op, occurrence)` -> (op_index, {slot: key}) or None, where `occurrence` counts the
    calls of `op` inside that module call (so one side fusing other ops shifts nothing);
    `tensor(key, like)` reads a recorded tensor onto `like`'s device and dtype.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        self.reader: CaptureReader = open_capture(path)
        if self.reader.store_mode != "full":
            self.reader.close()
            raise UserError(f"--shadow {path}: it holds statistics only; the reference must be "
                            f"captured with --store full --inputs")
        if (self.reader.meta.get("options") or {}).get("record_inputs") is False:
            # its "in" records are only the inputs no link explains
            # (accucheck.capture.record.recorder)
            self.reader.close()
            raise UserError(f"--shadow {path}: it was captured without --inputs; capture the "
                            f"reference with --store full --inputs")
        if Selection.of(self.reader.meta).positions != "all":
            self.reader.close()
            raise UserError(f"--shadow {path}: it records part of each prefill (--positions); "
                            f"a replay needs whole inputs: capture the reference without it")
        self._mod: dict[tuple, dict[str, str]] = {}
        self._ops: dict[tuple, tuple[int, dict[str, str]]] = {}
        occ: dict[tuple, int] = {}
        seen_op: dict[tuple, tuple] = {}
        for row in self.reader.rows:
            k = row.key
            if k.op is None:
                if k.role == "in" and row.has_data:
                    self._mod.setdefault((k.req, k.step, k.module, k.call), {})[k.slot] = str(k)
                continue
            ident = (k.req, k.step, k.module, k.call, k.op_index)
            if ident not in seen_op:
                base = (k.req, k.step, k.module, k.call, k.op)
                n = occ.get(base, 0)
                occ[base] = n + 1
                seen_op[ident] = base + (n,)
                self._ops[base + (n,)] = (k.op_index, {})
            if k.role == "in" and row.has_data:
                self._ops[seen_op[ident]][1][k.slot] = str(k)
        if not self._mod and not any(s for _, s in self._ops.values()):
            self.reader.close()
            raise UserError(f"--shadow {path}: it has no recorded inputs; capture the reference "
                            f"with --store full --inputs")

    def module_inputs(self, req: int, step: int, module: str, call: int) -> dict[str, str] | None:
        return self._mod.get((req, step, module, call))

    def op_call(self, req: int, step: int, module: str, call: int, op: str,
                occurrence: int) -> tuple[int, dict[str, str]] | None:
        return self._ops.get((req, step, module, call, op, occurrence))

    def tensor(self, key: str, like: torch.Tensor) -> torch.Tensor:
        arr = np.ascontiguousarray(self.reader.read(key))
        t = torch.from_numpy(arr)
        return t.to(device=like.device, dtype=like.dtype)

    def close(self) -> None:
        self.reader.close()


class Unreplayable(Exception):
    """A call that cannot be rebuilt from the reference's records (see module docstring)."""


def rebuild(obj: Any, slot: str, tensor_for: Callable[[str, torch.Tensor], torch.Tensor],
            *, prefill: bool) -> Any:
    """`obj` with every tensor leaf replaced by `tensor_for(slot, live_tensor)`; slots as the
    recorder's `flatten` names them. KV-cache objects become None at the prefill, else raise
    Unreplayable; other non-tensor leaves are kept as they are."""
    if isinstance(obj, torch.Tensor):
        return tensor_for(slot or "0", obj)
    if isinstance(obj, dict):
        return {k: rebuild(v, f"{slot}.{clean_slot(k)}" if slot else clean_slot(k), tensor_for,
                           prefill=prefill) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        items = [rebuild(v, f"{slot}.{i}" if slot else str(i), tensor_for, prefill=prefill)
                 for i, v in enumerate(obj)]
        if isinstance(obj, list):
            return items
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    if _is_cache(obj):
        if prefill:
            return None  # a cache object at the prefill: behaves like the empty cache
        raise Unreplayable(f"stateful argument {type(obj).__name__} at a decode step")
    return obj


def _is_cache(obj: Any) -> bool:
    return any("Cache" in c.__name__ for c in type(obj).__mro__)


def rebuild_call(args: tuple, kwargs: dict, tensor_for, *, prefill: bool) -> tuple[tuple, dict]:
    """Positional args (slots "0", "1", ...) and kwargs (slot = name) of a module call."""
    a = tuple(rebuild(v, str(i), tensor_for, prefill=prefill) for i, v in enumerate(args))
    kw = {k: rebuild(v, clean_slot(k), tensor_for, prefill=prefill)
          for k, v in (kwargs or {}).items()}
    return a, kw


def ref_tensor_lookup(source: ShadowSource, slots: dict[str, str]):
    """A `tensor_for` that serves REF's tensors by slot; a slot REF lacks raises Unreplayable."""
    def tensor_for(slot: str, live: torch.Tensor) -> torch.Tensor:
        key = slots.get(slot)
        if key is None:
            raise Unreplayable(f"input slot {slot} not recorded in the reference")
        t = source.tensor(key, live)
        if tuple(t.shape) != tuple(live.shape):
            raise Unreplayable(f"input slot {slot}: shape {tuple(t.shape)} in the reference, "
                               f"{tuple(live.shape)} here")
        return t
    return tensor_for


class ShadowRecorder(Recorder):
    """Recorder that also tracks the call stack down to every nn.Module inside the selected
    ones and, with `shadow`, replays each selected module call on the reference's recorded
    inputs (role "shadow").

    The stack holds a frame per open call of a selected module and of every descendant of one
    (an unselected descendant only gets tracking hooks: a call counter per step, no record), so
    the op recorder can attribute an op to its innermost nn.Module. Hooks of the base recorder
    are paused while a shadow call runs, so a replay records nothing but its own shadow output.
    `shadow_counts` says how many calls were replayed / skipped.
    """

    _merged_exit = False  # ops are attributed to the innermost open call: close it first

    def __init__(self, model: nn.Module, writer: CaptureWriter, modules: Sequence[str], *,
                 record_inputs: bool = False, graph: bool = False,
                 shadow: ShadowSource | None = None, keep: Sequence[str] = (),
                 last_positions: int | None = None):
        super().__init__(model, writer, modules, record_inputs=record_inputs, graph=graph,
                         keep=keep, last_positions=last_positions)
        if graph:
            raise UserError("--shadow and --level op need --mode eager (the replay and the op "
                            "attribution run module by module)")
        self.shadow = shadow
        self.shadow_counts = {"replayed": 0, "skipped": 0, "skipped_why": {}}

    def _make_hook(self, name: str, role: str):
        inner = super()._make_hook(name, role)

        def hook(*args):
            if self._pause:
                return None
            if not torch._C._len_torch_dispatch_stack():
                return inner(*args)
            with _no_dispatch_modes():  # its statistics are not ops of the model
                return inner(*args)
        return hook

    # -- call stack ----------------------------------------------------------------------
    def _enter(self, name: str):
        """Tracking pre-hook of an unselected descendant: a frame, counted, no record."""
        def pre(_mod, _args):
            if self._pause or not self._stack:  # only inside a selected module call
                return None
            n = self._calls.get(name, 0)
            self._calls[name] = n + 1
            self._stack.append(Frame(name, n))
            return None
        return pre

    def _exit(self, name: str):
        def post(_mod, _args, _out):
            if not self._pause:
                self.pop_frame(name)
            return None
        return post

    def _shadow_hook(self, name: str):
        def hook(mod, args, kwargs, output):
            if self._pause or self.shadow is None:
                return None
            frame = self._closed.get(name)
            self._shadow_module(mod, name, frame.call if frame else 0, args, kwargs)
            return None
        return hook

    def _skip(self, why: str) -> None:
        c = self.shadow_counts
        c["skipped"] += 1
        c["skipped_why"][why] = c["skipped_why"].get(why, 0) + 1

    def _shadow_module(self, mod: nn.Module, name: str, call: int, args, kwargs) -> None:
        slots = self.shadow.module_inputs(self._req, self._step, name, call)
        if slots is None:
            self._skip("module call without recorded inputs in the reference")
            return
        try:
            a, kw = rebuild_call(args, kwargs, ref_tensor_lookup(self.shadow, slots),
                                 prefill=self._step == 0)
        except Unreplayable as e:
            self._skip(str(e).split(":")[0])
            return
        with self.paused():
            out = mod(*a, **kw)
        self.shadow_counts["replayed"] += 1
        for slot, t in flatten(out):
            self._pending.append(self.item(name, "shadow", slot, t, call))

    # -- hooks ---------------------------------------------------------------------------
    @contextmanager
    def hooks(self) -> Iterator["ShadowRecorder"]:
        by_name = dict(self.model.named_modules())
        with super().hooks():
            extra = []
            try:
                selected = set(self.modules)
                tracked: set[str] = set()
                for name in self.modules:
                    for sub, _ in by_name[name].named_modules(prefix=name):
                        if sub not in selected and sub not in tracked:
                            tracked.add(sub)
                            m = by_name.get(sub)
                            if m is None:  # a shared submodule named under another path
                                continue
                            extra.append(m.register_forward_pre_hook(self._enter(sub)))
                            extra.append(m.register_forward_hook(self._exit(sub),
                                                                 always_call=True))
                    if self.shadow is not None:
                        extra.append(by_name[name].register_forward_hook(
                            self._shadow_hook(name), with_kwargs=True))
                self.handles.extend(extra)
                yield self
            finally:
                for h in extra:
                    h.remove()
                self._stack.clear()
