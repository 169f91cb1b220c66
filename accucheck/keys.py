"""Record keys: the one place keys are built and parsed. Imports only accucheck.errors.

A record key names one captured tensor so that the same tensor can be found in a capture made
on another device, in another mode, by another runner or by another release:

    r{req}.s{step}:{module}#{call}:{role}.{slot}                      module / logits record
    r{req}.s{step}:{module}#{call}/{op}@{op_index}:{role}.{slot}      op record

- req: index of the prompt (request) in the capture's prompt list.
- step: 0 is the prefill, 1..N are decode steps (one new token each, KV cache in use).
- module: the path from `named_modules()` ("model.layers.3.mlp"); "logits" for the
  full-vocabulary logits of the step.
- call: how many times this module had already been called in this request and step.
- role: "in" (an input), "out" (an output) or "shadow" (the output recomputed on the
  reference's recorded inputs, see shadow replay).
- slot: where the tensor sits inside the input/output structure: "0", "1.0", "hidden_states".
- op, op_index: for op-level records, the operator ("aten.mul.Tensor") and its index among the
  ops dispatched inside that module call.

Keys never depend on a global counter, so one side fusing kernels does not shift the other
side's keys.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from accucheck.errors import UserError

ROLES = ("in", "out", "shadow")
LOGITS_MODULE = "logits"
_SLOT_OK = re.compile(r"[^A-Za-z0-9_.\-]")
_KEY_RE = re.compile(
    r"^r(?P<req>\d+)\.s(?P<step>\d+):(?P<module>[^:#/@]+)#(?P<call>\d+)"
    r"(?:/(?P<op>[^:#/@]+)@(?P<op_index>\d+))?:(?P<role>in|out|shadow)\.(?P<slot>.+)$"
)


def clean_slot(part: object) -> str:
    """Turn a structure position (tuple index, dict key) into a slot component."""
    return _SLOT_OK.sub("_", str(part)) or "_"


@dataclass(frozen=True)
class RecordKey:
    req: int
    step: int
    module: str
    call: int
    role: str
    slot: str
    op: str | None = None
    op_index: int | None = None

    def __post_init__(self) -> None:
        if self.req < 0 or self.step < 0 or self.call < 0:
            raise ValueError(f"negative index in record key {self!r}")
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if not self.module or any(c in self.module for c in ":#/@"):
            raise ValueError(f"bad module path {self.module!r}")
        if (self.op is None) != (self.op_index is None):
            raise ValueError("op and op_index go together")
        if not self.slot:
            raise ValueError("empty slot")

    @property
    def is_op(self) -> bool:
        return self.op is not None

    @property
    def is_logits(self) -> bool:
        return self.module == LOGITS_MODULE

    @property
    def site(self) -> str:
        """The record without its request and step: the same site in every step."""
        return str(self).split(":", 1)[1]

    def with_role(self, role: str) -> "RecordKey":
        return RecordKey(self.req, self.step, self.module, self.call, role, self.slot,
                         self.op, self.op_index)

    def __str__(self) -> str:
        op = f"/{self.op}@{self.op_index}" if self.op is not None else ""
        return f"r{self.req}.s{self.step}:{self.module}#{self.call}{op}:{self.role}.{self.slot}"

    @classmethod
    def parse(cls, text: str) -> "RecordKey":
        m = _KEY_RE.match(text)
        if not m:
            raise UserError(f"not a record key: {text!r} (expected r0.s0:model.layers.0#0:out.0)")
        op_index = m.group("op_index")
        return cls(int(m.group("req")), int(m.group("step")), m.group("module"),
                   int(m.group("call")), m.group("role"), m.group("slot"), m.group("op"),
                   int(op_index) if op_index is not None else None)


RANK_SLOT = ".rank"  # slot suffix of one tensor-parallel rank's copy / shard: "0.rank1"
_RANK_RE = re.compile(r"^(?P<slot>.+)\.rank(?P<rank>\d+)$")


def rank_slot(slot: str, rank: int) -> str:
    """The slot of `rank`'s own copy of the tensor at `slot` (accucheck.capture.record.ranks)."""
    return f"{slot}{RANK_SLOT}{rank}"


def split_rank(slot: str) -> tuple[str, int | None]:
    """("0", 1) for "0.rank1"; (slot, None) for a slot that names no rank."""
    m = _RANK_RE.match(slot)
    return (m.group("slot"), int(m.group("rank"))) if m else (slot, None)


_LAYER_BLOCK = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks|block)\.\d+$")


def is_layer_block(module: str) -> bool:
    """A decoder-layer container ("model.layers.3"), not one of its submodules."""
    return bool(_LAYER_BLOCK.search(module))


def layer_of(module: str) -> int | None:
    """Decoder-layer number of a module path ("model.layers.10.mlp" -> 10), None outside layers."""
    m = re.search(r"(?:^|\.)(?:layers|layer|h|blocks|block)\.(\d+)(?:\.|$)", module)
    return int(m.group(1)) if m else None


def layer_kind(module: str) -> tuple[int | None, str]:
    """(decoder-layer number, the module's kind inside its layer): "model.layers.10.self_attn.
    q_proj" -> (10, "self_attn.q_proj"), the layer block itself -> (10, ""), numbered parts
    below the layer wildcarded ("mlp.experts.*.down_proj"); (None, module) outside layers."""
    m = re.search(r"(?:^|\.)(?:layers|layer|h|blocks|block)\.(\d+)(?:\.|$)", module)
    if not m:
        return None, module
    return int(m.group(1)), _INDEX.sub(".*", "." + module[m.end():])[1:]


_INDEX = re.compile(r"\.\d+(?=\.|$)")


def peer_kind(key: RecordKey) -> str:
    """The site with every numeric path component wildcarded ("model.layers.*.mlp.down_proj
    #0:out.0"): records of one module kind, operator and slot across layers (and experts)."""
    op = f"/{key.op}@{key.op_index}" if key.op is not None else ""
    return f"{_INDEX.sub('.*', key.module)}#{key.call}{op}:{key.role}.{key.slot}"
