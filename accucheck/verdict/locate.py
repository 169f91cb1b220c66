"""Where divergence starts and who introduces it. Imports errors, keys, compare (diff,
tolerances), verdict.types, verdict.flow and verdict.culprit; no torch.

`locate(diff_result)` -> `Location`; `analyze(ref, cand, golden=None, ...)` -> `Analysis` (diff +
locate in one call: what the CLI runs).

What feeds each record and its first classification ("introduced" when its error exceeds
`amplification` (default 4) x the largest error among what feeds it, else "inherited") come
from accucheck.verdict.flow: recorded inputs, producer links, a proxy without links, a
container's slot explained by the child that returned it or, for a slot its own code made,
by what feeds the container and its children whose outputs no recorded call consumed; an
"in" record (an input no recorded output explains) by what feeds the parent's uncovered code.

The first divergence is the first record, in execution order (earliest step, then request,
then capture order), that is over tolerance AND introduced; children run (and are recorded)
before their enclosing module and ops before their module's output, so the walk names the
innermost recorded culprit, and inside it the first op that introduces the error (the root,
not the largest). With a golden referee, "over tolerance" means the referee marks the record
"cand worse" (compare.diff). An "in" record that introduces the error names its parent
module's uncovered code (the attention core, seen at o_proj's input). When records are over tolerance but none introduces the error,
there is NO first divergence: `first_over` and `worst` say where the diffuse / inherited error
shows first and where it is largest, and no culprit is named.

Peer gate (no control, no golden referee): a record over tolerance that introduces error is
the first divergence only when its site's local error stands out from its peers' (more than
PEER_GATE x their median, at the site's prefill or, in most requests, decode records; a site
without peers, such as the logits, against what feeds it: `_Gate`); the records that
introduce error are judged in execution order until one stands out, the first that does not
is `noise_like`. In
a bfloat16 run of a deep model every layer's norms go over a float32 tolerance by rounding
alone: without the gate, every clean SmolLM2 pair named one of them (docs/control.md). Records
over tolerance that nothing introduces, past the gate, are accumulated rounding: the verdict
passes (`Analysis.within`, `Analysis.accumulated`).

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

import math
import os
import statistics
from dataclasses import dataclass

from accucheck.compare.diff import diff_captures
from accucheck.compare.results import ESTIMATED, DiffResult, RecordDiff
from accucheck.compare.routing import JUDGED_ELSEWHERE
from accucheck.compare.tolerances import (DEFAULT_AMPLIFICATION, NOISE_FLOOR_FACTOR,
                                          NOISE_FLOOR_MIN_FRACTION, NOISE_FLOOR_MIN_PEERS,
                                          NOISE_FLOOR_WINDOW, PEER_GATE,
                                          PEER_GATE_ESTIMATED)
from accucheck.errors import EXIT_DIVERGENCE, EXIT_OK
from accucheck.keys import RecordKey, is_layer_block, layer_of, peer_kind  # noqa: F401
from accucheck.verdict.culprit import find_culprit
from accucheck.verdict.flow import trace
from accucheck.verdict.noise import judge
# the records live in verdict.types (culprit reads them too); kept importable from here
from accucheck.verdict.types import (INPUT_BASES, Divergence, LayerPoint, Location,  # noqa: F401
                                     NoiseLike, RecordLocation, Suspicious)


@dataclass(frozen=True)
class Analysis:
    """A diff and its location: what `accucheck diff` renders. The one verdict: headline,
    culprit, JSON and sign-off all read it from here. bool() = `within`."""
    diff: DiffResult
    location: Location

    @property
    def within(self) -> bool:
        """The one pass / fail. With control runs: no site is more than noise and no token
        flip is real (the control decides). With a golden referee: the diff's. Else the
        tolerance, where something introduces the error: FAIL when a record is named (over
        tolerance, introduced, standing out from its peers or its inputs), a record is
        SUSPICIOUS (the noise floor), a token or a routing flip is real, or only recorded
        inputs differ; records over tolerance that nothing introduces (accumulated rounding)
        PASS and the headline says so."""
        noise, d, L = self.location.noise, self.diff, self.location
        if noise is not None:
            return not noise.flagged and not d.real_flip
        if d.golden_path is not None or d.within:
            return d.within
        # no control, no golden: the dtype tolerance names what introduces error; error that
        # only accumulates through the model (diffuse / inherited, or noise-like where it is
        # introduced) is what two correct devices show in a deep model, not a failure by itself
        return L.first_divergence is None and L.first_over is not None and not L.suspicious \
            and not d.real_flip and not d.real_routing_flip

    @property
    def accumulated(self) -> bool:
        """PASS although records are over the dtype tolerance (no control, no golden): nothing
        introduces the error above its peers' or its inputs' noise."""
        return self.within and not self.diff.within and self.location.noise is None

    @property
    def verdict(self) -> str:
        return "pass" if self.within else "fail"

    @property
    def exit_code(self) -> int:
        return EXIT_OK if self.within else EXIT_DIVERGENCE

    def __bool__(self) -> bool:
        return self.within

    @property
    def culprit(self):
        """Module + operator blamed, with evidence (verdict.culprit.Culprit); None when
        nothing introduces a divergence (within tolerance, or diffuse / inherited)."""
        return find_culprit(self)


def analyze(ref: str | os.PathLike, cand: str | os.PathLike,
            golden: str | os.PathLike | None = None, *,
            amplification: float = DEFAULT_AMPLIFICATION, top: int = 10,
            **diff_options) -> Analysis:
    """`diff_captures` then `locate`: the one library call behind `accucheck diff`, the
    sign-off, the demo and the matrix. `diff_options`: diff_captures' keywords (tolerances,
    steps, include, controls, transforms, allow_incomplete, allow_model_mismatch, jobs,
    progress, ...), passed as they are."""
    d = diff_captures(ref, cand, golden, **diff_options)
    return Analysis(d, locate(d, amplification=amplification, top=top))


def locate(diff: DiffResult, *, amplification: float = DEFAULT_AMPLIFICATION,
           top: int = 10) -> Location:
    if amplification < 1:
        raise ValueError("amplification must be >= 1")
    locs, paths = trace(diff, amplification)
    records = tuple(locs[str(r.key)] for r in diff.records)
    noise = judge(diff, locs)

    ordered = sorted(diff.records, key=lambda r: (r.key.step, r.key.req, r.order))
    over = [r for r in ordered if not r.within and not locs[str(r.key)].unattributed]
    noise_like = None
    if noise is None:
        intros = (r for r in over if locs[str(r.key)].cause == "introduced")
        intro = next(intros, None)
        if intro is not None and diff.golden_path is None:
            # every introduced record in execution order until one stands out: rounding noise
            # that crosses the tolerance first must not hide a fault deeper in the model
            gate, judged = _Gate(diff, locs, amplification), {}
            while intro is not None:
                site = intro.key.site
                if site not in judged:
                    judged[site] = gate(intro)
                if judged[site] is None:
                    break
                noise_like = noise_like or judged[site]
                intro = next(intros, None)
            if intro is not None:
                noise_like = None
    else:  # the control decides: its first site more than noise
        intro = diff.record(noise.lead.key) if noise.lead is not None else None
    # a real MoE routing flip (compare.routing) before it is the divergence: the router's logits
    rflip = diff.routing.real_flip if diff.routing is not None else None
    if rflip is not None and (intro is None or (rflip.key.step, rflip.key.req, rflip.order)
                              < (intro.key.step, intro.key.req, intro.order)):
        logits = RecordKey(rflip.key.req, rflip.key.step, rflip.key.module, rflip.key.call,
                           "out", "0")
        intro = next((r for r in diff.records if r.key == logits), None) or \
            diff.record(rflip.key)
    else:
        rflip = None
    worst = max(over, key=lambda r: r.error / max(r.tolerance.rel_l2, 1e-300), default=None)

    def divergence(r: RecordDiff | None, site=None, flip=None) -> Divergence | None:
        if r is None:
            return None
        loc = locs[str(r.key)]
        cause = "introduced" if site is not None or flip is not None else \
            loc.cause or "inherited"
        return Divergence(r.key, cause, r.error, loc.input_error,
                          loc.input_from, r.tolerance.rel_l2, r.basis, r.metrics,
                          paths.get(str(r.key), ()), loc.inner_error, loc.input_basis, site,
                          flip)

    ranked = sorted((x for x in records if x.introduced > 0 and not x.unattributed),
                    key=lambda x: -x.introduced)[:top]
    curve = tuple(
        LayerPoint(r.key.req, r.key.step, layer_of(r.key.module), r.key, r.error, r.cosine,
                   r.within)
        for r in diff.records
        if r.key.role == "out" and r.key.op is None and is_layer_block(r.key.module)
        and _first_slot(r.key))
    # the noise floor stands in for a referee or a control: with either, it is not needed
    sus = () if diff.golden_path is not None or noise is not None else \
        noise_floor(diff, locs, amplification)
    if intro is not None:  # after the first divergence, outliers may be its consequences
        first = (intro.key.step, intro.key.req, intro.order)
        order = {str(r.key): r.order for r in diff.records}
        sus = tuple(s for s in sus if (s.key.step, s.key.req, order[str(s.key)]) < first)
    same = 0
    for r in ordered:
        if not (r.identical or r.absorbed):
            break
        same += 1
    differs = ordered[same] if 0 < same < len(ordered) else None
    site = noise.lead if noise is not None and rflip is None else None
    return Location(divergence(intro, site, rflip), records, tuple(ranked), curve, amplification,
                    divergence(over[0] if over else None), divergence(worst), sus,
                    divergence(differs), noise, noise_like)


def _first_slot(key: RecordKey) -> bool:
    return key.slot in ("0", "hidden_states") or key.slot.split(".")[0] == "0"


def peer_gate(diff: DiffResult, locs: dict[str, RecordLocation], r: RecordDiff, *,
              factor: float | None = None, min_peers: int = NOISE_FLOOR_MIN_PEERS,
              window: int = NOISE_FLOOR_WINDOW,
              amplification: float = DEFAULT_AMPLIFICATION) -> NoiseLike | None:
    """`r` (a record over tolerance that introduces error; no control, no golden) as
    noise-like, or None when it may be named (see `_Gate`)."""
    return _Gate(diff, locs, amplification, factor=factor, min_peers=min_peers,
                 window=window)(r)


class _Gate:
    """The peer gate. Each record of `r`'s site (every request and step) is set against its
    peers (the noise floor's: same module kind, operator and slot within `window` layers, same
    request and step; at least `min_peers`): its local error over their median local error
    (floored at NOISE_FLOOR_MIN_FRACTION x the tolerance: peers that introduce nothing,
    containers whose children explain them, make no infinite ratio). Noise-like: that ratio,
    the median over the site's prefill records, and over its decode records (other kernels)
    the lower median over the requests of each request's median (`_over_requests`), are both
    at most `factor` (default PEER_GATE; PEER_GATE_ESTIMATED of estimated errors). A kernel
    fault raises every record of its site; rounding noise that pushes one record over the
    tolerance first does not (in a bf16 run of a deep model, some layer's norm always does),
    nor one request's decode token whose attention core stands out. Both phases count: a fault's
    consequences raise the local error of the layers after it at the prefill (its peers
    there), much less at a decode step. Of records whose error is an estimate (stats store:
    rel_l2 from statistics and sampled values), the lower median over all the phase's records
    (`_median`) and the smaller phase (`_over_phases`).

    A site without peers (the logits, the embeddings, the final norm: no layer, or too few
    peers) is set against what feeds it: noise-like when the median over its prefill records,
    and over its decode records, of error / what explains it (never below one rounding of the
    dtype) is at most `amplification`. One logits row amplifies its input's relative error
    several-fold by chance (measured: up to x4.5 between two correct bf16 devices on SmolLM2);
    a faulty lm_head does it in every row. A NaN / Inf that one side has and the other not, or
    a shape that differs, is never noise."""

    def __init__(self, diff: DiffResult, locs: dict[str, RecordLocation], amplification: float,
                 *, factor: float | None = None, min_peers: int = NOISE_FLOOR_MIN_PEERS,
                 window: int = NOISE_FLOOR_WINDOW):
        self.diff, self.locs, self.amp = diff, locs, amplification
        self.factor, self.min_peers, self.window = factor, min_peers, window
        self._kinds: dict[str, dict[tuple[int, int], list[tuple[str, int, float]]]] = {}
        self._sites: dict[str, list[RecordDiff]] | None = None

    def _by_step(self, kind: str) -> dict[tuple[int, int], list[tuple[str, int, float]]]:
        if kind not in self._kinds:
            by_step: dict[tuple[int, int], list[tuple[str, int, float]]] = {}
            for x in self.diff.records:
                if x.basis == "shape" or x.routing in JUDGED_ELSEWHERE or peer_kind(x.key) != kind:
                    continue
                ly = layer_of(x.key.module)
                if ly is not None:
                    by_step.setdefault((x.key.req, x.key.step), []).append(
                        (x.key.site, ly, self.locs[str(x.key)].introduced))
            self._kinds[kind] = by_step
        return self._kinds[kind]

    def __call__(self, r: RecordDiff) -> NoiseLike | None:
        if r.basis == "shape" or not math.isfinite(r.error) or (
                r.metrics is not None and r.metrics.nan_inf_mismatch):
            return None
        layer = layer_of(r.key.module)
        judged = self._peers(r, layer) if layer is not None else False
        judged = judged if judged is not False else self._own_site(r)
        if judged is None and r.basis in ESTIMATED:
            return self._bounded(r)
        return judged

    def _bounded(self, r: RecordDiff) -> NoiseLike | None:
        """An estimated record that stands out is named only when its site's rigorous lower
        bound (from statistics) exceeds what feeds it, lower median over the site's records.
        A sample of 64 fixed positions misses an input error concentrated in a few channels
        (one attention head's) in every record, while the Linear after it spreads that error
        over all its outputs: measured between two correct bf16 runs, layer 15's o_proj
        output at x4 its sampled input in all six records, x0.3-x0.7 by its bound."""
        gains = []
        for x in self._site(r):
            loc = self.locs[str(x.key)]
            if x.basis in ESTIMATED and x.stats is not None and loc.input_basis != "none":
                e = max(loc.explained, loc.rounding)
                gains.append(x.stats.rel_l2_lower_bound / e if e else math.inf)
        ratio = statistics.median_low(gains) if gains else math.inf
        if ratio > 1.0:
            return None
        loc = self.locs[str(r.key)]
        return NoiseLike(r.key, r.error, loc.introduced, max(loc.explained, loc.rounding), 0,
                         peer_kind(r.key), r.tolerance.rel_l2, ratio, len(gains), 1.0,
                         bounded=True)

    def _site(self, r: RecordDiff) -> list[RecordDiff]:
        if self._sites is None:
            self._sites = {}
            for x in self.diff.records:
                self._sites.setdefault(x.key.site, []).append(x)
        return self._sites[r.key.site]

    def _peers(self, r: RecordDiff, layer: int) -> NoiseLike | None | bool:
        """Against its peers: NoiseLike, None (stands out), False (too few peers)."""
        kind = peer_kind(r.key)
        # a local error under the noise floor's smallest judged one is no error to stand out
        floor = NOISE_FLOOR_MIN_FRACTION * r.tolerance.rel_l2
        ratios: dict[bool, dict[int, list[float]]] = {}  # phase -> request -> ratios
        first = None
        for (req, step), items in self._by_step(kind).items():
            own = [e for site, ly, e in items if site == r.key.site]
            peers = [e for site, ly, e in items
                     if site != r.key.site and abs(ly - layer) <= self.window]
            if not own or len(peers) < self.min_peers:
                continue
            med = statistics.median(peers)
            ratios.setdefault(_phase(step), {}).setdefault(req, []).append(
                own[0] / max(med, floor))
            if (req, step) == (r.key.req, r.key.step):
                first = (med, len(peers))
        if first is None:
            return False
        ratio = _over_phases([_over_requests(x, r, ph) for ph, x in ratios.items()], r)
        factor = self.factor if self.factor is not None else \
            PEER_GATE_ESTIMATED if r.basis in ESTIMATED else PEER_GATE
        if ratio > factor:
            return None
        return NoiseLike(r.key, r.error, self.locs[str(r.key)].introduced, first[0], first[1],
                         kind, r.tolerance.rel_l2, ratio,
                         sum(len(x) for q in ratios.values() for x in q.values()), factor)

    def _own_site(self, r: RecordDiff) -> NoiseLike | None:
        gains: dict[bool, list[float]] = {}
        for x in self._site(r):
            loc = self.locs[str(x.key)]
            if x.basis == "shape" or loc.input_basis == "none" or not math.isfinite(loc.gain):
                continue
            gains.setdefault(_phase(x.key.step), []).append(loc.gain)
        if not gains:
            return None
        ratio = _over_phases([_median(x, r) for x in gains.values()], r)
        if ratio > self.amp:
            return None
        loc = self.locs[str(r.key)]
        return NoiseLike(r.key, r.error, loc.introduced, max(loc.explained, loc.rounding), 0,
                         peer_kind(r.key),
                         r.tolerance.rel_l2, ratio, sum(map(len, gains.values())), self.amp)


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
    "introduced") and above `factor` x max(1, the peers' median gain), a local error (error -
    explained) above `min_fraction` x its tolerance, and a site that stands out: the median of
    that ratio over the site's records of the same phase (prefill / decode) is above `factor`
    too (one token's rounding makes an outlier record, a kernel's defect makes an outlier
    site). Fewer than `min_peers` peers: not judged. Records introduced over tolerance are left
    out: they are the first divergence."""
    groups: dict[tuple, list[tuple[RecordDiff, RecordLocation, float, int]]] = {}
    for r in diff.records:
        layer = layer_of(r.key.module)
        if r.key.role == "in" or r.basis == "shape" or layer is None \
                or r.routing in JUDGED_ELSEWHERE:
            continue
        loc = locs[str(r.key)]
        if r.shadow is not None:
            gain = r.shadow.rel_l2
        elif loc.input_basis == "none":
            continue
        else:
            gain = loc.gain
        groups.setdefault((peer_kind(r.key), r.key.req, r.key.step), []).append(
            (r, loc, gain, layer))
    # every record's gain over its peers' median, and the median of that over its site's
    # records of one phase: a kernel's defect shows in every call, one token's rounding does not
    judged: dict[str, tuple[float, float, int]] = {}  # key -> (ratio, peers' median, peers)
    by_site: dict[tuple[str, bool], list[float]] = {}
    for items in groups.values():
        for r, loc, gain, layer in items:
            peers = [g for x, _, g, ly in items
                     if x.key.site != r.key.site and abs(ly - layer) <= window]
            if len(peers) < min_peers:
                continue
            med = statistics.median(peers)
            floor = med if r.shadow is not None else max(med, 1.0)
            ratio = gain / floor if floor > 0 else math.inf if gain > 0 else 1.0
            judged[str(r.key)] = (ratio, med, len(peers))
            by_site.setdefault((r.key.site, _phase(r.key.step)), []).append(ratio)
    out = []
    for (kind, _, _), items in groups.items():
        for r, loc, gain, layer in items:
            if loc.cause == "introduced" or loc.introduced <= min_fraction * r.tolerance.rel_l2:
                continue
            if (r.shadow is None and gain <= amplification) or str(r.key) not in judged:
                continue
            ratio, med, n = judged[str(r.key)]
            if ratio > factor and \
                    _median(by_site[(r.key.site, _phase(r.key.step))], r) > factor:
                out.append(Suspicious(r.key, r.error, loc.introduced, gain, med, n, kind,
                                      r.tolerance.rel_l2, r.within))
    order = {str(r.key): r.order for r in diff.records}
    return tuple(sorted(out, key=lambda s: (s.key.step, s.key.req, order[str(s.key)])))


def _median(values: list[float], r: RecordDiff) -> float:
    """The median of a site's ratios; the lower median when `r`'s error is an estimate (stats
    store: a sample of its values): of a site's two prefill records, one whose error the
    sample overstates must not make the site stand out (measured: a dither candidate's
    down_proj input at x5.6 its input by sample, at x0.8 in the other request); a kernel fault
    raises both."""
    return statistics.median_low(values) if r.basis in ESTIMATED else \
        statistics.median(values)


def _over_requests(by_request: dict[int, list[float]], r: RecordDiff, decode: bool) -> float:
    """A site's ratio over one phase's records. At the decode steps, of exact errors (full
    store): the lower median over the requests of each request's median, so that a site
    stands out there only where it does in most requests (all of two): a decode record is one
    token, and one token's attention core can stand far over its peers in one request and not
    in the other (measured between two correct bf16 devices on SmolLM2: x19 and x36 at both
    decode steps of one request, x1.3 and x0.4 in the other; docs/control.md); a kernel fault
    raises every request's. At the prefill (a record spans the prompt) and of estimated
    records: `_median` over the phase's records, so that a fault one request's prefill meets
    alone (a prompt served in part from the prefix cache: x700 its peers, 0 in the other
    request) is still named."""
    if decode and r.basis not in ESTIMATED:
        return statistics.median_low([statistics.median(x) for x in by_request.values()])
    return _median([v for x in by_request.values() for v in x], r)


def _over_phases(medians: list[float], r: RecordDiff) -> float:
    """A site's ratio over its prefill and its decode medians: the larger (a fault may show
    at one phase only, behind raised peers at the other); of estimated records (stats store)
    the smaller: a sampled estimate of a heavy-tailed tensor (SmolLM2's down_proj input, a
    few massive channels) overstates a single-token decode record several-fold by chance
    (measured: x4-x7 at decode, x1 at the prefill of the same site, between two correct bf16
    devices); a kernel fault shows at both."""
    return min(medians) if r.basis in ESTIMATED else max(medians)


def _phase(step: int) -> bool:
    """Decode (True) or prefill (False): other kernels, other noise."""
    return step > 0


