"""Where divergence starts and who introduces it. Imports errors, keys, diff, tolerances; no torch.

`locate(diff_result)` -> `Location`; `analyze(ref, cand, golden=None, ...)` -> `Analysis` (diff +
locate in one call: what the CLI runs).

Input error of a record (per request and step, no model-specific names):
- its recorded input (role "in" records of the same module call, captured with --inputs) when
  present;
- otherwise the residual-stream proxy: the largest error among the records that ran before it
  under the same parent (its preceding siblings) and the parent's own input error. The parent is
  the deepest recorded enclosing module (an op's parent is its module call). For a Llama layer
  this gives: input_layernorm <- previous layer output, self_attn <- input_layernorm,
  post_attention_layernorm <- max(self_attn, layer input) (its input is residual + attention),
  mlp <- post_attention_layernorm, layer i <- layer i-1; ops inside a module <- earlier ops in
  that call and the module's input. Over-estimating an input error can only turn "introduced"
  into "inherited", never invent a culprit;
- at decode steps (step > 0) also the error of the same site at earlier steps (state such as a
  KV cache carries it);
- none (first record of its step with no recorded input): input error unknown, treated as exact.

A record over tolerance is "introduced" when its error exceeds `amplification` (default 4) times
what explains it: its input error and, for a container (a decoder layer, a module with recorded
ops), the largest error among its recorded children; else "inherited". A container is thus
blamed only when none of its recorded children carries the error (e.g. a wrong residual add). With shadow records (--shadow), the local error decides:
introduced when the shadow error itself is over tolerance.

The first divergence is the first record, in execution order (earliest step, then request),
that is over tolerance and introduced; children run (and are recorded) before their enclosing
module, so the walk meets decoder layer -> submodule -> op from the inside: the deepest
recorded culprit is named. When nothing is introduced, the first over-tolerance record is
reported as "inherited" (the error comes from before the first record, or grew gradually).
Errors are tensor-level rel_l2 (or its proven lower bound from statistics): a moved minimum or
a single near-zero element never makes a culprit on its own.
"""
from __future__ import annotations

import bisect
import math
import os
from dataclasses import dataclass
from typing import Iterable, Sequence

from accucheck.diff import DiffResult, Progress, RecordDiff, diff_captures
from accucheck.errors import EXIT_DIVERGENCE, EXIT_OK
from accucheck.keys import RecordKey, is_layer_block, layer_of
from accucheck.metrics import TensorMetrics
from accucheck.tolerances import DEFAULT_AMPLIFICATION, ToleranceTable



@dataclass(frozen=True)
class RecordLocation:
    key: RecordKey
    error: float                  # rel_l2 (or its statistics lower bound)
    input_error: float | None     # None: unknown (treated as exact)
    input_from: tuple[str, ...]   # keys whose error bounds the input error
    within: bool
    cause: str | None             # "introduced" | "inherited" | None when within tolerance
    introduced: float             # local error: shadow rel_l2, else max(0, error - explained)
    inner_error: float | None = None  # largest error among recorded children (containers)

    @property
    def explained(self) -> float:
        """The error this record's inputs and recorded children already carry."""
        return max(self.input_error or 0.0, self.inner_error or 0.0)

    @property
    def amplification(self) -> float:
        e = self.explained
        if not e:
            return math.inf if self.error > 0 else 1.0
        return self.error / e


@dataclass(frozen=True)
class Divergence:
    key: RecordKey
    cause: str                    # "introduced" | "inherited"
    error: float
    input_error: float | None
    input_from: tuple[str, ...]
    tolerance: float
    basis: str                    # "tensor" | "sample" | "stats" | "shape"
    metrics: TensorMetrics | None
    path: tuple[str, ...]         # enclosing modules, outermost first (decoder layer, ...)
    inner_error: float | None = None

    @property
    def module(self) -> str:
        return self.key.module if self.key.op is None else f"{self.key.module}/{self.key.op}"

    @property
    def step(self) -> int:
        return self.key.step

    @property
    def amplification(self) -> float:
        e = max(self.input_error or 0.0, self.inner_error or 0.0)
        return self.error / e if e else math.inf


@dataclass(frozen=True)
class LayerPoint:
    req: int
    step: int
    layer: int
    key: RecordKey
    rel_l2: float
    cosine: float | None
    within: bool


