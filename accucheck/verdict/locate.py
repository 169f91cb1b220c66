"""Where divergence starts and who introduces it. Imports errors, keys, compare (diff,
tolerances), verdict.types and verdict.culprit; no torch.

`locate(diff_result)` -> `Location`; `analyze(ref, cand, golden=None, ...)` -> `Analysis` (diff +
locate in one call: what the CLI runs).

Input error of a record (per request and step, no model-specific names), from what feeds it:
- "inputs": its recorded inputs (role "in" records of the same module / op call);
- "links": the producers the capture linked its inputs to (/index/extra "src": the earlier
  recorded output, or recorded input, that each floating input tensor IS; see
  accucheck.capture.recorder); with both, the larger;
- "proxy" (captures without links: graph mode, vLLM, older files): the immediately preceding
  record under the same parent (the previous record on the residual stream), else the
  parent's own input error. The parent is the deepest recorded enclosing module (an op's
  parent is its module call). A proxy can over- or under-state; links are exact;
- at decode steps (step > 0) also the error of the same site at earlier steps (state such as a
  KV cache carries it);
- "none" (first record of its step, nothing feeds it): input error unknown, treated as exact.

A record over tolerance is "introduced" when its error exceeds `amplification` (default 4)
times what explains it: its input error and, for a container (a decoder layer, a module with
recorded children or ops), the largest error among its recorded children; else "inherited".
A container is thus blamed only when none of its recorded children carries the error (e.g. a
wrong residual add). With shadow records (--shadow), the local error decides: introduced when
the shadow error itself is over tolerance.

The first divergence is the first record, in execution order (earliest step, then request,
then capture order), that is over tolerance AND introduced; children run (and are recorded)
before their enclosing module and ops before their module's output, so the walk names the
innermost recorded culprit, and inside it the first op that introduces the error (the root,
not the largest). With a golden referee, "over tolerance" means the referee marks the record
"cand worse" (compare.diff). When records are over tolerance but none introduces the error,
there is NO first divergence: `first_over` and `worst` say where the diffuse / inherited error
shows first and where it is largest, and no culprit is named.

First difference: when the first records in execution order are identical on both sides
(eager vs graph on one machine: the compiled program computes the same up to a point), the
first record that is not, within tolerance or not (`first_difference`); None when the very
first record differs (another device: everything differs a little) or none does. An "in"
record there means the difference is made by code of its module's parent that no record
covers (o_proj's input: the attention core and the rotary embedding inside self_attn).

Noise floor (no golden referee): a record that amplifies what feeds it far more than its peers
do (the same module kind, operator and slot in nearby layers, same request and step) is
"suspicious", also within tolerance (see `noise_floor`; the numbers are in
accucheck.compare.tolerances, NOISE_FLOOR_*).

Errors are tensor-level rel_l2 (or its proven lower bound from statistics): a moved minimum or
a single near-zero element never makes a culprit on its own.
"""
from __future__ import annotations

import bisect
import math
import os
import re
import statistics
from dataclasses import dataclass
from typing import Iterable, Sequence

from accucheck.compare.diff import DiffResult, Progress, RecordDiff, diff_captures
from accucheck.compare.tolerances import (DEFAULT_AMPLIFICATION, NOISE_FLOOR_FACTOR,
                                          NOISE_FLOOR_MIN_FRACTION, NOISE_FLOOR_MIN_PEERS,
                                          NOISE_FLOOR_WINDOW, ToleranceTable)
from accucheck.errors import EXIT_DIVERGENCE, EXIT_OK
from accucheck.keys import RecordKey, is_layer_block, layer_of
from accucheck.verdict.culprit import find_culprit
# the records live in verdict.types (culprit reads them too); kept importable from here
from accucheck.verdict.types import (INPUT_BASES, Divergence, LayerPoint, Location,  # noqa: F401
                                     RecordLocation, Suspicious)


