"""Who feeds whom: each record's input error, the records it comes from, and the first
classification "introduced" / "inherited". Imports keys, compare (diff) and verdict.types;
no torch. `trace(diff, amplification)` is what verdict.locate runs first.

The records of one request and step form a tree of calls: a module call (its "out" records
and the "in" records of inputs no recorded output explains) encloses the calls recorded inside
it (children finish, and are recorded, before their parent; an op call's parent is its module
call). What feeds a record, never the worst of unrelated earlier records:

- a call's outputs: its recorded inputs ("inputs"); the producers the capture linked its inputs
  to ("links", accucheck.capture.record.recorder); with both, the larger; without links (graph mode,
  vLLM, older files) the immediately preceding call under the same parent, else what feeds
  the parent ("proxy"); "none" when nothing feeds it (the first record of its step);
- a container's output slot: the child that returned that very tensor (o_proj's output is
  self_attn's out.0: explained by o_proj alone); a slot no child returned (the attention
  weights, out.1; a decoder layer's residual sum) is made by the container's own code that no
  record covers, so it is explained by what feeds the container and by its children's
  outputs, except a child's output the container returns in another slot (the attention
  weights are not explained by o_proj, which runs after the attention core);
- an "in" record (an input no recorded output explains: the attention core's output at
  o_proj, a residual sum at post_attention_layernorm, act(gate) * up at down_proj) is made by
  the parent's uncovered code: explained by what feeds the parent and by the outputs of the
  parent's children recorded before it. When that does not explain it, the PARENT introduces
  the error there (the culprit is the parent module, seen at this record). An input made
  outside every recorded module (no recorded parent) is never a divergence of its own;
- at decode steps (step > 0) also the same site at earlier steps (state such as a KV cache
  carries it).

A record over tolerance is "introduced" when its error exceeds `amplification` x the largest
error among what feeds it, else "inherited". What feeds a record is never taken below one
rounding of the run's dtype (its unit roundoff, half of compare.metrics.DTYPE_EPS: 2^-8 in
bfloat16, the largest relative error of one rounding): two correct
devices round differently from the first record on, so the first record whose input is bitwise
equal (layer 0's norm after the embedding) differs by a rounding, not by "x inf". With shadow records
(--shadow) the local error decides: introduced when the shadow error is over tolerance.
`RecordLocation.feeders` lists every record considered, for the control rule
(accucheck.verdict.noise), which judges ratios to a control run on the same graph.
"""
from __future__ import annotations

import bisect
import math

from accucheck.compare.metrics import DTYPE_EPS
from accucheck.compare.results import DiffResult, RecordDiff
from accucheck.compare.tolerances import loosest_dtype
from accucheck.keys import RecordKey, is_layer_block
from accucheck.verdict.types import RecordLocation


def trace(diff: DiffResult, amplification: float
          ) -> tuple[dict[str, RecordLocation], dict[str, tuple[str, ...]]]:
    """RecordLocation per record key, and the enclosing modules of each (outermost first)."""
    groups: dict[tuple[int, int], list[RecordDiff]] = {}
    for r in diff.records:
        groups.setdefault((r.key.req, r.key.step), []).append(r)
    locs: dict[str, RecordLocation] = {}
    site_err: dict[tuple[int, str], list[tuple[int, str, float]]] = {}
    paths: dict[str, tuple[str, ...]] = {}
    unit = rounding_unit(diff)
    for (req, step) in sorted(groups, key=lambda g: (g[1], g[0])):
        _Group(groups[(req, step)], amplification, site_err, unit).run(locs, paths)
    return locs, paths


def rounding_unit(diff: DiffResult) -> float:
    """One rounding of the run's dtype (the unit roundoff of the loosest of the two captures'
    compute dtypes, else of their records): the smallest error a record's inputs are said to
    carry."""
    dtypes = [d for d in diff.compute_dtypes if d is not None] or \
        [d for r in diff.records for d in (r.ref_dtype, r.cand_dtype)]
    return DTYPE_EPS.get(loosest_dtype(dtypes), 0.0) / 2


