"""Error metrics: tiny pure float64 functions plus one chunked accumulator. Imports numpy only.

Conventions (a = reference, b = candidate, both any shape, compared flat):

- Elementwise metrics look only at positions where BOTH sides are finite; NaN / Inf positions
  that differ are counted by `nan_inf_mismatch` and judged on their own.
- Relative error of one element: |a - b| / |a|; 0 where a == b (also 0 == 0), inf where a == 0
  and b != 0. So `max_rel` is dominated by near-zero reference elements: report it, never judge a
  tensor by it (the tensor-level criterion is `rel_l2`, see accucheck.compare.tolerances).
- `rel_l2` = ||a - b|| / ||a||; `cosine` = a.b / (||a|| ||b||) (1.0 for two zero tensors);
  `sqnr_db` = 10 log10(||a||^2 / ||a - b||^2) (inf when identical); `rmse` = ||a - b|| / sqrt(n).
- `max_ulp`: largest distance in units in the last place of the COARSER dtype of the pair (values
  of the finer side are rounded to nearest-even into it first), so a float32 reference and its
  own bfloat16 rounding are 0 ULP apart. None for non-float dtypes.
- `frac_rel_below(a, b, 1e-3)`: fraction (0..1) of elements with relative error < 1e-3 (the
  "thousandth" ratio); 1.0 for an empty tensor.
- `mean_rel(a, b, scale)`: the mean elementwise relative error with |a| floored at
  REL_FLOOR x `scale` (the reference's RMS): every element counts once, so neither a few huge
  elements (the massive activations that dominate `rel_l2` of a residual stream) nor
  near-zero ones dominate it. What the control rule (accucheck.verdict.noise) compares: its
  ratio between two runs of the same precision is far steadier than rel_l2's. For logits
  (`MetricAccumulator(row=vocab)`) it is taken up to a constant per row: each row's mean
  difference is removed and |a| is centred, since a softmax ignores a shift of every logit.
  Two correct bf16 devices shift a decode row's logits by 0.04-0.5 (the final norm's error
  along lm_head's mean row); that shift alone moved a single-token row's mean_rel x1-x4.7
  between two runs of one device (bench/bench_devices.py, docs/control.md).

`MetricAccumulator` is the only plumbing: feed it aligned flat chunks, it keeps a few float64
sums and maxima, so memory is bounded by the chunk size whatever the tensor size.

Logits metrics (rows = positions, columns = vocabulary) are pure functions too: `kl_div`,
`top1_agree`, `topk_overlap`, `top2_margin`, `logit_noise`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# Machine epsilon per torch dtype name: orders dtypes from fine to coarse.
DTYPE_EPS = {
    "float64": 2.0 ** -52, "float32": 2.0 ** -23, "float16": 2.0 ** -10,
    "bfloat16": 2.0 ** -7, "float8_e4m3fn": 2.0 ** -3, "float8_e5m2": 2.0 ** -2,
}
_ULP_DTYPES = ("float64", "float32", "float16", "bfloat16")
_BLOCK = 1 << 16  # elements per inner block of MetricAccumulator.add
REL_FLOOR = 0.1   # mean_rel: |ref| is floored at this fraction of the reference's RMS


def is_float_dtype(dtype: str) -> bool:
    return dtype in DTYPE_EPS


def coarser_dtype(a: str, b: str) -> str:
    """The lower-precision of two torch dtype names (non-float dtypes count as exact, finest)."""
    ea, eb = DTYPE_EPS.get(a, 0.0), DTYPE_EPS.get(b, 0.0)
    return a if ea >= eb else b


# ----------------------------------------------------------------------------- pure functions

def _dot(x: np.ndarray, y: np.ndarray) -> float:
    """Sum of products without BLAS: OpenBLAS threads on many small vectors stall on a busy
    machine (measured 10-100x slower with 2 shared cores); einsum's own loop does not."""
    return float(np.einsum("i,i->", x, y))


def _f64(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float64).reshape(-1)


