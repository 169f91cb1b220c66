"""The control rule: is the candidate's error more than noise? Imports keys, compare (diff,
tolerances) and verdict.types (which holds its records); no torch. `judge(diff, locs)` -> `NoiseVerdict | None` (None
without control runs); verdict.locate calls it and names its first site as the divergence.

A control run (compare.control) is the reference's code at the candidate's precision on a
trusted device: its error against the reference is what that precision costs by itself, in
every record. The candidate is compared with it record by record:

- errors are `RecordDiff.elem_error` (the mean elementwise relative error; in the stats store
  the RMS of the elementwise errors from the records' sketches, accucheck.store.sketch; every
  element counts once, so the massive activations that dominate rel_l2 of a residual stream do not
  make the ratio jump between two equally good runs); below CONTROL_ERROR_FLOOR x the
  record's tolerance an error counts as that floor;
- ratio = candidate error / expected error (the mean over the control runs);
- excess = ratio / max(1, the largest ratio among what feeds the record (verdict.flow)): a
  record that only passes on what it was fed has excess <= 1; one that adds error of its own
  beyond the precision's has excess > 1. An "in" record (an input no recorded output explains)
  stands for its parent's uncovered code;
- a kernel fault is systematic: it shows in every call of its site. So the evidence of a
  site (module, call, role, slot) is the geometric mean of its records' excess over every
  request and step, without its largest record when it has three or more (`_evidence`): the
  evidence must not rest on one record. One record of a heavy-tailed tensor (SmolLM2's
  layer-2 down_proj at one decode token) stood x3.4 over what feeds it between two correct
  runs by chance, and made a site of three records stand at x1.32. (Split by phase, a
  prefill-only fault's evidence would not be diluted by decode records, but a phase of one
  record is one record: 13 false alarms in 72 single-prompt pairs against 8, and 4 without
  the largest record; bench/bench_devices.py.) The site is judged against its kind (the same module kind and slot in
  the other layers, keys.peer_kind): more than noise when its log excess stands CONTROL_Z
  spreads above its location and the excess is at least CONTROL_MIN_RATIO
  (CONTROL_MIN_RATIO_ESTIMATED when its errors are estimates from sampled values, the stats
  store; compare.tolerances, CONTROL_*). The location is the median of the kind's sites within
  CONTROL_WINDOW layers, capped at 0 (an excess of 1), so that a fault in every layer stays
  visible; the spread is the robust spread of the steps between consecutive layers' log
  excess (1.4826 x their median / sqrt 2): a fault shifts every layer after it from "less
  noisy than the control, by chance" to "exactly as noisy as what feeds it", a step that
  would inflate a plain spread across layers, but is one step among thirty;
- with two or more control runs, the threshold widens by the standard error of their mean at
  the site (`_disagreement`: the site's excess judged against each run alone): where one run
  happened to be quiet and another noisy, their mean is that uncertain. Against the mean of
  two, correct devices were flagged at x1.03-1.05 their threshold by one control run only
  (an attention core, bench/bench_devices.py, docs/control.md);

Named: the flagged site's first record, in execution order, whose own excess is over the
site's threshold (else its largest). The first flagged site in the forward pass (where the site
first runs, not where its named record is), or its origin (`origin`: the earliest site of its
layer that feeds it and stands within CONTROL_ORIGIN of its own threshold, or
CONTROL_ORIGIN_ESTIMATED where its errors are sampled estimates, or stands CONTROL_Z spreads
over its kind with an excess of at least that fraction of 1), is the first
divergence (`NoiseVerdict.lead`); the
dtype tolerance then does not decide (the control answers "more than noise?"; a golden
answers "who is closer to the truth?"; the tolerance table is the fallback without either).
"""
from __future__ import annotations

import math
import statistics

from accucheck.compare.results import DiffResult, RecordDiff
from accucheck.compare.routing import JUDGED_ELSEWHERE
from accucheck.compare.tolerances import (CONTROL_ERROR_FLOOR, CONTROL_MIN_PEERS,
                                          CONTROL_MIN_RATIO, CONTROL_MIN_RATIO_ESTIMATED,
                                          CONTROL_PEERLESS_SPREAD, CONTROL_SPREAD_FLOOR,
                                          CONTROL_WINDOW, CONTROL_Z)
from accucheck.keys import RecordKey, is_layer_block, layer_of, peer_kind
from accucheck.verdict.types import NoiseSite, NoiseVerdict, RecordLocation, RecordNoise


def _floor(r: RecordDiff) -> float:
    return max(CONTROL_ERROR_FLOOR * r.tolerance.rel_l2, 1e-300)