def same_tensor(a: RecordDiff, b: RecordDiff) -> bool:
    """`a` and `b` hold the very same pair of tensors (o_proj's output and self_attn's out.0):
    the same shapes, dtypes and every metric (or statistic) equal, and not identical (two
    identical pairs explain nothing about each other's error)."""
    return (a.ref_shape == b.ref_shape and a.ref_dtype == b.ref_dtype
            and a.cand_dtype == b.cand_dtype and a.basis == b.basis and a.basis != "shape"
            and a.metrics == b.metrics and a.stats == b.stats and not a.identical)


class _Node:
    """One module call (or op call) in a step: its output records and recorded inputs."""
    __slots__ = ("module", "call", "op", "op_index", "outs", "ins", "order", "parent",
                 "children", "input_error", "input_from", "input_basis", "feeders", "done")

    def __init__(self, key, order: int):
        self.module, self.call, self.op, self.op_index = key.module, key.call, key.op, key.op_index
        self.outs: list[RecordDiff] = []
        self.ins: list[RecordDiff] = []
        self.order = order
        self.parent: _Node | None = None
        self.children: list[_Node] = []
        self.input_error: float | None = None
        self.input_from: tuple[str, ...] = ()
        self.input_basis = "none"
        self.feeders: list[tuple[float, str]] = []
        self.done = False

    @property
    def error(self) -> float:
        return max((r.error for r in self.outs), default=0.0)

    @property
    def links(self) -> tuple[tuple[str, str], ...]:
        return next((r.src for r in self.outs if r.src), ())

    def encloses(self, other: "_Node") -> bool:
        if self.op is not None:
            return False
        if other.op is not None and other.module == self.module and other.call == self.call:
            return True
        return other.module.startswith(self.module + ".")