def _finite_pair(a, b) -> tuple[np.ndarray, np.ndarray]:
    a, b = _f64(a), _f64(b)
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {a.shape} vs {b.shape}")
    m = np.isfinite(a) & np.isfinite(b)
    if m.all():
        return a, b
    return a[m], b[m]


def max_abs(a, b) -> float:
    a, b = _finite_pair(a, b)
    return float(np.max(np.abs(a - b))) if a.size else 0.0


def mean_abs(a, b) -> float:
    a, b = _finite_pair(a, b)
    return float(np.mean(np.abs(a - b))) if a.size else 0.0


def _rel(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    d = np.abs(a - b)
    with np.errstate(divide="ignore", invalid="ignore"):
        r = d / np.abs(a)
    r[d == 0] = 0.0
    return r


def max_rel(a, b) -> float:
    a, b = _finite_pair(a, b)
    return float(np.max(_rel(a, b))) if a.size else 0.0


def frac_rel_below(a, b, threshold: float) -> float:
    a, b = _finite_pair(a, b)
    return float(np.mean(_rel(a, b) < threshold)) if a.size else 1.0


def mean_rel(a, b, scale: float) -> float:
    a, b = _finite_pair(a, b)
    if not a.size:
        return 0.0
    return float(np.mean(np.abs(a - b) / (np.abs(a) + REL_FLOOR * scale))) if scale > 0 \
        else (0.0 if np.array_equal(a, b) else math.inf)


def rel_l2(a, b) -> float:
    a, b = _finite_pair(a, b)
    return _rel_l2_from(float(_dot(a - b, a - b)), float(_dot(a, a)))


def cosine(a, b) -> float:
    a, b = _finite_pair(a, b)
    return _cosine_from(float(_dot(a, a)), float(_dot(b, b)), float(_dot(a - b, a - b)))


def sqnr_db(a, b) -> float:
    a, b = _finite_pair(a, b)
    return _sqnr_from(float(_dot(a - b, a - b)), float(_dot(a, a)))


def rmse(a, b) -> float:
    a, b = _finite_pair(a, b)
    return math.sqrt(float(_dot(a - b, a - b)) / a.size) if a.size else 0.0


def nan_inf_mismatch(a, b) -> int:
    """Positions where NaN-ness or the signed infinity differs between the two sides."""
    a, b = _f64(a), _f64(b)
    na, nb = np.isnan(a), np.isnan(b)
    ia, ib = np.isinf(a), np.isinf(b)
    bad = (na != nb) | (ia != ib) | (ia & ib & (np.sign(a) != np.sign(b)))
    return int(np.count_nonzero(bad))


def max_ulp(a, b, dtype: str) -> int | None:
    """Largest ULP distance between a and b, counted in `dtype` (None for non-float dtypes)."""
    if dtype not in _ULP_DTYPES:
        return None
    a, b = _finite_pair(a, b)
    if not a.size:
        return 0
    return int(np.max(np.abs(np.subtract(_ordered(a, dtype), _ordered(b, dtype),
                                         dtype=np.int64))))


def _ordered(x: np.ndarray, dtype: str) -> np.ndarray:
    """Map finite floats to integers such that neighbouring representable values of `dtype`
    differ by 1 (+0 and -0 both map to 0), after rounding to nearest even into `dtype`.
    int64 for float64 (exact up to 2**63; distances are taken in int64), int32 otherwise."""
    if dtype == "float64":
        i = np.asarray(x, dtype=np.float64).view(np.int64)
        s = i >> 63                                   # 0 or -1
        return (i ^ (s & np.int64(0x7FFFFFFFFFFFFFFF))) - s
    if dtype == "float16":
        i = np.asarray(x).astype(np.float16).view(np.int16).astype(np.int32)
        s = i >> 15
        return (i ^ (s & 0x7FFF)) - s
    f = np.asarray(x)
    if f.dtype != np.float32:
        f = f.astype(np.float32)
    if dtype == "bfloat16":  # round to nearest even into the top 16 bits
        u = f.view(np.uint32)
        r = ((u + ((u >> 16) & 1) + np.uint32(0x7FFF)) >> 16).view(np.int32)
        s = r >> 15                                   # sign: 0 or 1
        return ((r & 0x7FFF) ^ -s) + s
    i = f.view(np.int32)
    s = i >> 31
    return (i ^ (s & np.int32(0x7FFFFFFF))) - s


def _rel_l2_from(dd: float, aa: float) -> float:
    if dd == 0.0:
        return 0.0
    return math.sqrt(dd / aa) if aa > 0 else math.inf


def _cosine_from(aa: float, bb: float, dd: float) -> float:
    if aa == 0.0 and bb == 0.0:
        return 1.0
    if aa == 0.0 or bb == 0.0:
        return 0.0
    # a.b from the norms: exact to float64 even when 1 - cos is far below float32 epsilon.
    ab = 0.5 * (aa + bb - dd)
    return max(-1.0, min(1.0, ab / math.sqrt(aa * bb)))


def _sqnr_from(dd: float, aa: float) -> float:
    if dd == 0.0:
        return math.inf
    if aa == 0.0:
        return -math.inf
    return 10.0 * math.log10(aa / dd)


# ----------------------------------------------------------------------------- accumulator

@dataclass(frozen=True)
class TensorMetrics:
    """Metrics of one aligned pair of tensors (reference vs candidate)."""
    numel: int
    max_abs: float
    mean_abs: float
    max_rel: float
    rel_l2: float
    cosine: float
    sqnr_db: float
    rmse: float
    max_ulp: int | None
    ulp_dtype: str | None
    frac_rel_lt_1e3: float
    frac_rel_lt_5e3: float
    nan_inf_mismatch: int
    worst_index: int | None      # flat index of the largest absolute error
    worst_ref: float | None
    worst_cand: float | None
    mismatched: int | None = None  # elements outside atol + rtol*|ref|, when rtol/atol given
    mean_rel: float | None = None  # see `mean_rel`; None when no scale was given

    @property
    def identical(self) -> bool:
        return self.max_abs == 0.0 and self.nan_inf_mismatch == 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class MetricAccumulator:
    """Chunked computation of `TensorMetrics`: `add(ref_chunk, cand_chunk)` with aligned flat
    chunks (any float or int dtype, bfloat16 already decoded to float32), then `result()`.

    Memory is a few temporaries of one chunk. `ref_dtype` / `cand_dtype` are the torch dtype
    names as captured: they choose the ULP dtype. `rtol` / `atol` (both or neither) add a count
    of elements outside atol + rtol * |ref|. `scale` (the reference's RMS, known before the
    first chunk: from its index statistics) adds `mean_rel`; with `row` (logits: rows of `row`
    elements, `scale` then the reference's standard deviation) `mean_rel` is taken up to a
    constant per row (see the module docstring).
    """

    def __init__(self, ref_dtype: str, cand_dtype: str, *, rtol: float | None = None,
                 atol: float | None = None, scale: float | None = None,
                 row: int | None = None):
        if (rtol is None) != (atol is None):
            raise ValueError("rtol and atol go together")
        self.rtol, self.atol = rtol, atol
        self.floor = None if scale is None or not math.isfinite(scale) else REL_FLOOR * scale
        self.row = row if row and row > 0 else None
        self._sum_rel = 0.0
        u = coarser_dtype(ref_dtype, cand_dtype)
        self.ulp_dtype = u if u in _ULP_DTYPES and is_float_dtype(ref_dtype) \
            and is_float_dtype(cand_dtype) else None
        self._n = 0            # elements seen
        self._nf = 0           # finite-pair elements
        self._dd = self._aa = self._bb = 0.0
        self._sum_abs = 0.0
        self._max_abs = -1.0
        self._worst: tuple[int, float, float] | None = None
        self._max_rel = 0.0
        self._lt1 = self._lt5 = 0
        self._ulp = 0
        self._naninf = 0
        self._mismatched = 0

    def add(self, a: np.ndarray, b: np.ndarray, positions: np.ndarray | None = None) -> None:
        """`positions`: the chunk's elements' flat positions in the tensor (a sample's), for
        logits' rows; by default the chunk follows the previous one."""
        a = np.asarray(a).reshape(-1)
        b = np.asarray(b).reshape(-1)
        if a.shape != b.shape:
            raise ValueError(f"chunk sizes differ: {a.size} vs {b.size}")
        offset = self._n
        self._n += a.size
        if self.row is not None and self.floor is not None:
            at = np.arange(offset, offset + a.size) if positions is None \
                else np.asarray(positions).reshape(-1)
            self._sum_rel += _shift_free_rel(a, b, at // self.row, self.floor)
        # Work in cache-sized blocks: temporaries stay small (no page faults, L2-resident).
        for i in range(0, a.size, _BLOCK):
            self._add_block(a[i:i + _BLOCK], b[i:i + _BLOCK], offset + i)

    def _add_block(self, a: np.ndarray, b: np.ndarray, offset: int) -> None:
        if not a.size:
            return
        a64 = a.astype(np.float64)
        b64 = b.astype(np.float64)
        with np.errstate(invalid="ignore", over="ignore"):
            d = a64 - b64
            dd = float(_dot(d, d))
        idx = None
        if not math.isfinite(dd):  # NaN / Inf somewhere (or overflow): mask, then recompute
            fin = np.isfinite(a64) & np.isfinite(b64)
            self._naninf += nan_inf_mismatch(a64, b64)
            idx = np.flatnonzero(fin)
            a64, b64, a, b = a64[idx], b64[idx], a[idx], b[idx]
            if not a64.size:
                return
            d = a64 - b64
            dd = float(_dot(d, d))
        self._nf += a64.size
        self._dd += dd
        self._aa += float(_dot(a64, a64))
        self._bb += float(_dot(b64, b64))
        np.abs(d, out=d)
        self._sum_abs += float(d.sum())
        j = int(np.argmax(d))
        if d[j] > self._max_abs:
            self._max_abs = float(d[j])
            self._worst = (offset + (int(idx[j]) if idx is not None else j),
                           float(a[j]), float(b[j]))
        if d[j] == 0.0:  # identical chunk
            self._lt1 += a64.size
            self._lt5 += a64.size
            return
        absa = np.abs(a64, out=a64)
        if self.floor is not None and self.row is None:
            self._sum_rel += float((d / (absa + self.floor)).sum()) if self.floor > 0 \
                else math.inf
        if self.rtol is not None:
            self._mismatched += int(np.count_nonzero(d > self.atol + self.rtol * absa))
        with np.errstate(divide="ignore", invalid="ignore"):
            rel = np.divide(d, absa, out=b64)   # 0/0 -> nan (counts as rel 0), x/0 -> inf
        both_zero = 0
        if absa.min() == 0.0:
            both_zero = int(np.count_nonzero(np.isnan(rel)))
        self._max_rel = max(self._max_rel, float(np.fmax.reduce(rel)))
        self._lt1 += int(np.count_nonzero(rel < 1e-3)) + both_zero
        self._lt5 += int(np.count_nonzero(rel < 5e-3)) + both_zero
        if self.ulp_dtype is not None:
            self._ulp = max(self._ulp, int(np.max(np.abs(np.subtract(
                _ordered(a, self.ulp_dtype), _ordered(b, self.ulp_dtype), dtype=np.int64)))))

    def result(self) -> TensorMetrics:
        nf = self._nf
        worst = self._worst if self._max_abs > 0 else None
        return TensorMetrics(
            numel=self._n,
            max_abs=max(self._max_abs, 0.0),
            mean_abs=self._sum_abs / nf if nf else 0.0,
            max_rel=self._max_rel,
            rel_l2=_rel_l2_from(self._dd, self._aa),
            cosine=_cosine_from(self._aa, self._bb, self._dd),
            sqnr_db=_sqnr_from(self._dd, self._aa),
            rmse=math.sqrt(self._dd / nf) if nf else 0.0,
            max_ulp=self._ulp if self.ulp_dtype is not None else None,
            ulp_dtype=self.ulp_dtype,
            frac_rel_lt_1e3=self._lt1 / nf if nf else 1.0,
            frac_rel_lt_5e3=self._lt5 / nf if nf else 1.0,
            nan_inf_mismatch=self._naninf,
            worst_index=worst[0] if worst else None,
            worst_ref=worst[1] if worst else None,
            worst_cand=worst[2] if worst else None,
            mismatched=self._mismatched if self.rtol is not None else None,
            mean_rel=None if self.floor is None else (self._sum_rel / nf if nf else 0.0),
        )


def identical_metrics(ref_dtype: str, cand_dtype: str, numel: int, finite: int, nonzero: bool,
                      *, rtol: float | None = None, atol: float | None = None,
                      scale: float | None = None) -> TensorMetrics:
    """What `MetricAccumulator(ref_dtype, cand_dtype, rtol=, atol=, scale=)` returns after
    reading two bit-identical tensors of `numel` elements, `finite` of them finite, without
    reading them: `nonzero` says the finite elements' sum of squares is > 0 (the caller
    makes sure it lies in (1e-140, 1e140), where the cosine is exactly 1). Not for logits'
    rows (`row`). compare.diff uses it for records with equal content hashes."""
    acc = MetricAccumulator(ref_dtype, cand_dtype, rtol=rtol, atol=atol, scale=scale)
    acc._n, acc._nf = int(numel), int(finite)
    acc._aa = acc._bb = 1.0 if nonzero else 0.0
    acc._lt1 = acc._lt5 = int(finite)
    return acc.result()


def _shift_free_rel(a: np.ndarray, b: np.ndarray, rows: np.ndarray, floor: float) -> float:
    """Sum over the finite pairs of |d - mean d| / (|a - mean a| + floor), the means taken per
    row (`rows`: each element's row number; d = b - a): `MetricAccumulator`'s mean_rel of
    logits."""
    a64 = a.astype(np.float64)
    d = b.astype(np.float64) - a64
    fin = np.isfinite(a64) & np.isfinite(d)
    if not fin.all():
        a64, d, rows = a64[fin], d[fin], rows[fin]
    if not a64.size:
        return 0.0
    rows = rows - rows.min()
    n = np.bincount(rows)
    with np.errstate(invalid="ignore", divide="ignore"):  # rows absent from a sample: 0 / 0
        d -= (np.bincount(rows, d) / n)[rows]
        a64 -= (np.bincount(rows, a64) / n)[rows]
    if floor <= 0:
        return 0.0 if not np.any(d) else math.inf
    return float((np.abs(d) / (np.abs(a64) + floor)).sum())


def tensor_metrics(a, b, ref_dtype: str = "float32", cand_dtype: str = "float32", *,
                   rtol: float | None = None, atol: float | None = None) -> TensorMetrics:
    """All metrics of two in-memory arrays (one chunk through `MetricAccumulator`)."""
    acc = MetricAccumulator(ref_dtype, cand_dtype, rtol=rtol, atol=atol)
    acc.add(np.asarray(a), np.asarray(b))
    return acc.result()


# ----------------------------------------------------------------------------- logits

def log_softmax(x) -> np.ndarray:
    """Row-wise log-softmax in float64 (rows = positions)."""
    x = np.atleast_2d(np.asarray(x, dtype=np.float64))
    m = np.max(x, axis=-1, keepdims=True)
    z = x - m
    return z - np.log(np.sum(np.exp(z), axis=-1, keepdims=True))


def kl_div(ref_logits, cand_logits) -> np.ndarray:
    """KL(p_ref || p_cand) per row, in nats (>= 0)."""
    lp, lq = log_softmax(ref_logits), log_softmax(cand_logits)
    kl = np.sum(np.exp(lp) * (lp - lq), axis=-1)
    return np.maximum(kl, 0.0)


def top1_agree(ref_logits, cand_logits) -> np.ndarray:
    """Per row: True where the greedy (argmax) token is the same."""
    r, c = np.atleast_2d(ref_logits), np.atleast_2d(cand_logits)
    return np.argmax(r, axis=-1) == np.argmax(c, axis=-1)


def topk_overlap(ref_logits, cand_logits, k: int = 5) -> np.ndarray:
    """Per row: |top-k(ref) & top-k(cand)| / k."""
    r, c = np.atleast_2d(ref_logits), np.atleast_2d(cand_logits)
    k = min(k, r.shape[-1])
    tr = np.argpartition(-r, k - 1, axis=-1)[:, :k]
    tc = np.argpartition(-c, k - 1, axis=-1)[:, :k]
    return np.array([len(set(x.tolist()) & set(y.tolist())) / k for x, y in zip(tr, tc)])


def top2_margin(logits) -> np.ndarray:
    """Per row: top-1 logit minus top-2 logit (0 for a one-token vocabulary)."""
    x = np.atleast_2d(np.asarray(logits, dtype=np.float64))
    if x.shape[-1] < 2:
        return np.zeros(x.shape[0])
    top2 = np.partition(x, -2, axis=-1)[:, -2:]
    return top2[:, 1] - top2[:, 0]


LOGIT_NOISE_TOP = 32


def logit_noise(ref_logits, cand_logits, top: int = LOGIT_NOISE_TOP) -> np.ndarray:
    """Per row: the spread of (cand - ref) over the reference's `top` largest logits, around
    their own mean, leaving out the two sides' top-1 tokens (`spread_without_tops`). A flip
    happens at the top and needs d(top-2) - d(top-1) > margin: what moves a margin is how the
    top tokens' errors differ from each other, not how far the top moved against the rest of
    the vocabulary (a shift of the top tokens together moves no margin), nor the many small
    logits' errors (rounding errors scale with the logit). It is what a top-k capture can
    measure (compare.topk, over the tokens both sides hold), so a flip is judged the same
    whatever the logits' form. A token flip whose reference top-1 / top-2 margin is within
    NEAR_TIE_FACTOR times this is a near-tie (compare.tolerances)."""
    r = np.atleast_2d(np.asarray(ref_logits, dtype=np.float64))
    c = np.atleast_2d(np.asarray(cand_logits, dtype=np.float64))
    k = min(top, r.shape[-1])
    idx = np.argpartition(r, -k, axis=-1)[:, -k:]
    d = np.take_along_axis(c - r, idx, axis=-1)
    keep = (idx != np.argmax(r, axis=-1)[:, None]) & (idx != np.argmax(c, axis=-1)[:, None])
    rows = np.repeat(np.arange(r.shape[0]), k)
    return spread_without_tops(r.shape[0], rows, d.reshape(-1), keep.reshape(-1))


NOISE_MIN_KEPT = 8  # values the noise is measured on once the two top-1 tokens are left out


def spread_without_tops(rows: int, r: np.ndarray, d: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """Per row (`r`: the row of each value of `d`): the standard deviation of the differences
    `d`, over those `keep` marks where at least NOISE_MIN_KEPT are, else over all of them.
    `keep` leaves out the reference's and the candidate's top-1 tokens: a fault that moves one
    token's logit is what flips it, and counted in the noise it would hide itself (one logit
    moved by x among 32 unmoved is a spread of 0.17x: a flip at margin m then reads as at most
    m / 0.17m = x5.7 the noise, a near-tie however large the fault)."""
    kept = np.bincount(r, weights=keep, minlength=rows)
    use = np.where(kept[r] >= NOISE_MIN_KEPT, keep, True).astype(np.float64)
    n = np.maximum(np.bincount(r, weights=use, minlength=rows), 1.0)
    mean = np.bincount(r, weights=use * d, minlength=rows) / n
    return np.sqrt(np.bincount(r, weights=use * (d - mean[r]) ** 2, minlength=rows) / n)
