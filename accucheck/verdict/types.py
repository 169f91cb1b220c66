"""The verdict's records: where each record's error comes from (`RecordLocation`), the first
divergence (`Divergence`), noise-floor outliers (`Suspicious`), the layer curve (`LayerPoint`)
and `Location`, which holds them all. Data only: imports keys, compare.diff and compare.metrics
(types); locate makes them, culprit and the reports read them, and neither imports the other
for them. `Located` is what culprit reads: a diff and its location (`locate.Analysis` is one).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from accucheck.compare.diff import DiffResult
from accucheck.compare.metrics import TensorMetrics
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
    inner_error: float | None = None  # largest error among recorded children (containers)
    input_basis: str = "none"     # one of INPUT_BASES: how input_error was found

    @property
    def explained(self) -> float:
        """The error this record's inputs and recorded children already carry."""
        return max(self.input_error or 0.0, self.inner_error or 0.0)


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

    @property
    def diffuse(self) -> bool:
        """Records are over tolerance, but none introduces the error (inherited / gradual)."""
        return self.first_divergence is None and self.first_over is not None


class Located(Protocol):
    """A diff and its location (`accucheck.verdict.locate.Analysis`): what find_culprit reads."""
    diff: DiffResult
    location: Location
