"""What a diff of two captures returns (`accucheck.compare.diff.diff_captures`): one
`RecordDiff` per aligned key, the logits' per-position measures, the token flips, and the
`DiffResult` that holds them. Imports compare's metrics, tolerances, op alignment and routing
results; never torch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from accucheck.compare.metrics import DTYPE_EPS, TensorMetrics
from accucheck.compare.opmatch import OpAlignment
from accucheck.compare.routing import JUDGED_ELSEWHERE, RoutingResult
from accucheck.compare.tolerances import NEAR_TIE_FACTOR, Tolerance, ToleranceTable
from accucheck.keys import RecordKey
from accucheck.store import Stats

GOLDEN_LABELS = ("cand worse", "ref worse", "both within noise")
ESTIMATED = ("sample", "stats")  # the bases whose error is an estimate (the stats store)


@dataclass(frozen=True)
class StatsDelta:
    """Comparison of two index statistics rows. `rel_l2_lower_bound` is a proven lower bound on
    ||ref - cand|| / ||ref||: each of |dl2|, sqrt(n)|dmean|, sqrt(n-1)|dstd|, |dmin|, |dmax|,
    |dabsmax| is <= ||ref - cand||. Moved minima therefore count in absolute terms against the
    tensor norm, never relative to the (near-zero) minimum itself."""
    identical: bool            # same dtype, shape, checksum and statistics
    rel_l2_lower_bound: float
    bound_from: str | None     # which statistic gave the bound
    nan_inf_mismatch: int      # |dNaN count| + |dInf count| (lower bound on mismatched positions)


@dataclass(frozen=True)
class GoldenLabel:
    label: str                 # one of GOLDEN_LABELS, or "n/a" (stats only / missing in golden)
    ref_rmse: float | None
    cand_rmse: float | None
    multiplier: float


@dataclass(frozen=True)
class RecordDiff:
    """One aligned key. `error` is rel_l2 (basis "tensor"); in stats-mode captures, the larger
    of its estimate from the sampled values and its statistics lower bound (basis "sample"),
    or the lower bound alone (basis "stats", no samples stored); inf (basis "shape": shapes
    differ)."""
    key: RecordKey
    kind: str
    order: int                 # position in the reference's execution order
    ref_dtype: str
    cand_dtype: str
    ref_shape: tuple[int, ...]
    cand_shape: tuple[int, ...]
    basis: str                 # "tensor" | "sample" | "stats" | "shape"
    tolerance: Tolerance
    metrics: TensorMetrics | None = None
    stats: StatsDelta | None = None
    shadow: TensorMetrics | None = None   # candidate's shadow replay vs reference output
    golden: GoldenLabel | None = None
    cand_key: RecordKey | None = None     # op records: the candidate's key when alignment
                                          # paired another op index / op (accucheck.compare.opmatch)
    src: tuple[tuple[str, str], ...] = ()  # (input slot, producer key) links stored by the
                                           # capture (/index/extra "src"), same request/step
    control: tuple[float, ...] | None = None  # elem_error(CTL_i, REF) per control run
                                              # (--control); None: no control holds it
    absorbed: bool = False     # an op record inside a module call whose outputs are identical
                               # on both sides: op pairing across fused kernels, not an error
    routing: str | None = None  # MoE (compare.routing): "ids" (judged as routing, not numbers),
                                # "masked" (compared on the tokens routed alike), "after-flip"
                                # (follows a routing flip: different computations, not judged)
    rows_excluded: int = 0      # "masked" / "ids": token rows routed differently
    sketch: float | None = None  # stats store: the RMS elementwise relative error measured
                                 # from both sides' sketches (accucheck.store.sketch); None
                                 # where either has none (then the sample's mean_rel is used)
    ref_stats: Stats | None = field(default=None, compare=False)   # each side's index
    cand_stats: Stats | None = field(default=None, compare=False)  # statistics (store.Stats)

    def __post_init__(self) -> None:
        if self.basis not in ("tensor", "sample", "stats", "shape"):
            raise ValueError(f"bad basis {self.basis!r}")
        if (self.basis in ("tensor", "sample")) != (self.metrics is not None):
            raise ValueError("metrics go with basis 'tensor' or 'sample'")
        if (self.basis in ("sample", "stats")) != (self.stats is not None):
            raise ValueError("statistics go with basis 'sample' or 'stats'")

    @property
    def identical(self) -> bool:
        """Both sides hold the same values: same dtype and shape and, with tensors, no element
        differs; from statistics alone, the same checksum and statistics."""
        if self.basis == "shape" or self.ref_dtype != self.cand_dtype:
            return False
        if self.basis == "tensor":
            return self.metrics.max_abs == 0
        return self.stats.identical

    @property
    def error(self) -> float:
        if self.basis == "tensor":
            return self.metrics.rel_l2
        if self.basis == "sample":
            return max(self.metrics.rel_l2, self.stats.rel_l2_lower_bound)
        if self.basis == "stats":
            return self.stats.rel_l2_lower_bound
        return math.inf

    @property
    def estimated(self) -> bool:
        """The error is an estimate from sampled values or from statistics (the stats store,
        without a sketch on both sides)."""
        return self.basis in ESTIMATED and self.sketch is None

    @property
    def elem_error(self) -> float:
        """What a control run is compared by: the mean elementwise relative error
        (`TensorMetrics.mean_rel`) where the tensors were compared; in the stats store the RMS
        elementwise relative error from the sketches where both sides hold one, else the
        samples' mean_rel; else `error`."""
        if self.sketch is not None:
            return self.sketch
        if self.metrics is not None and self.metrics.mean_rel is not None:
            return self.metrics.mean_rel
        return self.error

    @property
    def cosine(self) -> float | None:
        return self.metrics.cosine if self.metrics is not None else None

    @property
    def within_tolerance(self) -> bool:
        """The tolerance's verdict alone (what `within` is without a golden referee)."""
        if self.basis == "tensor":
            return self.tolerance.within(self.metrics)
        stats_ok = (self.stats is not None and self.stats.nan_inf_mismatch == 0
                    and self.stats.rel_l2_lower_bound <= self.tolerance.rel_l2)
        if self.basis == "sample":
            return stats_ok and self.tolerance.within(self.metrics)
        return stats_ok

    @property
    def refereed(self) -> bool:
        """A golden referee judged this record (exact tensors on all three sides)."""
        return self.golden is not None and self.golden.label in GOLDEN_LABELS

    @property
    def within(self) -> bool:
        """With a golden referee: fails only when the candidate is worse than the reference
        against the golden (or NaN/Inf positions differ). Without: the tolerance decides.
        No __bool__ on purpose: a falsy record inside `x or fallback` once picked the wrong
        culprit; ask `within` explicitly."""
        if self.absorbed or self.routing in JUDGED_ELSEWHERE:
            return True
        if self.refereed and self.basis == "tensor":
            return self.golden.label != "cand worse" and not self.metrics.nan_inf_mismatch
        return self.within_tolerance

    @property
    def dtype_mismatch(self) -> bool:
        """The two sides hold this record in different floating dtypes."""
        return self.ref_dtype != self.cand_dtype and all(
            d in DTYPE_EPS for d in (self.ref_dtype, self.cand_dtype))