@dataclass(frozen=True)
class Location:
    first_divergence: Divergence | None
    records: tuple[RecordLocation, ...]   # same order as DiffResult.records
    top: tuple[RecordLocation, ...]       # largest introduced error first (over zero only)
    curve: tuple[LayerPoint, ...]         # decoder-layer outputs per request and step
    amplification: float


@dataclass(frozen=True)
class Analysis:
    """A diff and its location: what `accucheck diff` renders. bool() = within tolerance."""
    diff: DiffResult
    location: Location

    @property
    def verdict(self) -> str:
        return "pass" if self.diff.within else "fail"

    @property
    def exit_code(self) -> int:
        return EXIT_OK if self.diff.within else EXIT_DIVERGENCE

    def __bool__(self) -> bool:
        return self.diff.within

    @property
    def culprit(self):
        """Module + operator blamed, with evidence (accucheck.culprit.Culprit); None when
        within tolerance."""
        from accucheck.culprit import find_culprit  # culprit imports this module's types

        return find_culprit(self)


def analyze(ref: str | os.PathLike, cand: str | os.PathLike,
            golden: str | os.PathLike | None = None, *,
            tolerances: ToleranceTable | None = None, steps: Iterable[int] | None = None,
            include: Sequence[str] = (), amplification: float = DEFAULT_AMPLIFICATION,
            top: int = 10, allow_incomplete: bool = False, max_elems: int = 1 << 20,
            progress: Progress | None = None) -> Analysis:
    """`diff_captures` then `locate`: the one library call behind `accucheck diff`."""
    d = diff_captures(ref, cand, golden, tolerances=tolerances, steps=steps, include=include,
                      allow_incomplete=allow_incomplete, max_elems=max_elems, progress=progress)
    return Analysis(d, locate(d, amplification=amplification, top=top))


def locate(diff: DiffResult, *, amplification: float = DEFAULT_AMPLIFICATION,
           top: int = 10) -> Location:
    if amplification < 1:
        raise ValueError("amplification must be >= 1")
    groups: dict[tuple[int, int], list[RecordDiff]] = {}
    for r in diff.records:
        groups.setdefault((r.key.req, r.key.step), []).append(r)
    locs: dict[str, RecordLocation] = {}
    site_err: dict[tuple[int, str], list[tuple[int, float]]] = {}  # (req, site) -> (step, err)
    paths: dict[str, tuple[str, ...]] = {}
    for (req, step) in sorted(groups, key=lambda g: (g[1], g[0])):
        _locate_group(groups[(req, step)], amplification, locs, site_err, paths)
    records = tuple(locs[str(r.key)] for r in diff.records)

    first = None
    ordered = sorted(diff.records, key=lambda r: (r.key.step, r.key.req, r.order))
    over = [r for r in ordered if not r.within and r.key.role != "in"]
    pick = next((r for r in over if locs[str(r.key)].cause == "introduced"), None) \
        or (over[0] if over else None)
    if pick is not None:
        loc = locs[str(pick.key)]
        first = Divergence(pick.key, loc.cause or "inherited", pick.error, loc.input_error,
                           loc.input_from, pick.tolerance.rel_l2, pick.basis, pick.metrics,
                           paths.get(str(pick.key), ()), loc.inner_error)
    ranked = sorted((x for x in records if x.introduced > 0 and x.key.role != "in"),
                    key=lambda x: -x.introduced)[:top]
    curve = tuple(
        LayerPoint(r.key.req, r.key.step, layer_of(r.key.module), r.key, r.error, r.cosine,
                   r.within)
        for r in diff.records
        if r.key.role == "out" and r.key.op is None and is_layer_block(r.key.module)
        and _first_slot(r.key) and layer_of(r.key.module) is not None)
    return Location(first, records, tuple(ranked), curve, amplification)


def _first_slot(key: RecordKey) -> bool:
    return key.slot in ("0", "hidden_states") or key.slot.split(".")[0] == "0"