@dataclass(frozen=True)
class Analysis:
    """A diff and its location: what `accucheck diff` renders. The one verdict: headline,
    culprit, JSON and sign-off all read it from here. bool() = within tolerance."""
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
        """Module + operator blamed, with evidence (verdict.culprit.Culprit); None when
        nothing introduces a divergence (within tolerance, or diffuse / inherited)."""
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
    errs = {str(r.key): r.error for r in diff.records}
    groups: dict[tuple[int, int], list[RecordDiff]] = {}
    for r in diff.records:
        groups.setdefault((r.key.req, r.key.step), []).append(r)
    locs: dict[str, RecordLocation] = {}
    site_err: dict[tuple[int, str], list[tuple[int, float]]] = {}  # (req, site) -> (step, err)
    paths: dict[str, tuple[str, ...]] = {}
    for (req, step) in sorted(groups, key=lambda g: (g[1], g[0])):
        _locate_group(groups[(req, step)], amplification, errs, locs, site_err, paths)
    records = tuple(locs[str(r.key)] for r in diff.records)

    ordered = sorted(diff.records, key=lambda r: (r.key.step, r.key.req, r.order))
    over = [r for r in ordered if not r.within and r.key.role != "in"]
    intro = next((r for r in over if locs[str(r.key)].cause == "introduced"), None)
    worst = max(over, key=lambda r: r.error / max(r.tolerance.rel_l2, 1e-300), default=None)

    def divergence(r: RecordDiff | None) -> Divergence | None:
        if r is None:
            return None
        loc = locs[str(r.key)]
        return Divergence(r.key, loc.cause or "inherited", r.error, loc.input_error,
                          loc.input_from, r.tolerance.rel_l2, r.basis, r.metrics,
                          paths.get(str(r.key), ()), loc.inner_error, loc.input_basis)

    ranked = sorted((x for x in records if x.introduced > 0 and x.key.role != "in"),
                    key=lambda x: -x.introduced)[:top]
    curve = tuple(
        LayerPoint(r.key.req, r.key.step, layer_of(r.key.module), r.key, r.error, r.cosine,
                   r.within)
        for r in diff.records
        if r.key.role == "out" and r.key.op is None and is_layer_block(r.key.module)
        and _first_slot(r.key))
    sus = () if diff.golden_path is not None else noise_floor(diff, locs, amplification)
    if intro is not None:  # after the first divergence, outliers may be its consequences
        first = (intro.key.step, intro.key.req, intro.order)
        order = {str(r.key): r.order for r in diff.records}
        sus = tuple(s for s in sus if (s.key.step, s.key.req, order[str(s.key)]) < first)
    same = 0
    for r in ordered:
        if not r.identical:
            break
        same += 1
    differs = ordered[same] if 0 < same < len(ordered) else None
    return Location(divergence(intro), records, tuple(ranked), curve, amplification,
                    divergence(over[0] if over else None), divergence(worst), sus,
                    divergence(differs))


def _first_slot(key: RecordKey) -> bool:
    return key.slot in ("0", "hidden_states") or key.slot.split(".")[0] == "0"


_INDEX = re.compile(r"\.\d+(?=\.|$)")


def peer_kind(key: RecordKey) -> str:
    """The site with every numeric path component wildcarded ("model.layers.*.mlp.down_proj
    #0:out.0"): records of one module kind, operator and slot across layers (and experts)."""
    op = f"/{key.op}@{key.op_index}" if key.op is not None else ""
    return f"{_INDEX.sub('.*', key.module)}#{key.call}{op}:{key.role}.{key.slot}"


def noise_floor(diff: DiffResult, locs: dict[str, RecordLocation],
                amplification: float = DEFAULT_AMPLIFICATION, *,
                factor: float = NOISE_FLOOR_FACTOR,
                min_fraction: float = NOISE_FLOOR_MIN_FRACTION,
                min_peers: int = NOISE_FLOOR_MIN_PEERS,
                window: int = NOISE_FLOOR_WINDOW) -> tuple[Suspicious, ...]:
    """Records that introduce far more error than their peers do. Peers: the same module kind,
    operator and slot (`peer_kind`) in the layers within `window` of the record's, same request
    and step (the regime changes with depth and between prefill and decode). "How much a record
    introduces" is its gain: error / what explains it, or its shadow error with shadow records.
    Relative errors are not conserved through a module (an RMSNorm whose weight damps the
    residual stream's outlier channels turns a 0.1 % input error into 2 % in a float32 vs
    bfloat16 run, in every deep layer), so a record is compared with the same module nearby,
    never with a fixed number. Suspicious: a gain above `amplification` (it would be
    "introduced") and above `factor` x max(1, the peers' median gain), and a local error (error
    - explained) above `min_fraction` x its tolerance. Fewer than `min_peers` peers: not
    judged. Records introduced over tolerance are left out: they are the first divergence."""
    groups: dict[tuple, list[tuple[RecordDiff, RecordLocation, float, int]]] = {}
    for r in diff.records:
        layer = layer_of(r.key.module)
        if r.key.role == "in" or r.basis == "shape" or layer is None:
            continue
        loc = locs[str(r.key)]
        if r.shadow is not None:
            gain = r.shadow.rel_l2
        elif loc.input_basis == "none":
            continue
        else:
            e = loc.explained
            gain = r.error / e if e else (math.inf if r.error > 0 else 1.0)
        groups.setdefault((peer_kind(r.key), r.key.req, r.key.step), []).append(
            (r, loc, gain, layer))
    out = []
    for (kind, _, _), items in groups.items():
        for r, loc, gain, layer in items:
            if loc.cause == "introduced" or loc.introduced <= min_fraction * r.tolerance.rel_l2:
                continue
            if r.shadow is None and gain <= amplification:
                continue
            peers = [g for x, _, g, ly in items
                     if x.key.site != r.key.site and abs(ly - layer) <= window]
            if len(peers) < min_peers:
                continue
            med = statistics.median(peers)
            if gain > factor * (med if r.shadow is not None else max(med, 1.0)):
                out.append(Suspicious(r.key, r.error, loc.introduced, gain, med, len(peers),
                                      kind, r.tolerance.rel_l2, r.within))
    order = {str(r.key): r.order for r in diff.records}
    return tuple(sorted(out, key=lambda s: (s.key.step, s.key.req, order[str(s.key)])))


