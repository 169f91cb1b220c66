"""The verdict's records: where each record's error comes from (`RecordLocation`), the first
divergence (`Divergence`), noise-floor outliers (`Suspicious`), the first introduced record
the peer gate did not name (`NoiseLike`), the control rule's records (`RecordNoise`,
`NoiseSite`, `NoiseVerdict`), the layer curve (`LayerPoint`) and `Location`, which holds them
all. Data only: imports keys, compare.results, compare.metrics, compare.routing and
compare.tolerances (types and constants); locate makes them, culprit and the reports read
them, and neither imports the other for them. `Located` is what culprit reads: a diff and its
location (`locate.Analysis` is one).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from accucheck.compare.results import DiffResult
from accucheck.compare.metrics import TensorMetrics
from accucheck.compare.routing import RoutingFlip
from accucheck.compare.tolerances import (CONTROL_MIN_RATIO, CONTROL_MIN_RATIO_ESTIMATED,
                                          CONTROL_ORIGIN, CONTROL_ORIGIN_ESTIMATED, CONTROL_Z)
from accucheck.keys import RecordKey

INPUT_BASES = ("inputs", "links", "proxy", "shadow", "none")


@dataclass(frozen=True)
class RecordLocation:
    """Where one record's error comes from. No __bool__: ask `within` / `cause`."""
    key: RecordKey
    error: float                  # rel_l2 (or its statistics lower bound)
    input_error: float | None     # None: unknown (treated as exact)
    input_from: tuple[str, ...]   # keys whose error bounds the input error
    within: bool
    cause: str | None             # "introduced" | "inherited" | None when within tolerance
    introduced: float             # local error: shadow rel_l2, else max(0, error - explained)
    inner_error: float | None = None  # largest error among the children that feed this slot
                                      # (a slot its own code made: or their and its inputs'
                                      # absolute errors summed, over its norm, if larger)
    input_basis: str = "none"     # one of INPUT_BASES: how input_error was found
    feeders: tuple[str, ...] = ()  # every record considered as feeding it (verdict.flow)
    rounding: float = 0.0         # the error one rounding of the run's dtype makes (its unit
                                  # roundoff):
                                  # what two correct kernels may differ by with exact inputs

    @property
    def unattributed(self) -> bool:
        """An input made outside every recorded module (a narrowed --include, the model's own
        attention mask): no recorded code made it, so it is never a divergence of its own."""
        return self.key.role == "in" and self.input_basis == "none" and self.cause != "introduced"

    @property
    def explained(self) -> float:
        """The error this record's inputs and recorded children already carry."""
        return max(self.input_error or 0.0, self.inner_error or 0.0)

    @property
    def gain(self) -> float:
        """error / what explains it, never taken below one rounding of the run's dtype: the
        first record where two correct devices round differently (its input bitwise equal)
        amplifies nothing ("x inf" before)."""
        if not self.error and not self.explained:
            return 1.0  # exact and fed exactly: passes on what it gets
        e = max(self.explained, self.rounding)
        return self.error / e if e else math.inf


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
    input_basis: str = "none"
    noise: "NoiseSite | None" = None  # with control runs: the site judged more than noise
    routing: RoutingFlip | None = None  # a real MoE routing flip is the divergence (the
                                        # router's logits record, compare.routing)

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
class Suspicious:
    """A record that introduces far more error than its peers (the noise-floor rule)."""
    key: RecordKey
    error: float
    local: float                  # its local error: error - what explains it (or shadow)
    gain: float                   # error / what explains it (shadow error with --shadow)
    peers_median: float           # the same measure's median over its peers
    peers: int                    # peer records (same kind, nearby layers, same req/step)
    kind: str                     # the peer group: site with layer numbers wildcarded
    tolerance: float
    within: bool                  # within tolerance (else it is also over tolerance)

    @property
    def ratio(self) -> float:
        """gain / the peers' median gain (floored at 1 without shadow records)."""
        return self.gain / self.peers_median if self.peers_median > 0 else math.inf


@dataclass(frozen=True)
class NoiseLike:
    """The first record over tolerance that introduces error, when its site introduces no more
    than `gate` x what its peers do (no control, no golden referee; verdict.locate's peer
    gate): rounding noise of the dtype, or a defect shared by every module of its kind; no
    culprit is named for it."""
    key: RecordKey
    error: float
    local: float                  # its local error (RecordLocation.introduced)
    peers_median: float           # its peers' median local error (same request and step)
    peers: int
    kind: str
    tolerance: float
    ratio: float                  # its site's local error / its peers', median over `records`
                                  # (verdict.locate's _over_requests, _over_phases)
    records: int                  # the site's records with enough peers
    # the ratio above which it would be named: PEER_GATE (PEER_GATE_ESTIMATED of estimated
    # errors); a site without peers (peers == 0) is judged against what feeds it: `ratio` is
    # then the median of error / what explains it, and `gate` the amplification it stays within
    gate: float | None = None
    # estimates only (stats store): the site stands out in sampled estimates, but `ratio` is
    # the lower median of its statistics' lower bound over what feeds it, at most `gate` = 1
    bounded: bool = False

    @property
    def reason(self) -> str:
        """Why it is not named, in a few words for the reports."""
        if self.bounded:
            return (f"a site that stands out in sampled estimates only: its error's lower "
                    f"bound from statistics is x{self.ratio:.2g} what feeds it, median over "
                    f"its {self.records} request(s) and step(s) (a culprit's is more)")
        if self.peers == 0:
            return (f"a site without peers that amplifies what feeds it x{self.ratio:.2g}, "
                    f"median over its {self.records} request(s) and step(s) (a culprit does "
                    f"it in every one: > x{self.gate:g})")
        return (f"a site that introduces {self.ratio:.2g}x what its peers ({self.kind}) do, "
                f"median over its requests (a culprit stands out: > {self.gate:g}x)")


