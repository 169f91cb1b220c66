"""The culprit: which module and which operator inside it introduce the divergence, with
evidence. Imports keys, diff, opmatch (and locate's types); never torch.

`find_culprit(analysis)` -> `Culprit | None` (None when every record is within tolerance):

1. The module: with shadow records (capture --shadow), the first module record in execution
   order whose LOCAL error (reference out vs candidate shadow: the module run on the reference's
   inputs) exceeds its tolerance; otherwise the module of locate's first divergence.
2. The op: among the op records of that module call (and of its recorded submodules, same
   request and step), the one with the largest local error: its shadow error when shadow records
   exist, else the error it adds over its input error (exact with op inputs recorded, a proxy
   otherwise, see accucheck.locate).
3. Evidence: output error, local error and its basis ("shadow" | "inputs" | "proxy"), inherited
   (input) error, amplification = error / inherited, the golden label when a golden capture was
   given, and the Python call site of the op on both sides (from the capture's op records).

A culprit whose local error is below tolerance while its output error is above is reported
with `local_within` True: the error is inherited, nobody here introduces it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from accucheck.diff import RecordDiff
from accucheck.keys import RecordKey
from accucheck.opmatch import op_ident

if TYPE_CHECKING:
    from accucheck.locate import Analysis, RecordLocation


@dataclass(frozen=True)
class Culprit:
    req: int
    step: int
    module: str
    call: int
    module_error: float | None        # the module output's rel_l2 (None: not recorded)
    module_local: float | None        # its shadow rel_l2 (None: no shadow record)
    op: str | None                    # "aten.silu.default"; None when no op record there
    op_key: RecordKey | None          # reference key of the op's output
    cand_key: RecordKey | None        # candidate key when alignment paired another index / op
    error: float                      # rel_l2 of the named record (op, else module)
    local_error: float | None
    local_basis: str                  # "shadow" | "inputs" | "proxy" | "none"
    inherited_error: float | None
    tolerance: float
    golden: str | None                # golden label of the named record
    site_ref: str | None
    site_cand: str | None
    ops_compared: int                 # aligned op records of that module call
    ops_one_sided: int                # op calls of that module call on one side only

    @property
    def amplification(self) -> float:
        if not self.inherited_error:
            return math.inf if self.error > 0 else 1.0
        return self.error / self.inherited_error

    @property
    def local_within(self) -> bool:
        return self.local_error is not None and self.local_error <= self.tolerance

    @property
    def where(self) -> str:
        op = f" / {self.op}@{self.op_key.op_index}" if self.op_key is not None else ""
        return f"{self.module}#{self.call}{op}"

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["op_key"] = str(self.op_key) if self.op_key is not None else None
        d["cand_key"] = str(self.cand_key) if self.cand_key is not None else None
        d["amplification"] = self.amplification
        d["local_within"] = self.local_within
        return d


def _local(r: RecordDiff, loc: "RecordLocation") -> tuple[float, str]:
    if r.shadow is not None:
        return r.shadow.rel_l2, "shadow"
    if loc.input_error is None:
        return r.error, "none"
    basis = "inputs" if loc.input_from and all(":in." in s for s in loc.input_from) else "proxy"
    return loc.introduced, basis


def find_culprit(a: "Analysis") -> Culprit | None:
    d, L = a.diff, a.location
    locs = {str(x.key): x for x in L.records}
    recs = sorted((r for r in d.records if r.key.role != "in"),
                  key=lambda r: (r.key.step, r.key.req, r.order))
    if d.within and not d.failed:
        return None
    target: RecordDiff | None = None
    shadowed = [r for r in recs if r.key.op is None and r.shadow is not None]
    if shadowed:
        target = next((r for r in shadowed if r.shadow.rel_l2 > r.tolerance.rel_l2), None)
    if target is None:
        fd = L.first_divergence
        if fd is None:
            return None
        target = d.record(fd.key)
    k = target.key
    req, step, module, call = k.req, k.step, k.module, k.call
    mod_rec = target if k.op is None else next(
        (r for r in recs if r.key.op is None and r.key.role == "out" and r.key.req == req
         and r.key.step == step and r.key.module == module and r.key.call == call), None)
    ops = [r for r in recs if r.key.op is not None and r.key.role == "out"
           and r.key.req == req and r.key.step == step
           and ((r.key.module == module and r.key.call == call)
                or r.key.module.startswith(module + "."))]
    named = mod_rec if mod_rec is not None else target
    if ops:
        named = max(ops, key=lambda r: (_local(r, locs[str(r.key)])[0], -r.order))
    loc = locs[str(named.key)]
    local, basis = _local(named, loc)
    one = 0
    site_ref = site_cand = None
    prefix = f"r{req}.s{step}:{module}#{call}/"
    if d.ops is not None:
        one = sum(o.ident.startswith(prefix) for o in d.ops.one_sided)
        if named.key.op is not None:
            site_ref = d.ops.site("ref", op_ident(named.key))
            site_cand = d.ops.site("cand", op_ident(named.cand_key or named.key))
    return Culprit(
        req, step, module, call,
        mod_rec.error if mod_rec is not None else None,
        mod_rec.shadow.rel_l2 if mod_rec is not None and mod_rec.shadow is not None else None,
        named.key.op, named.key if named.key.op is not None else None, named.cand_key,
        named.error, local, basis, loc.input_error, named.tolerance.rel_l2,
        named.golden.label if named.golden is not None else None, site_ref, site_cand,
        len(ops), one)


def culprit_lines(c: Culprit) -> list[str]:
    """Plain-text lines for reports: where, how much, evidence, where in the code."""
    def g(x: float | None) -> str:
        if x is None:
            return "-"
        if math.isinf(x):
            return "inf"
        return "0" if x == 0 else (f"{x:.3g}" if 1e-3 <= abs(x) < 1e4 else f"{x:.2e}")

    head = (f"CULPRIT: step {c.step}, " + (f"request {c.req}, " if c.req else "") + c.where)
    lines = [head]
    if c.op is not None:
        lines.append(f"  op output rel_l2 {g(c.error)}; local {g(c.local_error)} "
                     f"({c.local_basis}); inherited {g(c.inherited_error)}; amplification "
                     f"{g(c.amplification)}; tolerance {g(c.tolerance)}"
                     + (" -> error inherited, not introduced here" if c.local_within else ""))
    if c.module_error is not None:
        lines.append(f"  module output rel_l2 {g(c.module_error)}"
                     + (f"; module local (shadow) {g(c.module_local)}"
                        if c.module_local is not None else ""))
    if c.golden:
        lines.append(f"  golden referee: {c.golden}")
    if c.site_ref or c.site_cand:
        same = c.site_ref == c.site_cand
        lines.append(f"  call site: {c.site_ref or c.site_cand}" if same or not c.site_cand
                     else f"  call site: ref {c.site_ref or '-'} | cand {c.site_cand}")
    if c.cand_key is not None:
        lines.append(f"  candidate op: {c.cand_key} (aligned across fused / shifted ops)")
    if c.ops_one_sided:
        lines.append(f"  {c.ops_one_sided} op calls in this module on one side only "
                     f"(fused / absent)")
    return lines
