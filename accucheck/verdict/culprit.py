"""The culprit: which module and which operator inside it introduce the divergence, with
evidence. Imports keys, compare (diff, opmatch) and verdict.types (not locate); never torch.

`find_culprit(analysis)` -> `Culprit | None`. It is locate's first divergence, never another
pick, so the headline, this block, the JSON and the sign-off report name the same thing:

1. The record: the first record in execution order that is over tolerance and introduced
   (accucheck.verdict.locate). With op records it is the root operator: the first op inside the
   module call whose local error exceeds its tolerance, not the op with the largest error.
   None when nothing introduces a divergence (within tolerance, or diffuse / inherited).
2. Evidence: output error, local error and its basis ("shadow" | "links" | "inputs" |
   "proxy" | "none"), inherited (input) error, amplification = error / inherited, the golden
   label when a golden capture was given, the Python call site of the op on both sides, a
   precision finding when the two sides hold the record in different dtypes while the runs
   share one ("candidate computes aten._softmax.default in float16, reference in float32"),
   and the ops next to it that run on one side only (a cast the reference does not do), with
   their call sites.
3. Next step: a module culprit without op records inside gets the narrowing command (capture
   that module at --level op, with --shadow on the candidate's machine).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from accucheck.compare.results import RecordDiff
from accucheck.compare.opmatch import op_ident
from accucheck.compare.routing import flip_line
from accucheck.keys import RecordKey, split_rank
from accucheck.verdict.types import Located, RecordLocation


@dataclass(frozen=True)
class Culprit:
    req: int
    step: int
    module: str
    call: int
    module_error: float | None        # the module output's rel_l2 (None: not recorded)
    module_local: float | None        # its shadow rel_l2 (None: no shadow record)
    op: str | None                    # "aten.silu.default"; None when not an op record
    op_key: RecordKey | None          # reference key of the op's output
    cand_key: RecordKey | None        # candidate key when alignment paired another index / op
    error: float                      # rel_l2 of the named record (op, else module)
    local_error: float | None
    local_basis: str                  # "shadow" | "links" | "inputs" | "proxy" | "none"
    inherited_error: float | None
    tolerance: float
    golden: str | None                # golden label of the named record
    site_ref: str | None
    site_cand: str | None
    ops_compared: int                 # aligned op records of that module call
    ops_one_sided: int                # op calls of that module call on one side only
    precision: str | None = None      # precision finding on the named record, if any
    neighbours: tuple[str, ...] = ()  # one-sided ops right next to the named op (with sites)
    next_step: str | None = None      # the narrowing command for a module culprit
    rank: int | None = None           # tensor-parallel rank whose copy is named ("0.rank1")
    seen_at: RecordKey | None = None  # an input no record produced ("in"), made by `module`'s
                                      # own code that no record covers (the attention core)
    excess: float | None = None       # with control runs: its site's excess over the noise
    threshold: float | None = None    # and the excess above which a site is more than noise
    expert: int | None = None         # MoE: the expert of a fused experts module whose tokens
                                      # carry the error (compare.routing.ExpertBlame)
    expert_part: str | None = None    # and the projection inside it, as far as records tell
    routing_flip: str | None = None   # a real routing flip is the divergence (its line)
    origin_of: str | None = None      # with control runs: the site more than noise downstream
                                      # in its layer that this one feeds (verdict.noise.origin)

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
        rank = f" on tensor-parallel rank {self.rank}" if self.rank is not None else ""
        return f"{self.named}#{self.call}{op}{rank}"

    @property
    def named(self) -> str:
        """The module, with the expert of a fused experts module: "…mlp.experts[5]"."""
        return self.module if self.expert is None else f"{self.module}[{self.expert}]"

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["op_key"] = str(self.op_key) if self.op_key is not None else None
        d["cand_key"] = str(self.cand_key) if self.cand_key is not None else None
        d["neighbours"] = list(self.neighbours)
        d["seen_at"] = str(self.seen_at) if self.seen_at is not None else None
        d["amplification"] = self.amplification
        d["local_within"] = self.local_within
        d["where"] = self.where
        d["named"] = self.named
        return d


def _local(r: RecordDiff, loc: RecordLocation) -> tuple[float, str]:
    if r.shadow is not None:
        return r.shadow.rel_l2, "shadow"
    if loc.input_error is None:
        return r.error, "none"
    return loc.introduced, loc.input_basis


def precision_finding(r: RecordDiff, compute: tuple) -> str | None:
    """"candidate computes aten._softmax.default in float16, reference in float32" when the two
    sides hold `r` in different floating dtypes while the runs share one."""
    if not r.dtype_mismatch or compute[0] is None or compute[0] != compute[1]:
        return None
    what = r.key.op or r.key.module
    return (f"candidate computes {what} in {r.cand_dtype}, reference in {r.ref_dtype} "
            f"(both runs {compute[0]})")


def _op_index(ident: str) -> int:
    return int(ident.rsplit("@", 1)[1])


def find_culprit(a: Located) -> Culprit | None:
    d, L = a.diff, a.location
    fd = L.first_divergence
    if fd is None:
        return None
    locs = {str(x.key): x for x in L.records}
    target = d.record(fd.key)
    k = target.key
    req, step, module, call = k.req, k.step, k.module, k.call
    seen_at = None
    if k.role == "in" and k.op is None and fd.path:  # the parent's uncovered code made it
        seen_at, module = k, fd.path[-1]
        call = next((r.key.call for r in d.records if r.key.module == module
                     and r.key.op is None and (r.key.req, r.key.step) == (req, step)
                     and r.order > target.order), 0)
    elif k.role == "in" and k.op is not None:  # code between the module's recorded ops
        seen_at = k
    mod_rec = target if k.op is None and seen_at is None else next(
        (r for r in d.records if r.key.op is None and r.key.role == "out" and r.key.req == req
         and r.key.step == step and r.key.module == module and r.key.call == call), None)
    ops = [r for r in d.records if r.key.op is not None and r.key.role == "out"
           and r.key.req == req and r.key.step == step
           and ((r.key.module == module and r.key.call == call)
                or r.key.module.startswith(module + "."))]
    loc = locs[str(target.key)]
    local, basis = _local(target, loc)
    one, site_ref, site_cand, neighbours = 0, None, None, []
    prefix = f"r{req}.s{step}:{module}#{call}/"
    if d.ops is not None:
        here = [o for o in d.ops.one_sided if o.ident.startswith(prefix)]
        one = len(here)
        if k.op is not None:
            site_ref = d.ops.site("ref", op_ident(k))
            site_cand = d.ops.site("cand", op_ident(target.cand_key or k))
            idx = {"ref": k.op_index, "cand": (target.cand_key or k).op_index}
            for o in here:
                if abs(_op_index(o.ident) - idx[o.only_in]) == 1:
                    neighbours.append(f"{o.only_in} only: {o.ident.split('/', 1)[1]}"
                                      + (f" at {o.site}" if o.site else ""))
    next_step = None
    if (k.op is None or seen_at is not None) and not ops and target.basis != "shape":
        next_step = (f"accucheck capture MODEL --include '{module}' --level op --store full "
                     f"--inputs -o ref-op.h5   # reference machine\n"
                     f"accucheck capture MODEL --include '{module}' --level op --store full "
                     f"--shadow ref-op.h5 -o cand-op.h5   # candidate machine\n"
                     f"accucheck diff ref-op.h5 cand-op.h5   # names the operator")
    expert, part = _expert(d, module, call, seen_at)
    return Culprit(
        req, step, module, call,
        mod_rec.error if mod_rec is not None else None,
        mod_rec.shadow.rel_l2 if mod_rec is not None and mod_rec.shadow is not None else None,
        k.op, k if k.op is not None else None, target.cand_key,
        target.error, local, basis, loc.input_error, target.tolerance.rel_l2,
        target.golden.label if target.golden is not None else None, site_ref, site_cand,
        len(ops), one, precision_finding(target, d.compute_dtypes), tuple(neighbours),
        next_step, split_rank(k.slot)[1], seen_at,
        fd.noise.excess if fd.noise is not None else None,
        fd.noise.threshold if fd.noise is not None else None, expert, part,
        flip_line(fd.routing) if fd.routing is not None else None,
        L.noise.lead_of.site if L.noise is not None and L.noise.lead_of is not None
        and fd.noise is not None else None)


def _expert(d, module: str, call: int, seen_at: RecordKey | None
            ) -> tuple[int | None, str | None]:
    """MoE: the expert whose tokens carry the error of a fused experts module named culprit,
    and which projection inside it the records point at (None, None when it is not one, or
    no expert stands out)."""
    blame = d.routing.blame_for(module, call) if d.routing is not None else None
    if blame is None or blame.best is None:
        return None, None
    if seen_at is not None and seen_at.module == f"{module}.act_fn":
        return blame.best, "gate_up_proj (its gate half: seen at act_fn's input)"
    return blame.best, ("down_proj, or the up half of gate_up_proj (after act_fn; not "
                        "recorded apart)")


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
    if c.routing_flip is not None:
        lines.append(f"  real routing flip: {c.routing_flip}: the router's logits moved more "
                     f"than their noise at that token")
    if c.expert is not None:
        lines.append(f"  expert {c.expert} of {c.module}: the tokens routed to it carry the "
                     f"error (the others do not); inside it: {c.expert_part}")
    if c.seen_at is not None and c.op is not None:
        lines.append(f"  made by code of {c.module} between its recorded ops (a cast or an op "
                     f"the capture or dump leaves out), seen at {c.seen_at}")
    elif c.seen_at is not None:
        lines.append(f"  made by code of {c.module} that no record covers (between its recorded "
                     f"children), seen at {c.seen_at}")
    what = "op output" if c.op is not None else "input" if c.seen_at is not None \
        else "module output"
    lines.append(f"  {what} rel_l2 {g(c.error)}; local {g(c.local_error)} "
                 f"({c.local_basis}); inherited {g(c.inherited_error)}; amplification "
                 f"{g(c.amplification)}; tolerance {g(c.tolerance)}")
    if c.excess is not None:
        lines.append(f"  control: x{g(c.excess)} the control's error over what feeds it "
                     f"(geometric mean over the site's records but its largest; more than noise above "
                     f"x{g(c.threshold)})")
    if c.origin_of is not None:
        lines.append(f"  the origin of {c.origin_of}, more than noise downstream in its layer: "
                     f"this site feeds it and stands at {100 * c.excess / c.threshold:.0f} % of "
                     f"its own threshold (excess "
                     f"is not conserved through a layer; the site that runs first is named)")
    if c.op is not None and c.module_error is not None:
        lines.append(f"  module output rel_l2 {g(c.module_error)}"
                     + (f"; module local (shadow) {g(c.module_local)}"
                        if c.module_local is not None else ""))
    if c.precision:
        lines.append(f"  precision: {c.precision}")
    if c.golden:
        lines.append(f"  golden referee: {c.golden}")
    if c.site_ref or c.site_cand:
        same = c.site_ref == c.site_cand
        lines.append(f"  call site: {c.site_ref or c.site_cand}" if same or not c.site_cand
                     else f"  call site: ref {c.site_ref or '-'} | cand {c.site_cand}")
    if c.cand_key is not None:
        lines.append(f"  candidate op: {c.cand_key} (aligned across fused / shifted ops)")
    for n in c.neighbours:
        lines.append(f"  next to it, {n}")
    if c.ops_one_sided:
        lines.append(f"  {c.ops_one_sided} op calls in this module on one side only "
                     f"(fused / absent)")
    if c.next_step:
        lines.append("  next, to name the operator (same prompts, --tokens-from as before):")
        lines += [f"    {x}" for x in c.next_step.splitlines()]
    return lines