def judge(diff: DiffResult, locs: dict[str, RecordLocation]) -> NoiseVerdict | None:
    if not diff.control_paths:
        return None
    recs, by_site, gm = _excess(diff, locs, lambda c: sum(c) / len(c))
    n = len(diff.control_paths)
    alone = [_excess(diff, locs, lambda c, i=i: c[i])[2] for i in range(n)] if n > 1 else []
    kinds: dict[str, list[str]] = {}
    for s, xs in by_site.items():
        kinds.setdefault(peer_kind(xs[0][1].key), []).append(s)
    sites = []
    for kind, members in kinds.items():
        layers = {s: layer_of(by_site[s][0][1].key.module) for s in members}
        judged = len(members) >= CONTROL_MIN_PEERS and None not in layers.values()
        if judged:
            chain = sorted(members, key=lambda s: (layers[s], s))
            logs = [math.log(gm[s]) for s in chain]
            steps = [abs(a - b) for a, b in zip(logs, logs[1:])]
            spread = max(1.4826 * statistics.median(steps) / math.sqrt(2), CONTROL_SPREAD_FLOOR)
        for s in members:
            if judged:
                near = [math.log(gm[t]) for t in members
                        if t != s and abs(layers[t] - layers[s]) <= CONTROL_WINDOW]
                location = min(statistics.median(near), 0.0) if near else 0.0
            else:
                location, spread = 0.0, CONTROL_PEERLESS_SPREAD
            xs = sorted(by_site[s], key=lambda p: (p[0].key.step, p[0].key.req, p[0].order))
            least = CONTROL_MIN_RATIO_ESTIMATED if all(r.estimated for r, _ in xs) \
                else CONTROL_MIN_RATIO
            widen = _disagreement([g[s] for g in alone if s in g])
            limit = max(math.exp(location + CONTROL_Z * spread), least) * widen
            named = next((x for _, x in xs if x.excess > limit),
                         max((x for _, x in xs), key=lambda x: x.excess))
            sites.append(NoiseSite(s, kind, named.key, gm[s], len(xs), location, spread,
                                   len(members), gm[s] > limit, least, widen))
    # a site's place in the forward pass: where it first runs (earliest step, request, order).
    # Not where its named record is: a fault upstream may cross the threshold first in a later
    # request than a site it feeds, and the site that runs first is the one that introduces it
    place: dict[str, tuple[int, int, int]] = {}
    for r in sorted(diff.records, key=lambda r: (r.key.step, r.key.req, r.order)):
        place.setdefault(r.key.site, (r.key.step, r.key.req, r.order))
    flagged = sorted((s for s in sites if s.flagged), key=lambda s: place[s.site])
    lead = origin(flagged[0], sites, locs, place) if flagged else None
    sites.sort(key=lambda s: -s.z)
    return NoiseVerdict(diff.control_paths, tuple(recs), tuple(sites), tuple(flagged), lead,
                        flagged[0] if lead is not None and lead is not flagged[0] else None)


def _excess(diff: DiffResult, locs: dict[str, RecordLocation], expect
            ) -> tuple[list[RecordNoise], dict[str, list[tuple[RecordDiff, RecordNoise]]],
                       dict[str, float]]:
    """Every judged record's ratio and excess against `expect(r.control)` (the controls'
    mean, or one control run alone), the records by site, and each site's evidence."""
    ratios: dict[str, float] = {}
    base: dict[str, tuple[RecordDiff, float, tuple[float, float]]] = {}
    for r in diff.records:
        if r.control is None or r.basis == "shape" or locs[str(r.key)].unattributed \
                or r.routing in JUDGED_ELSEWHERE:
            continue
        f = _floor(r)
        expected = expect(r.control)
        ratios[str(r.key)] = max(r.elem_error, f) / max(expected, f)
        base[str(r.key)] = (r, expected, (min(r.control), max(r.control)))
    recs = []
    for k, (r, expected, spread) in base.items():
        ins = [ratios[f] for f in locs[k].feeders if f in ratios and f != k]
        recs.append(RecordNoise(r.key, r.elem_error, expected, spread, ratios[k],
                                max(ins, default=1.0)))
    by_site: dict[str, list[tuple[RecordDiff, RecordNoise]]] = {}
    for x in recs:
        by_site.setdefault(x.key.site, []).append((base[str(x.key)][0], x))
    return recs, by_site, {s: _evidence([x for _, x in xs]) for s, xs in by_site.items()}


