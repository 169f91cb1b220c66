"""Tolerances as data: a dtype-keyed default table, per-key overrides. Imports errors, keys, metrics.

The tensor-level criterion is the relative L2 error ||ref - cand|| / ||ref|| of a record: one
number per tensor that neither a single near-zero element (max relative error) nor a moved
minimum can blow up. A record is within tolerance when

    rel_l2 <= tol.rel_l2   and   no NaN/Inf position differs
    and, only when rtol/atol were given, every element satisfies |ref - cand| <= atol + rtol*|ref|

The dtype that picks the row is the LOOSEST of the two captures' compute dtypes (meta "dtype"),
not of the record pair: a float32 logits tensor of a bfloat16 model is judged as bfloat16, a
float32-vs-bfloat16 run pair as bfloat16 (a whole-run dtype difference sets the tolerance, it is
not an error), and a record that the candidate computes in float16 inside a float32 model is
judged at float32 (and reported as a precision finding, compare.diff). Integer / bool records
are exact; captures without a meta dtype fall back to the record dtypes.

Calibration of DEFAULT_REL_L2 (tests/test_tolerances.py re-measures it on the tiny model):
- float32: 5e-5. Measured on the tiny Llama (4 layers, 2 prompts, 3 decode steps, every
  record): fp32 noise - a one-ULP dither of the rounding ops, or fp32 vs a float64 run - stays <= 1.9e-6 (25x
  below); rounding ONE RMSNorm output through bfloat16 gives rel_l2 1.7e-3 (33x above; bf16
  rounding is a uniform half-ULP error, ulp/|x| in (2^-8, 2^-7]); an MLP whose SiLU uses a
  float16 sigmoid gives 1.8e-4 (3.6x above).
- bfloat16: 5e-2, float16: 1e-2. Whole-model float32-vs-bfloat16 on the tiny Llama peaks at
  rel_l2 3.0e-2 (float16: 4.6e-3); bf16-vs-bf16 with another attention kernel (eager vs sdpa)
  peaks at 2.7e-2. Deep models grow errors with depth: override per key when needed.
- float64: 1e-10 (pure reordering noise is ~1e-15).
Integer / bool records must match exactly (rel_l2 0).
"""
from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from accucheck.errors import EXIT_USAGE, UserError
from accucheck.keys import RecordKey
from accucheck.compare.metrics import DTYPE_EPS, TensorMetrics

DEFAULT_REL_L2: dict[str, float] = {
    "float64": 1e-10,
    "float32": 5e-5,
    "float16": 1e-2,
    "bfloat16": 5e-2,
    "float8_e4m3fn": 0.25,
    "float8_e5m2": 0.4,
}
EXACT_REL_L2 = 0.0  # integer / bool / unknown dtypes