@dataclass(frozen=True)
class MissingKey:
    key: str
    only_in: str               # "ref" | "cand"


@dataclass(frozen=True)
class LogitsPosition:
    position: int
    kl: float
    top1_ref: int
    top1_cand: int
    top5_overlap: float
    margin: float              # reference top-1 minus top-2 logit
    noise: float               # spread of cand - ref over the reference's top logits (a
                               # near-tie: margin <= NEAR_TIE_FACTOR x noise)

    @property
    def agree(self) -> bool:
        return self.top1_ref == self.top1_cand

    @property
    def near_tie(self) -> bool:
        return self.margin <= NEAR_TIE_FACTOR * self.noise


@dataclass(frozen=True)
class LogitsStep:
    key: RecordKey
    positions: tuple[LogitsPosition, ...]

    @property
    def max_kl(self) -> float:
        return max((p.kl for p in self.positions), default=0.0)

    @property
    def top1_agreement(self) -> float:
        return sum(p.agree for p in self.positions) / len(self.positions) if self.positions else 1.0


@dataclass(frozen=True)
class TokenFlip:
    """First position whose greedy token differs. `generating`: the position whose token was
    actually emitted (the last one of its step); flips at earlier prompt positions change no
    output but show the same drift."""
    req: int
    step: int
    position: int
    ref_token: int
    cand_token: int
    margin: float | None
    noise: float | None
    generating: bool
    source: str                # "logits" (from stored logits) | "tokens" (generated ids only)

    @property
    def near_tie(self) -> bool | None:
        if self.margin is None or self.noise is None:
            return None
        return self.margin <= NEAR_TIE_FACTOR * self.noise

    @property
    def label(self) -> str:
        nt = self.near_tie
        return "unknown (no logits stored)" if nt is None else ("near-tie" if nt else "real")