def _disagreement(alone: list[float]) -> float:
    """How far a site's excess depends on which control run measures it: exp of the standard
    error of the mean of its log excess against each control alone (for two runs, the square
    root of their ratio); 1 with one control. The threshold widens by it."""
    logs = [math.log(g) for g in alone if g > 0]
    if len(logs) < 2:
        return 1.0
    return math.exp(statistics.stdev(logs) / math.sqrt(len(logs)))


def _evidence(records: list[RecordNoise]) -> float:
    """A site's excess: the geometric mean of its records' excess, the largest left out of
    three or more (see the module docstring)."""
    logs = sorted(math.log(max(x.excess, 1e-300)) for x in records)
    if len(logs) >= 3:
        logs.pop()
    return math.exp(sum(logs) / len(logs))


def origin(first: NoiseSite, sites: list[NoiseSite], locs: dict[str, RecordLocation],
           place: dict[str, tuple[int, int, int]]) -> NoiseSite:
    """The site named for the first site more than noise: itself, or the earliest site of its
    layer that feeds it (verdict.flow's feeders, followed back within the layer) and stands
    within its `origin` fraction of its own threshold (NoiseSite.origin: CONTROL_ORIGIN, or
    CONTROL_ORIGIN_ESTIMATED where its errors are sampled estimates), or that stands
    CONTROL_Z spreads over its kind (as a flagged site does) with an excess of at least that
    fraction of 1: what a flagged site misses only by the CONTROL_MIN_RATIO floor. Excess is
    not conserved through a layer: a faulty RMSNorm's error can stand out more at the Linear
    it feeds than at its own output, against each one's noise, so the Linear crosses its
    threshold first; naming it would blame the module downstream of the fault (measured:
    bench/bench_control.py, docs/control.md). A norm's kind can sit well below the control
    (a norm damps what it is fed): a norm fault at x2 its noise in the gpu device, layer 14,
    stood at excess x1.0, z over 5 above its kind, under 0.9 of the 1.15 floor, and the
    gate_proj it feeds was named (bench/bench_devices.py, stats and full store, one control)."""
    layer = layer_of(first.key.module)
    if layer is None:
        return first
    by_site = {s.site: s for s in sites}
    seen, todo, found = set(), [str(first.key)], []
    while todo:
        k = todo.pop()
        for f in (locs[k].feeders if k in locs else ()):
            if f in seen:
                continue
            seen.add(f)
            fk = RecordKey.parse(f)
            if layer_of(fk.module) != layer or (fk.req, fk.step) != (first.key.req,
                                                                     first.key.step):
                continue
            todo.append(f)
            s = by_site.get(fk.site)
            if s is not None and place[s.site] < place[first.site] and _stands(s, sites):
                found.append(s)
    return min(found, key=lambda s: place[s.site]) if found else first


def _stands(s: NoiseSite, sites: list[NoiseSite]) -> bool:
    """Whether a feeder of the first flagged site is its origin (see `origin`): within its
    origin fraction of its threshold, or CONTROL_Z spreads over its kind both around it and in
    the CONTROL_WINDOW layers before it, with an excess of at least that fraction of 1. The
    layers after a fault are no measure of its kind's noise: a norm damps what it is fed, so
    the norms after a fault sit below the control and lift every norm before them by z."""
    if s.excess >= s.origin * s.threshold:
        return True
    if s.z < CONTROL_Z or s.excess < s.origin:
        return False
    layer = layer_of(s.key.module)
    before = [math.log(t.excess) for t in sites if t.kind == s.kind and t.excess > 0
              and (ly := layer_of(t.key.module)) is not None
              and layer - CONTROL_WINDOW <= ly < layer]
    location = min(statistics.median(before), 0.0) if before else 0.0
    return math.log(s.excess) - location >= CONTROL_Z * s.spread


def layer_ratios(v: NoiseVerdict) -> list[tuple[int, float, float, str]]:
    """Per decoder layer: (layer, the candidate/control ratio at the layer's output (geometric
    mean over its requests and steps), the largest site excess inside the layer, that site):
    the candidate/control curve of the reports."""
    out: dict[int, list] = {}
    for x in v.records:
        layer = layer_of(x.key.module)
        if layer is not None and x.key.role == "out" and x.key.op is None \
                and is_layer_block(x.key.module) and x.key.slot == "0":
            out.setdefault(layer, [[], 0.0, ""])[0].append(math.log(max(x.ratio, 1e-300)))
    for s in v.sites:
        layer = layer_of(s.key.module)
        if layer in out and s.excess > out[layer][1]:
            out[layer][1], out[layer][2] = s.excess, s.site
    return [(ly, math.exp(sum(r) / len(r)), m, site)
            for ly, (r, m, site) in sorted(out.items())]