class _Node:
    """One module call (or op call) in a step: its output records and recorded inputs."""
    __slots__ = ("module", "call", "op", "op_index", "outs", "ins", "order", "parent",
                 "children", "input_error", "input_from", "input_basis", "done")

    def __init__(self, key: RecordKey, order: int):
        self.module, self.call, self.op, self.op_index = key.module, key.call, key.op, key.op_index
        self.outs: list[RecordDiff] = []
        self.ins: list[RecordDiff] = []
        self.order = order
        self.parent: _Node | None = None
        self.children: list[_Node] = []
        self.input_error: float | None = None
        self.input_from: tuple[str, ...] = ()
        self.input_basis = "none"
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


def _locate_group(recs: list[RecordDiff], amp: float, errs: dict[str, float], locs: dict,
                  site_err: dict, paths: dict) -> None:
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
        found = [(r.error, str(r.key)) for r in n.ins]
        linked = [(errs[p], p) for _, p in n.links if p in errs]
        found += linked
        basis = "links" if linked else "inputs" if found else "none"
        # a producer not compared (--include / --step / one side only), or no link at all:
        # also the immediately preceding record under the same parent, else what feeds the
        # parent (over-stating an input error can only turn "introduced" into "inherited")
        if not found or len(linked) < len(n.links):
            prev = None
            for s in siblings:
                if s.order >= n.order:
                    break
                if s.outs:
                    prev = s
            if prev is not None:
                found.append((prev.error, str(prev.outs[0].key)))
            elif n.parent is not None:
                resolve(n.parent, _siblings(n.parent, roots))
                if n.parent.input_error is not None:
                    found += [(n.parent.input_error, f) for f in n.parent.input_from]
            if found and basis == "none":
                basis = "proxy"
        # State carried from earlier steps (KV cache): the same site's error at earlier steps.
        for r in n.outs:
            for st, e in site_err.get((r.key.req, r.key.site), ()):
                if st < r.key.step:
                    found.append((e, f"{r.key.site} at step {st}"))
                    basis = "proxy" if basis == "none" else basis
        if found:
            err = max(e for e, _ in found)
            n.input_error = err
            n.input_from = tuple(dict.fromkeys(f for e, f in found if e == err))
        n.input_basis = basis

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
            locs[str(r.key)] = _classify(r, n.input_error, n.input_from, n.input_basis, inner,
                                         amp)
            paths[str(r.key)] = tuple(reversed(chain))
            site_err.setdefault((r.key.req, r.key.site), []).append((r.key.step, r.error))
    for rs in ins.values():
        for r in rs:
            locs[str(r.key)] = RecordLocation(r.key, r.error, None, (), r.within,
                                              None if r.within else "inherited", 0.0)


def _siblings(n: _Node, roots: list[_Node]) -> list[_Node]:
    return n.parent.children if n.parent is not None else roots


def _classify(r: RecordDiff, input_error: float | None, input_from: tuple[str, ...],
              input_basis: str, inner: float | None, amp: float) -> RecordLocation:
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
        elif r.basis == "shape" or not explained or err > amp * explained:
            cause = "introduced"
        else:
            cause = "inherited"
    return RecordLocation(r.key, err, input_error, input_from, r.within, cause, introduced,
                          inner, input_basis)
