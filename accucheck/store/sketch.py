"""The /index/sketch column: a record's elementwise relative error, measurable from statistics.

Two stats-mode captures hold no tensors, only their statistics and 64 sampled values, and an
estimate of an error from 64 values of a heavy-tailed tensor is off by x4 either way (SmolLM2's
down_proj inputs; docs/control.md). The sketch is what a stats capture stores instead to measure
the control rule's error (accucheck.verdict.noise) nearly as well as a full capture does:

    z_i = sign(x_i) * log1p(|x_i| / c),   c = 2 ** floor(log2(SKETCH_FLOOR * rms(x)))
    sketch[b] = sum of s(i) * z_i over the flat positions i with bucket(i) == b

a count sketch (SKETCH_SIZE buckets, random signs) of the values on a log scale. It is linear in
z, so the difference of two runs' sketches is the sketch of z_ref - z_cand, and
||sketch_ref - sketch_cand||^2 estimates ||z_ref - z_cand||^2 without bias, with a relative
standard deviation of at most sqrt(2 / SKETCH_SIZE) whatever the values' distribution (no
element weighs more than its share). On the log scale z_ref - z_cand ~ (ref - cand) / (|ref| + c):
an ordinary element's error in units of the tensor's RMS, a massive activation's relative to
itself (so that its last-bit rounding does not drown every other element, as it does in
rel_l2), and

    sketch_rel = ||sketch_ref - sketch_cand|| / sqrt(numel)

is the root mean square of those errors. c ~ the RMS, not a tenth of it as compare.metrics.
mean_rel floors |ref|: in a root mean square, elements near zero with a floor of a tenth weigh
up to ten times the others, and the error a layer inherits there (a SiLU input near zero) hid
a SiLU fault planted at x2 its noise behind the down_proj it feeds (bench/bench_devices.py on
SmolLM2, 3 of 4 such faults blamed on the down_proj; with c ~ the RMS, see docs/control.md).
The two sides must use the same c: it is stored as its exponent, and a pair whose exponents
differ (an RMS at a power of two's boundary, under 1 % of records) is measured from its
sample instead.

Positions: bucket(i) = (i & 127) ^ G[(i >> 7) & 511] ^ H[(i >> 16) & 65535] and
s(i) = SL[i & 65535] * SH[(i >> 16) & 65535], with tables drawn from splitmix64 (seeds 1-4):
no two elements of an aligned group of 128 share a bucket (a tensor of up to 128 elements is
stored exactly), and a channel repeating every hidden-size elements is spread over all buckets.
The C kernel (accucheck/capture/record/stats_kernel.c) and the torch kernels
(accucheck.capture.record.stats) compute the same; `sketch_row` here is the reference
definition. A row is NaN when the tensor holds a NaN or an Inf.
"""
from __future__ import annotations

import numpy as np

SKETCH_SIZE = 128                # buckets
SKETCH_WIDTH = 1 + SKETCH_SIZE   # a stored row: the exponent of c, then the buckets
SKETCH_FLOOR = 1.0               # c ~ this fraction of the tensor's RMS
_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)
_tables: list = []


def splitmix64(n: int, seed: int) -> np.ndarray:
    """splitmix64 of seed * 2**32 + j for j < n (the C kernel computes the same)."""
    with np.errstate(over="ignore"):
        z = (np.arange(n, dtype=np.uint64) + np.uint64(seed << 32)) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def tables() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """G [512], H [65536] (int64 bucket offsets < 128), SL, SH [65536] (float64 signs)."""
    if not _tables:
        g = (splitmix64(512, 1) & np.uint64(127)).astype(np.int64)
        h = (splitmix64(65536, 2) & np.uint64(127)).astype(np.int64)
        sl = np.where(splitmix64(65536, 3) >> np.uint64(63), -1.0, 1.0)
        sh = np.where(splitmix64(65536, 4) >> np.uint64(63), -1.0, 1.0)
        _tables.extend((g, h, sl, sh))
    return tuple(_tables)


def positions(start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
    """Bucket and sign of the flat positions start..stop-1."""
    g, h, sl, sh = tables()
    i = np.arange(start, stop, dtype=np.int64)
    hi = (i >> 16) & 65535
    return (i & 127) ^ g[(i >> 7) & 511] ^ h[hi], sl[i & 65535] * sh[hi]


def exponent(rms: float) -> float:
    """The stored exponent of c for a tensor of this RMS (0 for an all-zero tensor)."""
    return float(np.floor(np.log2(SKETCH_FLOOR * rms))) if rms > 0 else 0.0


def sketch_row(values: np.ndarray) -> np.ndarray:
    """The /index/sketch row of a tensor (any float dtype, values as numbers, not bit patterns)."""
    x = np.asarray(values, dtype=np.float64).reshape(-1)
    out = np.zeros(SKETCH_WIDTH)
    if not np.isfinite(x).all():
        out[:] = np.nan
        return out
    rms = float(np.sqrt(x @ x / x.size)) if x.size else 0.0
    e = out[0] = exponent(rms)
    if rms > 0:
        z = np.copysign(np.log1p(np.abs(x) * 2.0 ** -e), x)
        b, s = positions(0, x.size)
        out[1:] = np.bincount(b, weights=s * z, minlength=SKETCH_SIZE)
    return out


def sketch_rel(ref: np.ndarray | None, cand: np.ndarray | None, numel: int) -> float | None:
    """The RMS elementwise relative error of two records from their sketch rows; None when
    either has none, either is not finite, or their scales differ."""
    if ref is None or cand is None or numel <= 0 or ref[0] != cand[0] \
            or not (np.isfinite(ref).all() and np.isfinite(cand).all()):
        return None
    return float(np.linalg.norm(ref[1:] - cand[1:]) / np.sqrt(numel))
