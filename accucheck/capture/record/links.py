"""Producer links (eager mode): which recorded tensor a module call's input is.

Imports torch and numpy. Used by accucheck.capture.record.recorder (and its op / shadow subclasses),
whose records (`Pending`) and open calls (`Frame`) are defined here.

Every recorded tensor is remembered for the rest of the step by
its storage identity, `(untyped_storage().data_ptr(), _version)`, with a weak reference to the
storage (a freed storage never matches, even when a new tensor reuses its address; nothing is
kept alive). When a selected module is called, each floating-point tensor input is looked up:

- it IS a recorded tensor (or a view of one): the link `slot -> producer site` is stored in the
  /index/extra JSON of the call's first output record, `{"src": {"0": "model.layers.0#0:out.0",
  "position_embeddings.0": "model.rotary_emb#0:out.0"}}` (a site is `RecordKey.site`: the key
  without request and step; the producer is in the same request and step). When one tensor was
  recorded several times (o_proj's output is also self_attn's output), the last record wins:
  the outermost module that returned it;
- it is a parameter or buffer of the model: not linked, and recorded only with `--inputs`
  (its statistics and values once per capture, accucheck.capture.record.recorder);
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
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(eq=False, slots=True)
class Pending:
    """One record of the current step, until `end_step` writes it."""
    module: str
    role: str
    slot: str
    kind: str
    # statistics: a row number of the step's StepStats, or the raw row itself (a weight's,
    # computed once per capture); None while `tensor` (graph mode, logits) awaits end_step
    stats: int | np.ndarray | None
    dtype: str
    shape: tuple[int, ...]
    numel: int
    # op-level records (accucheck.capture.record.ops), shadow replays and eager module records carry
    # their own key parts
    op: str | None = None
    op_index: int | None = None
    call: int | None = None
    extra: dict | None = None  # JSON object for /index/extra (op call details, "weight")
    tensor: torch.Tensor | None = None  # graph mode: the clone; logits
    host: np.ndarray | None = None  # full mode: the values (a weight's: cached)
    src: dict | None = None    # input slot -> producer Pending (links, see module docstring)
    producer: bool = False     # some link may point here: its site is needed at end_step
    share: str | None = None   # full mode: records of the same tensor share one dataset


@dataclass(eq=False, slots=True)
class Frame:
    """One open module call: its call index and, for a selected module, the input links."""
    module: str
    call: int
    src: dict | None = None
    n_ops: int = 0
    occurrence: dict | None = None  # op level: calls of each op in this module call


def identity(t: torch.Tensor):
    """(storage address, version, storage) of `t`; None when it cannot be told apart reliably
    (inference tensors have no version counter; an empty storage has no address)."""
    if t.is_inference():
        return None
    try:
        st = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # tensor subclasses without a storage
        return None
    ptr = st.data_ptr()
    return (ptr, t._version, st) if ptr else None


def plain_storage(t: torch.Tensor):
    """`t`'s untyped storage when `t` is a floating-point tensor `identity` can tell apart
    (not an inference tensor, has a storage); else None (the caller takes the general path,
    which also handles an empty storage, complex and integer tensors)."""
    if not t.is_floating_point() or t.is_inference():
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # tensor subclasses without a storage
        return None


def view_of(t: torch.Tensor) -> tuple:
    return (t.storage_offset(), t.shape, t.stride(), t.dtype)


weak_expired = torch.UntypedStorage._expired
weak_free = torch.UntypedStorage._free_weak_ref


class Producers:
    """Recorded tensors of the current step by storage identity (see the module docstring).

    Entries hold a weak reference to the storage (the raw one StorageWeakRef wraps: created
    with `_weak_ref()`, freed here, in `clear` or when an entry is replaced), never the tensor:
    an expired one (its storage freed, maybe reused by a new tensor at the same address) never
    matches. Among live entries of one storage, the one with the same view (offset, shape,
    strides, dtype) wins, else the latest. `ident` arguments are `identity(t)`.
    """

    def __init__(self) -> None:
        self.by_id: dict[tuple[int, int], list[tuple]] = {}

    def clear(self) -> None:
        for entries in self.by_id.values():
            for e in entries:
                weak_free(e[0])
        self.by_id.clear()

    def _live(self, ident) -> list | None:
        key = (ident[0], ident[1])
        entries = self.by_id.get(key)
        if entries is None:
            return None
        if len(entries) == 1:
            if weak_expired(entries[0][0]):
                weak_free(entries[0][0])
                del self.by_id[key]
                return None
            return entries
        live = []
        for e in entries:
            if weak_expired(e[0]):
                weak_free(e[0])
            else:
                live.append(e)
        if len(live) != len(entries):
            entries[:] = live
        return live or None

    def add(self, t: torch.Tensor, p: Pending, ident=None, view: tuple | None = None) -> None:
        ident = ident or identity(t)
        if ident is None:
            return
        view = view or view_of(t)
        key = (ident[0], ident[1])
        e = (ident[2]._weak_ref(), view, p)
        entries = self.by_id.get(key)
        if entries is None:
            self.by_id[key] = [e]
        else:
            keep = []
            for x in entries:
                if x[1] == view or weak_expired(x[0]):
                    weak_free(x[0])
                else:
                    keep.append(x)
            keep.append(e)
            entries[:] = keep
        p.producer = True

    def find(self, t: torch.Tensor, ident=None, view: tuple | None = None) -> Pending | None:
        """The record `t` is (or is a view of), if any."""
        return self._match(t, ident or identity(t), view, exact=False)

    def same(self, t: torch.Tensor, ident, view: tuple | None = None) -> Pending | None:
        """The record of exactly this tensor (storage, version, view, dtype), if any: the same
        values, so the same statistics (and, in full mode, the same dataset)."""
        return self._match(t, ident, view, exact=True)

    def _match(self, t, ident, view, exact: bool) -> Pending | None:
        """The latest live record of `t`'s storage and version with `t`'s view; else, unless
        `exact`, the latest one of any view."""
        live = self._live(ident) if ident is not None else None
        if live is None:
            return None
        view = view or view_of(t)
        for e in reversed(live):
            if e[1] == view:
                return e[2]
        return None if exact else live[-1][2]