@dataclass(frozen=True)
class RecordNoise:
    """One record against the control runs."""
    key: RecordKey
    error: float          # the candidate's elem_error
    expected: float       # the controls' mean elem_error
    spread: tuple[float, float]  # the controls' smallest and largest elem_error
    ratio: float          # error / expected (both floored)
    input_ratio: float    # the largest ratio among what feeds it (1.0: nothing known)

    @property
    def excess(self) -> float:
        return self.ratio / max(1.0, self.input_ratio)


@dataclass(frozen=True)
class NoiseSite:
    """One site (a record key without request and step) over all its records."""
    site: str
    kind: str             # verdict.locate.peer_kind of its records
    key: RecordKey        # the record named (see the module docstring)
    excess: float         # geometric mean of its records' excess, the largest left out
    records: int
    location: float       # its kind's log excess: median (capped at 0), and spread
    spread: float
    peers: int            # sites of its kind, itself included
    flagged: bool
    min_ratio: float = CONTROL_MIN_RATIO  # the least excess that is more than noise
    disagreement: float = 1.0  # how far the control runs disagree here (verdict.noise
    # ._disagreement: the standard error of their mean, as a factor; 1 with one control run):
    # the threshold widens by it

    @property
    def z(self) -> float:
        return (math.log(self.excess) - self.location) / self.spread if self.excess > 0 \
            else -math.inf

    @property
    def threshold(self) -> float:
        """The excess above which this site is more than noise."""
        return max(math.exp(self.location + CONTROL_Z * self.spread), self.min_ratio) \
            * self.disagreement

    @property
    def origin(self) -> float:
        """The fraction of its threshold at which this site is the origin of a site more than
        noise that it feeds (verdict.noise.origin): wider where its errors are estimates."""
        return CONTROL_ORIGIN_ESTIMATED if self.min_ratio >= CONTROL_MIN_RATIO_ESTIMATED \
            else CONTROL_ORIGIN


@dataclass(frozen=True)
class NoiseVerdict:
    controls: tuple[str, ...]
    records: tuple[RecordNoise, ...]     # diff order, records a control holds
    sites: tuple[NoiseSite, ...]         # largest z first
    flagged: tuple[NoiseSite, ...]       # forward-pass order of the sites
    # the divergence: flagged[0], or the site upstream of it in its layer that feeds it and is
    # within its `origin` fraction of its own threshold, or stands CONTROL_Z over its kind
    # (verdict.noise.origin); None: nothing flagged
    lead: NoiseSite | None = None
    lead_of: NoiseSite | None = None     # the flagged site `lead` is the origin of, if another

    def record(self, key: RecordKey | str) -> RecordNoise | None:
        k = str(key)
        return next((r for r in self.records if str(r.key) == k), None)


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
    first_divergence: Divergence | None   # first introduced record over tolerance; else None
    records: tuple[RecordLocation, ...]   # same order as DiffResult.records
    top: tuple[RecordLocation, ...]       # largest introduced error first (over zero only)
    curve: tuple[LayerPoint, ...]         # decoder-layer outputs per request and step
    amplification: float
    first_over: Divergence | None = None  # first record over tolerance (introduced or not)
    worst: Divergence | None = None       # largest error / tolerance among those over
    suspicious: tuple[Suspicious, ...] = ()  # noise-floor outliers, execution order
    # the first record whose values differ, when records before it are identical (eager vs
    # graph: where the compiled program starts to compute otherwise); within tolerance too
    first_difference: Divergence | None = None
    noise: NoiseVerdict | None = None     # the control rule (verdict.noise), with --control
    # no control, no golden: the first record to introduce error, not named because it
    # introduces no more than its peers do (verdict.locate's peer gate)
    noise_like: NoiseLike | None = None

    @property
    def diffuse(self) -> bool:
        """Records are over tolerance, but no record is named: none introduces the error
        (inherited / gradual), or the first that does is `noise_like`. Never with control
        runs: there the control rule decides, not the tolerance."""
        return self.first_divergence is None and self.first_over is not None \
            and self.noise is None

    @property
    def no_culprit_reason(self) -> str:
        """Why a diffuse failure names no culprit, in a few words for the reports."""
        n = self.noise_like
        if n is None:
            return "diffuse / inherited"
        return f"noise-like: the first record to introduce error, {n.key}, is at {n.reason}"


class Located(Protocol):
    """A diff and its location (`accucheck.verdict.locate.Analysis`): what find_culprit reads."""
    diff: DiffResult
    location: Location