class _Node:
    """One module call (or op call) in a step: its output records and recorded inputs."""
    __slots__ = ("module", "call", "op", "op_index", "outs", "ins", "order", "parent",
                 "children", "input_error", "input_from", "done")

    def __init__(self, key: RecordKey, order: int):
        self.module, self.call, self.op, self.op_index = key.module, key.call, key.op, key.op_index
        self.outs: list[RecordDiff] = []
        self.ins: list[RecordDiff] = []
        self.order = order
        self.parent: _Node | None = None
        self.children: list[_Node] = []
        self.input_error: float | None = None
        self.input_from: tuple[str, ...] = ()
        self.done = False

    @property
    def ident(self) -> tuple:
        return (self.module, self.call, self.op, self.op_index)

    @property
    def error(self) -> float:
        return max((r.error for r in self.outs), default=0.0)

    def encloses(self, other: "_Node") -> bool:
        if self.op is not None:
            return False
        if other.op is not None and other.module == self.module and other.call == self.call:
            return True
        return other.module.startswith(self.module + ".")


def _locate_group(recs: list[RecordDiff], amp: float, locs: dict, site_err: dict,
                  paths: dict) -> None:
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
    for ident, rs in ins.items():
        if ident in nodes:
            nodes[ident].ins = rs
    seq = sorted(nodes.values(), key=lambda n: n.order)
    # Parent: the deepest enclosing node recorded later (children finish before their parent).
    by_module: dict[str, list[_Node]] = {}
    for n in seq:
        if n.op is None:
            by_module.setdefault(n.module, []).append(n)
    orders = {m: [x.order for x in ns] for m, ns in by_module.items()}
    for n in seq:
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
    roots: list[_Node] = []
    for n in seq:
        (n.parent.children if n.parent is not None else roots).append(n)

    def resolve(n: _Node, siblings: list[_Node]) -> None:
        if n.done:
            return
        n.done = True
        if n.ins:
            err = max(r.error for r in n.ins)
            src = [str(r.key) for r in n.ins]
        else:
            err, src = None, []
            for s in siblings:
                if s.order >= n.order:
                    break
                if s.outs and (err is None or s.error > err):
                    err, src = s.error, [str(s.outs[0].key)]
            if n.parent is not None:
                resolve(n.parent, _siblings(n.parent, roots))
                if n.parent.input_error is not None and (err is None
                                                         or n.parent.input_error > err):
                    err, src = n.parent.input_error, list(n.parent.input_from)
        # State carried from earlier steps (KV cache): the same site's error at earlier steps.
        for r in n.outs:
            for st, e in site_err.get((r.key.req, r.key.site), ()):
                if st < r.key.step and (err is None or e > err):
                    err, src = e, [f"{r.key.site} at step {st}"]
        n.input_error, n.input_from = err, tuple(src)

    for n in seq:
        resolve(n, _siblings(n, roots))
    for n in seq:
        chain = []
        p = n.parent
        while p is not None:
            chain.append(p.module)
            p = p.parent
        inner = max((c.error for c in n.children if c.outs), default=None)
        for r in n.outs:
            locs[str(r.key)] = _classify(r, n.input_error, n.input_from, inner, amp)
            paths[str(r.key)] = tuple(reversed(chain))
            site_err.setdefault((r.key.req, r.key.site), []).append((r.key.step, r.error))
    for rs in ins.values():
        for r in rs:
            locs[str(r.key)] = RecordLocation(r.key, r.error, None, (), r.within,
                                              None if r.within else "inherited", 0.0)


def _siblings(n: _Node, roots: list[_Node]) -> list[_Node]:
    return n.parent.children if n.parent is not None else roots


def _classify(r: RecordDiff, input_error: float | None, input_from: tuple[str, ...],
              inner: float | None, amp: float) -> RecordLocation:
    err = r.error
    explained = max(input_error or 0.0, inner or 0.0)
    if r.shadow is not None:
        local = r.shadow.rel_l2
        introduced = local
        cause = None if r.within else (
            "introduced" if local > r.tolerance.rel_l2 else "inherited")
    else:
        introduced = max(0.0, err - explained) if math.isfinite(err) else math.inf
        if r.within:
            cause = None
        elif r.basis == "shape" or not explained or err > amp * explained:
            cause = "introduced"
        else:
            cause = "inherited"
    return RecordLocation(r.key, err, input_error, input_from, r.within, cause, introduced,
                          inner)