@dataclass(frozen=True)
class DiffResult:
    ref_path: str
    cand_path: str
    golden_path: str | None
    records: tuple[RecordDiff, ...]          # aligned keys, reference execution order
    missing: tuple[MissingKey, ...]
    logits: tuple[LogitsStep, ...]
    first_flip: TokenFlip | None             # first differing greedy token, any position
    flips: tuple[TokenFlip, ...]             # every flip at a generating position
    compared_steps: tuple[tuple[int, int], ...]  # (req, last compared step) per request
    skipped: int                             # aligned keys not compared (beyond token divergence)
    notes: tuple[str, ...]                   # things the reader must know (said loudly)
    tolerances: ToleranceTable = field(default_factory=ToleranceTable)
    ops: OpAlignment | None = None           # op-level alignment (compare.opmatch), if any
    compute_dtypes: tuple[str | None, str | None] = (None, None)  # the runs' meta dtypes
    control_paths: tuple[str, ...] = ()      # control runs (--control), in order
    routing: RoutingResult | None = None     # MoE routing (compare.routing); None: no router
    mapping: dict | None = None              # vLLM fused records shown as transformers'
                                             # (compare.mapping): sides and table; None: none
    io: dict | None = field(default=None, compare=False)  # bytes_read, bytes_data (tensor
    # bytes read against the captures' tensor data), unread_identical (pairs measured from
    # equal content hashes), jobs (processes used), cpu_s (their CPU seconds measuring the
    # pairs) (compare.diff); how, not what: not compared

    @property
    def precision_findings(self) -> tuple[RecordDiff, ...]:
        """Records held in another floating dtype on each side while both runs compute in the
        same dtype: e.g. the candidate's softmax in float16 inside a float32 model. A finding
        in itself (a kernel downgraded precision), never a reason to loosen the tolerance."""
        a, b = self.compute_dtypes
        if a is None or a != b:
            return ()
        return tuple(r for r in self.records if r.dtype_mismatch)

    @property
    def basis(self) -> str:
        b = {r.basis for r in self.records if r.basis != "shape"}
        return b.pop() if len(b) == 1 else "mixed" if b else "none"

    @property
    def failed(self) -> tuple[RecordDiff, ...]:
        return tuple(r for r in self.records if not r.within)

    @property
    def real_flip(self) -> bool:
        """A generated token differs and it is not a near-tie (or cannot be shown to be one)."""
        return any(f.near_tie is not True for f in self.flips)

    @property
    def within(self) -> bool:
        return not self.failed and not self.real_flip and not self.real_routing_flip

    @property
    def real_routing_flip(self) -> bool:
        """A token went to other experts without being a near-tie (compare.routing)."""
        return self.routing is not None and self.routing.real_flip is not None

    def record(self, key: RecordKey | str) -> RecordDiff:
        for r in self.records:
            if str(r.key) == str(key):
                return r
        raise KeyError(str(key))