# Three-way referee (torch._dynamo `same()` spirit): a side is worse when its RMSE to the golden
# exceeds the other's by this multiplier (plus a noise floor, see accucheck.compare.diff).
GOLDEN_MULTIPLIER = {"float64": 2.0, "float32": 2.0, "float16": 3.0, "bfloat16": 3.0}
# Locate: an output error this many times its input error is "introduced here".
DEFAULT_AMPLIFICATION = 4.0
# Noise floor (verdict.locate.noise_floor, no golden referee): a record is "suspicious" when
# it amplifies its input error more than DEFAULT_AMPLIFICATION and more than FACTOR x the median
# amplification of its peers (same module kind, op and slot within WINDOW layers, same request
# and step; at least MIN_PEERS of them), with a local error above MIN_FRACTION x its tolerance.
# Calibration on SmolLM2-135M (30 layers), float32 vs bfloat16: the largest natural ratio to
# the peers' median is 2.2 (tests/test_real_model.py re-measures it).
NOISE_FLOOR_FACTOR = 5.0
# Peer gate (verdict.locate.peer_gate, no control and no golden referee): the first record over
# tolerance that introduces error is named a culprit only when its site stands out: its local
# error / its peers' median local error (the noise floor's peers, at least
# NOISE_FLOOR_MIN_PEERS; floored at NOISE_FLOOR_MIN_FRACTION x the tolerance), the median over
# the prefill records, at the decode steps the lower median over the requests of each
# request's median (estimated errors: the lower median over each phase's records), the larger
# phase (estimated: the smaller), is above PEER_GATE (PEER_GATE_ESTIMATED); else it is
# noise-like and no culprit is named. First chosen from
# float32 vs bfloat16 SmolLM2 (bench/bench_control.py): clean sites at most 3.2x, a planted
# norm fault at x2 its natural noise at 3.9-8.7x. Against emulated correct devices
# (bench/bench_devices.py, full store) an attention core stood over 4x its peers at decode in
# one request in 3 of 568 clean diffs (x8-x36 there, x0-x1.3 in the other request; 5.03 at
# most, a prefill median, under this measure): hence the per-request median at decode and 5.5
# for exact errors (docs/control.md, "The peer gate per request"). The stats store's
# estimates raised no such alarm.
PEER_GATE = 5.5
PEER_GATE_ESTIMATED = 4.0
# Control rule (verdict.noise, with --control): a site (a record key without request and
# step) is "more than noise" when the geometric mean over its records (the largest left out of
# three or more) of its excess ratio
# (its error / the control's, over what feeds it) stands CONTROL_Z spreads above its kind's
# location (the same module kind within CONTROL_WINDOW layers: their median log excess, capped
# at 0 so a fault in every layer still shows; the spread from the steps between consecutive
# layers) and is at least CONTROL_MIN_RATIO (CONTROL_MIN_RATIO_ESTIMATED where the errors are
# estimated from 64 sampled values, the stats store: two dithered bf16 runs differed by x1.16
# at layer 0's norm, fed exactly, over six records of SmolLM2; docs/control.md). A kind with fewer than CONTROL_MIN_PEERS sites
# (logits, rotary, the final norm) uses CONTROL_PEERLESS_SPREAD; no spread is taken below
# CONTROL_SPREAD_FLOOR. An error below
# CONTROL_ERROR_FLOOR x the record's tolerance is never more than noise. Chosen from the
# false-alarm / power table of bench/bench_control.py (docs/control.md).
CONTROL_Z = 5.0
CONTROL_MIN_RATIO = 1.15
CONTROL_MIN_RATIO_ESTIMATED = 1.3
CONTROL_MIN_PEERS = 5
CONTROL_WINDOW = 4
CONTROL_SPREAD_FLOOR = 0.03
CONTROL_PEERLESS_SPREAD = 0.1
CONTROL_ERROR_FLOOR = 0.01
# a site upstream of the first one more than noise, in its layer, that feeds it and stands at
# least this fraction of its own threshold (or CONTROL_Z spreads over its kind with an excess of
# at least this fraction of 1) is named as the origin (verdict.noise.origin)
CONTROL_ORIGIN = 0.9
# ... and this fraction where the site's errors are sampled estimates (stats store): a SiLU fault
# inside the npu device at x2 its noise stood at 0.88 of its threshold (its estimates vary
# more), the down_proj it feeds over its own, and the down_proj was named; of down_proj faults,
# the act_fn of their layer stood at 0.33-0.61 of it (bench/bench_devices.py)
CONTROL_ORIGIN_ESTIMATED = 0.8
# A token flip is a near-tie when the reference's top-1 / top-2 margin is at most this many
# times the logit noise (compare.metrics.logit_noise: the spread of cand - ref over the
# reference's top-32 logits around their mean, the two top-1 tokens left out): the flip needs
# d(top-2) - d(top-1) > margin. Measured (bench/bench_devices.py, SmolLM2, top-32
# log-probabilities of the emulated gpu, npu, mixed and dithered devices against float32 and
# bfloat16 references and against a dithered bfloat16 run, 100 pairs of 2 prompts, 1,200
# diffs): 1,445 flips between correct runs, the margin over x3 the noise in 43, x4 in 7, x5 in
# 1, the largest x6.05; each half-step of the factor divides the count by about 2.5, so x8
# leaves about 1 in 100,000 such flips "real". The tokens that trade places are the largest
# logits, whose rounding errors are larger than the rest of the top's (the tail is heavier
# than a Gaussian's); counted in the noise instead, the largest was x4.23, but a fault that
# moves one logit could never make a real flip (compare.metrics.spread_without_tops). The
# factor was 3 over the vocabulary's spread, which judged 6 of 400 clean no-control diffs of
# the stats store with top-32 logits "real flips".
NEAR_TIE_FACTOR = 8.0
NOISE_FLOOR_MIN_FRACTION = 0.05
NOISE_FLOOR_MIN_PEERS = 3
NOISE_FLOOR_WINDOW = 4


def loosest_dtype(dtypes: Iterable[str | None]) -> str:
    """The lowest-precision float dtype among `dtypes` ("int64" etc. count as exact)."""
    best, eps = "int64", -1.0
    for d in dtypes:
        if d is None:
            continue
        e = DTYPE_EPS.get(d, 0.0)
        if e > eps:
            best, eps = d, e
    return best


@dataclass(frozen=True)
class Tolerance:
    """Criterion for one record. rtol/atol: both or neither (elementwise check on top)."""
    rel_l2: float
    rtol: float | None = None
    atol: float | None = None
    source: str = "default"  # "default float32", "override *mlp*", ... (for reports)

    def __post_init__(self) -> None:
        if (self.rtol is None) != (self.atol is None):
            raise UserError("give --rtol and --atol together, or neither", EXIT_USAGE)
        for name in ("rel_l2", "rtol", "atol"):
            v = getattr(self, name)
            if v is not None and (not math.isfinite(v) or v < 0):
                raise UserError(f"tolerance {name}={v} must be a finite number >= 0", EXIT_USAGE)

    def within(self, m: TensorMetrics) -> bool:
        if m.nan_inf_mismatch:
            return False
        if m.rel_l2 > self.rel_l2:
            return False
        return not (self.rtol is not None and m.mismatched)

    def as_dict(self) -> dict:
        return {"rel_l2": self.rel_l2, "rtol": self.rtol, "atol": self.atol,
                "source": self.source}


