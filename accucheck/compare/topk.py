"""Top-k logits (capture --logits topk:K, store.logits_topk) compared with top-k or full ones.

A side holding top-k log-probabilities (slot "0" [.., positions, K + 1]: column 0 the token
that follows the position, then the K largest; slot "1" their token ids) is compared with the
other side on the tokens both hold, position by position. A side with full raw logits is
turned into log-probabilities (log_softmax over its vocabulary) and read at the other side's
ids, so there every token the top-k side holds is compared. Per position:

- each side's top-1: its largest value (exact: the top-1 is in every top-k);
- the reference's top-1 / top-2 margin (exact for K >= 2; log-probabilities differ from
  logits by a shift, so margins are the same);
- KL(ref || cand) over the tokens both hold plus one outcome for the rest of the vocabulary
  (each side's mass outside them): the KL of a coarser partition, never more than the full
  KL (so a top-k diff can miss tail divergence, never invent it);
- top-5 overlap of the two sides' top min(5, K);
- the logit noise (compare.metrics.logit_noise: the spread of cand - ref, its mean removed,
  the two sides' top-1 tokens left out) over the tokens both hold: the top of the
  distribution, where logit_noise also looks.

The record's metrics are measured on the values both hold, up to a shift per position, as
full logits are. Vectorised over positions, in blocks of at most BLOCK_ELEMS values of a full
side. Imports numpy and accucheck.compare.metrics / results, keys, store only.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from accucheck.compare.metrics import MetricAccumulator, TensorMetrics, spread_without_tops
from accucheck.compare.results import LogitsPosition
from accucheck.keys import RecordKey
from accucheck.store import LOGITS_IDS_SLOT

BLOCK_ELEMS = 1 << 22   # values of a full side turned into log-probabilities at a time


class TopkSide:
    """One side's logits: values [rows, width] and ids [rows, width] (top-k log-probabilities),
    or ids None (full raw logits, every id)."""

    def __init__(self, values: np.ndarray, ids: np.ndarray | None):
        width = values.shape[-1]
        self.values = np.asarray(values).reshape(-1, width)
        self.ids = None if ids is None else np.asarray(ids, dtype=np.int64).reshape(-1, width)

    @property
    def rows(self) -> int:
        return self.values.shape[0]

    def block(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Rows lo..hi as float64: log-probabilities (a full side's log_softmax) and ids
        with the entries not to use marked -1 (NaN values; column 0 where it repeats a
        top-k id)."""
        v = self.values[lo:hi].astype(np.float64)
        if self.ids is None:
            m = np.max(v, axis=-1, keepdims=True)
            return v - (m + np.log(np.sum(np.exp(v - m), axis=-1, keepdims=True))), None
        ids = self.ids[lo:hi].copy()
        ids[~np.isfinite(v)] = -1
        ids[(ids[:, :1] == ids[:, 1:]).any(axis=1), 0] = -1
        return v, ids


def ids_key(key: RecordKey) -> RecordKey:
    """The key of a top-k logits record's token ids (slot "1") beside its values (slot "0")."""
    return replace(key, slot=LOGITS_IDS_SLOT)


def _matched(va, ia, vb, ib) -> tuple[np.ndarray, ...]:
    """(row, column in the top-k side, ref value, cand value, token id) of every token both
    hold."""
    if ia is not None and ib is not None:
        eq = (ia[:, :, None] == ib[:, None, :]) & (ia[:, :, None] >= 0)
        r, i, j = np.nonzero(eq)
        return r, i, va[r, i], vb[r, j], ia[r, i]
    if ia is not None:            # cand full: read at ref's ids
        r, i = np.nonzero(ia >= 0)
        return r, i, va[r, i], vb[r, ia[r, i]], ia[r, i]
    r, j = np.nonzero(ib >= 0)    # ref full: read at cand's ids
    return r, j, va[r, ib[r, j]], vb[r, j], ib[r, j]


def _top(v: np.ndarray, ids: np.ndarray | None, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row: the k largest (token ids, values), largest first (unused entries last)."""
    w = np.where(ids >= 0, v, -np.inf) if ids is not None else v
    k = min(k, w.shape[1])
    part = np.argpartition(-w, k - 1, axis=1)[:, :k]
    order = np.take_along_axis(part, np.argsort(-np.take_along_axis(w, part, 1), 1,
                                                 kind="stable"), 1)
    vals = np.take_along_axis(w, order, 1)
    return (order if ids is None else np.take_along_axis(ids, order, 1)), vals


def _per_row(rows: int, r: np.ndarray, x: np.ndarray) -> np.ndarray:
    return np.bincount(r, weights=x, minlength=rows)


def compare_topk(ref: TopkSide, cand: TopkSide, ref_dtype: str, cand_dtype: str, *,
                 rtol: float | None, atol: float | None
                 ) -> tuple[TensorMetrics, list[LogitsPosition]]:
    """The record's metrics on the values both sides hold (up to a shift per position), and
    each position's LogitsPosition."""
    if ref.rows != cand.rows:
        raise ValueError(f"top-k logits of {ref.rows} and {cand.rows} positions")
    if ref.ids is None and cand.ids is None:
        raise ValueError("top-k comparison of two full sides")
    width = max(s.values.shape[-1] for s in (ref, cand) if s.ids is not None)
    full = max(s.values.shape[-1] for s in (ref, cand))
    step = max(1, BLOCK_ELEMS // full)
    acc, positions = None, []
    for lo in range(0, ref.rows, step):
        hi = min(lo + step, ref.rows)
        (va, ia), (vb, ib) = ref.block(lo, hi), cand.block(lo, hi)
        n = hi - lo
        r, col, a, b, tok = _matched(va, ia, vb, ib)
        if acc is None:  # the scale: the reference's spread over what is compared
            acc = MetricAccumulator(ref_dtype, cand_dtype, rtol=rtol, atol=atol,
                                    scale=float(np.std(a)) if a.size > 1 else None,
                                    row=width)
        acc.add(a, b, (lo + r) * width + col)
        pa, pb = np.exp(a), np.exp(b)
        kl = _per_row(n, r, pa * (a - b))
        rest_a = np.maximum(1.0 - _per_row(n, r, pa), 0.0)
        rest_b = np.maximum(1.0 - _per_row(n, r, pb), 1e-30)
        kl = np.maximum(kl + np.where(rest_a > 1e-12, rest_a * (np.log(np.maximum(
            rest_a, 1e-300)) - np.log(rest_b)), 0.0), 0.0)
        (ta, top_a), (tb, _) = _top(va, ia, 5), _top(vb, ib, 5)
        noise = spread_without_tops(n, r, b - a, (tok != ta[r, 0]) & (tok != tb[r, 0]))
        k5 = min(ta.shape[1], tb.shape[1])
        t5 = (ta[:, :k5, None] == tb[:, None, :k5]).any(2).sum(1) / k5
        margin = top_a[:, 0] - top_a[:, 1] if top_a.shape[1] > 1 else np.full(n, np.inf)
        positions += [LogitsPosition(lo + i, float(kl[i]), int(ta[i, 0]), int(tb[i, 0]),
                                     float(t5[i]), float(margin[i]), float(noise[i]))
                      for i in range(n)]
    if acc is None:
        acc = MetricAccumulator(ref_dtype, cand_dtype, rtol=rtol, atol=atol)
    return acc.result(), positions
