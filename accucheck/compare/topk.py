"""Top-k logits (capture --logits topk:K, store.logits_topk) compared with top-k or full ones.

A side holding top-k log-probabilities (slot "0" [.., positions, K + 1]: column 0 the token
that follows the position, then the K largest; slot "1" their token ids) is compared with the
other side on the tokens both hold, position by position. A side with full raw logits is
turned into log-probabilities (log_softmax over its vocabulary) and read at the other side's
ids, so there every token the top-k side holds is compared. Per position:

- each side's top-1: its largest value (exact: the top-1 is in every top-k);
- the reference's top-1 / top-2 margin (exact for K >= 2; log-probabilities differ from
  logits by a shift, so margins are the same);
- KL(ref || cand) over the tokens both hold plus one bucket for the rest of the vocabulary
  (each side's mass outside them): the KL of a coarser partition, never more than the full
  KL (so a top-k diff can miss tail divergence, never invent it);
- top-5 overlap of the two sides' top min(5, K);
- the logit noise over the tokens both hold (compare.metrics.logit_noise).

The record's metrics are measured on the values both hold, up to a shift per position, as
full logits are. Imports numpy and accucheck.compare.metrics / results, keys, store only.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from accucheck.compare.metrics import MetricAccumulator, TensorMetrics, logit_noise
from accucheck.compare.results import LogitsPosition
from accucheck.keys import RecordKey
from accucheck.store import LOGITS_IDS_SLOT


class TopkSide:
    """One side's logits as (values [rows, width], ids [rows, width] or None: full raw
    logits, every id)."""

    def __init__(self, values: np.ndarray, ids: np.ndarray | None):
        width = values.shape[-1]
        self.values = np.asarray(values, dtype=np.float64).reshape(-1, width)
        if ids is None:  # full raw logits -> log-probabilities
            v = self.values
            m = np.max(v, axis=-1, keepdims=True)
            self.values = v - (m + np.log(np.sum(np.exp(v - m), axis=-1, keepdims=True)))
            self.ids = None
        else:
            self.ids = np.asarray(ids, dtype=np.int64).reshape(-1, width)

    @property
    def rows(self) -> int:
        return self.values.shape[0]

    def top(self, i: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Row i's k largest (token ids, values), largest first."""
        if self.ids is None:
            v = self.values[i]
            order = np.argsort(-np.where(np.isfinite(v), v, -np.inf), kind="stable")[:k]
            return order, v[order]
        d = self.at(i)
        ids = sorted(d, key=lambda t: -d[t])[:k]
        return np.asarray(ids, dtype=np.int64), np.asarray([d[t] for t in ids])

    def at(self, i: int) -> dict[int, float]:
        """Row i's finite values by token id (top-k sides only)."""
        out = {}
        for t, v in zip(self.ids[i], self.values[i]):
            if t >= 0 and np.isfinite(v):
                out[int(t)] = float(v)
        return out


def ids_key(key: RecordKey) -> RecordKey:
    """The key of a top-k logits record's token ids (slot "1") beside its values (slot "0")."""
    return replace(key, slot=LOGITS_IDS_SLOT)


def common(ref: TopkSide, cand: TopkSide, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Row i: (token ids, ref values, cand values) at the tokens both sides hold."""
    if ref.ids is None and cand.ids is None:
        raise ValueError("top-k comparison of two full sides")
    a = ref.at(i) if ref.ids is not None else None
    b = cand.at(i) if cand.ids is not None else None
    ids = sorted(set(a) & set(b)) if a is not None and b is not None \
        else sorted(a if a is not None else b)
    ids_arr = np.asarray(ids, dtype=np.int64)
    va = np.asarray([a[t] for t in ids]) if a is not None else ref.values[i, ids_arr]
    vb = np.asarray([b[t] for t in ids]) if b is not None else cand.values[i, ids_arr]
    keep = np.isfinite(va) & np.isfinite(vb)
    return ids_arr[keep], va[keep], vb[keep]


def coarse_kl(va: np.ndarray, vb: np.ndarray) -> float:
    """KL(ref || cand) over the given tokens' log-probabilities plus the rest of the
    vocabulary as one outcome (each side's mass outside them)."""
    pa, pb = np.exp(va), np.exp(vb)
    kl = float(np.sum(pa * (va - vb)))
    ra, rb = max(1.0 - float(pa.sum()), 0.0), max(1.0 - float(pb.sum()), 0.0)
    if ra > 1e-12:
        kl += ra * (np.log(ra) - np.log(max(rb, 1e-30)))
    return max(kl, 0.0)


def compare_topk(ref: TopkSide, cand: TopkSide, ref_dtype: str, cand_dtype: str, *,
                 rtol: float | None, atol: float | None
                 ) -> tuple[TensorMetrics, list[LogitsPosition]]:
    """The record's metrics on the values both sides hold (up to a shift per position), and
    each position's LogitsPosition."""
    if ref.rows != cand.rows:
        raise ValueError(f"top-k logits of {ref.rows} and {cand.rows} positions")
    width = max(ref.values.shape[-1] if ref.ids is not None else 0,
                cand.values.shape[-1] if cand.ids is not None else 0)
    rows = [common(ref, cand, i) for i in range(ref.rows)]
    spread = np.concatenate([va for _, va, _ in rows]) if rows else np.zeros(0)
    scale = float(np.std(spread)) if spread.size > 1 else None
    acc = MetricAccumulator(ref_dtype, cand_dtype, rtol=rtol, atol=atol,
                            scale=scale or None, row=width)
    positions = []
    for i, (ids, va, vb) in enumerate(rows):
        if va.size:
            acc.add(va, vb, i * width + np.arange(va.size))
        (ta, two), (tb, _) = ref.top(i, 5), cand.top(i, 5)
        k5 = min(len(ta), len(tb), 5)
        t5 = len(set(ta[:k5].tolist()) & set(tb[:k5].tolist())) / k5 if k5 else 0.0
        margin = float(two[0] - two[1]) if two.size >= 2 else float("inf")
        noise = float(logit_noise(va, vb)[0]) if va.size else 0.0
        positions.append(LogitsPosition(i, coarse_kl(va, vb) if va.size else 0.0,
                                        int(ta[0]) if len(ta) else -1,
                                        int(tb[0]) if len(tb) else -1, t5, margin, noise))
    return acc.result(), positions