@dataclass(frozen=True)
class ToleranceTable:
    """Dtype-keyed defaults plus glob overrides (the LAST matching override wins).

    An override pattern is matched (fnmatch, case-sensitive) against the full key
    ("r0.s1:model.layers.0.mlp#0:out.0"), the key without request/step ("model.layers.0.mlp#0:
    out.0") and the module path ("model.layers.0.mlp"), so "*.mlp" and "model.norm" just work.
    """
    by_dtype: tuple[tuple[str, float], ...] = tuple(DEFAULT_REL_L2.items())
    rtol: float | None = None
    atol: float | None = None
    overrides: tuple[tuple[str, Tolerance], ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        Tolerance(0.0, self.rtol, self.atol)  # both-or-neither check

    def for_record(self, key: RecordKey, dtypes: Sequence[str | None]) -> Tolerance:
        for pattern, tol in reversed(self.overrides):
            if _matches(pattern, key):
                return tol
        d = loosest_dtype(dtypes)
        table = dict(self.by_dtype)
        rel = table.get(d, EXACT_REL_L2)
        return Tolerance(rel, self.rtol, self.atol, source=f"default {d}")

    def as_dict(self) -> dict:
        return {"rel_l2_by_dtype": dict(self.by_dtype), "rtol": self.rtol, "atol": self.atol,
                "overrides": [{"pattern": p, **t.as_dict()} for p, t in self.overrides]}

    @classmethod
    def from_options(cls, *, rel_l2: float | None = None, rtol: float | None = None,
                     atol: float | None = None, overrides: Sequence[str] = ()
                     ) -> "ToleranceTable":
        """Build from CLI-style options. `rel_l2` replaces every dtype's default; each override
        is "PATTERN=SPEC" with SPEC "1e-3" (rel_l2), or comma-separated rel_l2:X, rtol:X,
        atol:X. Raises UserError (exit 2) for malformed input."""
        if (rtol is None) != (atol is None):
            raise UserError("give --rtol and --atol together, or neither", EXIT_USAGE)
        by_dtype = dict(DEFAULT_REL_L2)
        if rel_l2 is not None:
            by_dtype = {d: float(rel_l2) for d in by_dtype}
        table = cls(tuple(by_dtype.items()), rtol, atol)
        ov = tuple(parse_override(s, table) for s in overrides)
        return cls(tuple(by_dtype.items()), rtol, atol, ov)


def _matches(pattern: str, key: RecordKey) -> bool:
    return any(fnmatch.fnmatchcase(t, pattern) for t in (str(key), key.site, key.module))


def parse_override(spec: str, base: ToleranceTable | None = None) -> tuple[str, Tolerance]:
    """"PATTERN=SPEC" -> (pattern, Tolerance). Unset rtol/atol inherit the table's; an unset
    rel_l2 means "no tensor-level limit beyond the elementwise one" only when rtol/atol are set,
    else it is an error."""
    pattern, sep, rhs = spec.rpartition("=")
    if not sep or not pattern or not rhs:
        raise UserError(f"bad tolerance override {spec!r}: use PATTERN=REL_L2 or "
                        f"PATTERN=rel_l2:X,rtol:X,atol:X (e.g. '*.mlp=rel_l2:1e-3')", EXIT_USAGE)
    vals: dict[str, float] = {}
    for part in rhs.split(","):
        name, colon, num = part.partition(":")
        if not colon:
            name, num = "rel_l2", part
        name = name.strip()
        if name not in ("rel_l2", "rtol", "atol"):
            raise UserError(f"bad tolerance override {spec!r}: unknown field {name!r} "
                            f"(use rel_l2, rtol, atol)", EXIT_USAGE)
        try:
            vals[name] = float(num)
        except ValueError:
            raise UserError(f"bad tolerance override {spec!r}: {num!r} is not a number",
                            EXIT_USAGE) from None
    if ("rtol" in vals) != ("atol" in vals):
        raise UserError(f"bad tolerance override {spec!r}: give rtol and atol together, or "
                        f"neither", EXIT_USAGE)
    rtol = vals.get("rtol", base.rtol if base else None)
    atol = vals.get("atol", base.atol if base else None)
    if "rel_l2" not in vals and rtol is None:
        raise UserError(f"bad tolerance override {spec!r}: set rel_l2 or rtol+atol", EXIT_USAGE)
    rel = vals.get("rel_l2", math.inf if "rel_l2" not in vals else 0.0)
    if not math.isfinite(rel):
        rel = 1e300  # no tensor-level limit: only the elementwise one
    return pattern, Tolerance(rel, rtol, atol, source=f"override {pattern}")