class _Group:
    """The records of one request and step."""

    def __init__(self, recs: list[RecordDiff], amp: float, site_err: dict, unit: float):
        self.amp, self.site_err, self.unit = amp, site_err, unit
        self.errs = {str(r.key): r.error for r in recs}
        self.absd = {str(r.key): _abs_error(r) for r in recs}
        nodes: dict[tuple, _Node] = {}
        ins: dict[tuple, list[RecordDiff]] = {}
        for r in sorted(recs, key=lambda r: r.order):
            k = r.key
            ident = (k.module, k.call, k.op, k.op_index)
            if k.role == "in":
                ins.setdefault(ident, []).append(r)
                continue
            n = nodes.get(ident)
            if n is None:
                n = nodes[ident] = _Node(k, r.order)
            n.outs.append(r)
            n.order = max(n.order, r.order)
        self.orphans = [r for ident, rs in ins.items() if ident not in nodes for r in rs]
        for ident, rs in ins.items():
            if ident in nodes:
                nodes[ident].ins = rs
        self.seq = sorted(nodes.values(), key=lambda n: n.order)
        self._parents()

    def _parents(self) -> None:
        """Parent: the deepest enclosing node recorded later (children finish first)."""
        by_module: dict[str, list[_Node]] = {}
        for n in self.seq:
            if n.op is None:
                by_module.setdefault(n.module, []).append(n)
        orders = {m: [x.order for x in ns] for m, ns in by_module.items()}
        for n in self.seq:
            cands = [n.module] if n.op is not None else []
            parts = n.module.split(".")
            cands += [".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)]
            for m in cands:
                if m not in by_module:
                    continue
                j = bisect.bisect_right(orders[m], n.order)
                if j < len(orders[m]) and by_module[m][j].encloses(n):
                    n.parent = by_module[m][j]
                    break
        self.roots: list[_Node] = []
        for n in self.seq:
            (n.parent.children if n.parent is not None else self.roots).append(n)

    def _summed(self, r: RecordDiff, feeders: list[tuple[float, str]]) -> float:
        """What a decoder layer's own code (its residual adds) can pass on to `r`
        from its feeders at this step: the sum of their absolute errors, relative to `r`'s
        reference. Where the sum cancels (a late layer's MLP removing the massive activation
        its input carries), the output's relative error is several times every addend's:
        between two correct bf16 runs of SmolLM2, layer 28's output at x4.6 its input and
        its children, named without it. Only a decoder layer's own code is a sum of what
        feeds it: an MLP's input (the norm's output) is at another scale than its output, and
        its absolute error would hide a fault in the MLP's own code. 0.0 when an error is not
        known absolutely (stats)."""
        # this request and step; in feeder order: a sum over a set would run in the order of
        # the keys' string hashes, which changes with every process (PYTHONHASHSEED), and three
        # or more addends then differ in their last bit from run to run
        keys = list(dict.fromkeys(k for _, k in feeders if k in self.absd))
        own = self.absd.get(str(r.key))
        if own is None or not r.error or any(self.absd[k] is None for k in keys):
            return 0.0
        return sum(self.absd[k] for k in keys) / (own / r.error)

    def _siblings(self, n: _Node) -> list[_Node]:
        return n.parent.children if n.parent is not None else self.roots

    def _earlier_steps(self, feeders: list[tuple[float, str]]) -> list[tuple[float, str]]:
        """State carried from earlier steps (a KV cache): what fed a call at earlier steps
        feeds it now too, so each feeder's site at every earlier step of the request. (Not
        the record's own earlier outputs: a stateless Linear's fault at step 0 does not
        explain the same fault at step 1.)"""
        out = []
        for _, k in feeders:
            key = RecordKey.parse(k)
            for st, earlier, e in self.site_err.get((key.req, key.site), ()):
                if st < key.step:
                    out.append((e, earlier))
        return out

    def _own_earlier(self, r: RecordDiff) -> list[tuple[float, str]]:
        return [(e, k) for st, k, e in self.site_err.get((r.key.req, r.key.site), ())
                if st < r.key.step]

    def resolve(self, n: _Node) -> None:
        """What feeds call `n` (its input error), once."""
        if n.done:
            return
        n.done = True
        found = [(r.error, str(r.key)) for r in n.ins]
        linked = [(self.errs[p], p) for _, p in n.links if p in self.errs]
        found += linked
        basis = "links" if linked else "inputs" if found else "none"
        # a producer not compared (--include / --step / one side only), or no link at all:
        # also the immediately preceding record under the same parent, else what feeds the
        # parent (over-stating an input error can only turn "introduced" into "inherited")
        if not found or len(linked) < len(n.links):
            prev = None
            for s in self._siblings(n):
                if s.order >= n.order:
                    break
                if s.outs:
                    prev = s
            if prev is not None:
                found.append((prev.error, str(prev.outs[0].key)))
            elif n.parent is not None:
                self.resolve(n.parent)
                found += n.parent.feeders
            if found and basis == "none":
                basis = "proxy"
        found += self._earlier_steps(found)
        if not found:  # nothing known feeds it: its own site at earlier steps is all there is
            found = [(e, k) for r in n.outs for e, k in self._own_earlier(r)]
            basis = "proxy" if found else "none"
        n.feeders = list(dict.fromkeys(found))
        if found:
            err = max(e for e, _ in found)
            n.input_error = err
            n.input_from = tuple(dict.fromkeys(f for e, f in found if e == err))
        n.input_basis = basis

    def _child_outputs(self, parent: _Node | None, before: int,
                       returned: list[RecordDiff] = ()) -> list[tuple[float, str]]:
        """The outputs of `parent`'s children (the roots for None) recorded before execution
        order `before`, except those the parent returns in another slot (`returned`: o_proj's
        output is self_attn's out.0, made after the attention weights): what the parent's
        uncovered code can have been fed. Every earlier child counts, also one whose output
        a recorded call consumed: a conservative bound (over-stating what feeds a record can
        only turn "introduced" into "inherited")."""
        found = []
        for c in (parent.children if parent is not None else self.roots):
            if c.order >= before:
                continue
            for r in c.outs:
                if not any(same_tensor(r, x) for x in returned):
                    found.append((r.error, str(r.key)))
        return found

    def _uncovered(self, parent: _Node | None, before: int) -> list[tuple[float, str]]:
        """What feeds the code of `parent` that no record covers, up to order `before`."""
        found = []
        if parent is not None:
            self.resolve(parent)
            found += parent.feeders
        return found + self._child_outputs(parent, before)

    def run(self, locs: dict, paths: dict) -> None:
        for n in self.seq:
            self.resolve(n)
        for n in self.seq:
            chain, p = [], n.parent
            while p is not None:
                chain.append(p.module)
                p = p.parent
            path = tuple(reversed(chain))
            for r in n.outs:
                feeders, inner = list(n.feeders), None
                if n.children:
                    child = next((c for ch in n.children for c in ch.outs
                                  if same_tensor(c, r)), None)
                    if child is not None:
                        part = [(child.error, str(child.key))]
                    else:  # a slot the container's own code made
                        part = self._child_outputs(n, n.order + 1,
                                                  [x for x in n.outs if x is not r])
                        part += self._earlier_steps(part)
                    inner = max((e for e, _ in part), default=None)
                    if child is None and is_layer_block(n.module):
                        inner = max(inner or 0.0, self._summed(r, n.feeders + part))
                    feeders += part
                locs[str(r.key)] = _classify(r, n.input_error, n.input_from, n.input_basis,
                                             inner, self.amp, feeders, self.unit)
                paths[str(r.key)] = path
                self.site_err.setdefault((r.key.req, r.key.site), []).append(
                    (r.key.step, str(r.key), r.error))
            for r in n.ins:
                slot_links = dict(n.links)
                if r.key.slot in slot_links and slot_links[r.key.slot] in self.errs:
                    p = slot_links[r.key.slot]
                    locs[str(r.key)] = _classify_input(r, [(self.errs[p], p)], self.amp,
                                                       self.unit)
                elif n.parent is not None:
                    feeders = self._uncovered(n.parent, r.order)
                    feeders += self._earlier_steps(feeders)
                    locs[str(r.key)] = _classify_input(r, feeders, self.amp, self.unit)
                else:  # made outside every recorded module: nothing recorded to blame
                    locs[str(r.key)] = _unexplained_input(r)
                paths[str(r.key)] = path
                self.site_err.setdefault((r.key.req, r.key.site), []).append(
                    (r.key.step, str(r.key), r.error))
        for r in self.orphans:
            locs[str(r.key)] = _unexplained_input(r)
            paths[str(r.key)] = ()


def _abs_error(r: RecordDiff) -> float | None:
    """||cand - ref|| of a record compared tensor by tensor, else None."""
    m = r.metrics
    if r.basis != "tensor" or m is None or not math.isfinite(m.rmse):
        return None
    return m.rmse * math.sqrt(m.numel)


def _unexplained_input(r: RecordDiff) -> RecordLocation:
    """An input made by code outside every recorded module (a narrowed --include, the model's
    own attention mask): inherited from what is not recorded, never a culprit."""
    return RecordLocation(r.key, r.error, None, (), r.within,
                          None if r.within else "inherited", 0.0)


def _classify_input(r: RecordDiff, feeders: list[tuple[float, str]], amp: float,
                    unit: float) -> RecordLocation:
    err = max((e for e, _ in feeders), default=None)
    frm = tuple(dict.fromkeys(f for e, f in feeders if e == err))
    basis = "proxy" if feeders else "none"
    return _classify(r, err, frm, basis, None, amp, feeders, unit)


def _classify(r: RecordDiff, input_error: float | None, input_from: tuple[str, ...],
              input_basis: str, inner: float | None, amp: float,
              feeders: list[tuple[float, str]], unit: float) -> RecordLocation:
    err = r.error
    explained = max(input_error or 0.0, inner or 0.0)
    if r.shadow is not None:
        local = r.shadow.rel_l2
        introduced = local
        input_basis = "shadow"
        cause = None if r.within else (
            "introduced" if local > r.tolerance.rel_l2 else "inherited")
    else:
        introduced = max(0.0, err - explained) if math.isfinite(err) else math.inf
        if r.within:
            cause = None
        elif r.basis == "shape" or err > amp * max(explained, unit) or (
                not explained and r.metrics is not None and r.metrics.nan_inf_mismatch):
            cause = "introduced"
        else:
            cause = "inherited"
    return RecordLocation(r.key, err, input_error, input_from, r.within, cause, introduced,
                          inner, input_basis, tuple(dict.fromkeys(k for _, k in feeders)), unit)
