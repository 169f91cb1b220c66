"""The output gap between the reference's logits and a candidate run's, and the share of it a
patch recovers. Pure float64 numpy functions; imports nothing from accucheck but errors.

Per position (every prompt position of the prefill, every decode step):
- |Δ logprob|: |log p_ref(t) - log p_cand(t)| of the forced next token t (positions without a
  next token, the last decode step's, have none);
- KL(ref || cand) of the full-vocabulary distributions;
- a flip: the two argmaxes differ.
A gap is the mean |Δ logprob|, the mean KL and the number of flips; and which prompts' answers
differ: a flip at a generating position (the last position of each step whose next token is
one of the reference's generated tokens), where the candidate's greedy answer leaves REF's.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

METRICS = ("logprob", "kl", "flips")
# below these the candidate's output equals the reference's (float32 reruns agree to ~1e-7)
NO_GAP = {"logprob": 1e-6, "kl": 1e-9, "flips": 0.5}


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float64 of a (positions, vocab) array."""
    x = np.asarray(logits, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


@dataclass(frozen=True)
class Gap:
    """An output gap: mean |Δ logprob| over `targeted` positions, mean KL over `positions`,
    and token flips among them."""
    logprob: float
    kl: float
    flips: int
    positions: int
    targeted: int
    answers: tuple[int, ...] = ()  # the requests whose answer differs (see the module docstring)

    def __post_init__(self) -> None:
        if self.positions < 0 or self.targeted < 0 or self.flips < 0:
            raise ValueError(f"negative counts in {self!r}")

    def value(self, metric: str) -> float:
        return float(getattr(self, metric))

    def is_zero(self) -> bool:
        """No gap on any metric: the candidate's output is the reference's."""
        return all(self.value(m) < NO_GAP[m] for m in METRICS)

    def as_dict(self) -> dict:
        return {"logprob": self.logprob, "kl": self.kl, "flips": self.flips,
                "positions": self.positions, "targeted": self.targeted,
                "answers_differ": list(self.answers)}


class GapSum:
    """Accumulates a gap step by step: `add(ref_logp, cand_logits, targets)` per step."""

    def __init__(self) -> None:
        self.dlp = 0.0
        self.kl = 0.0
        self.flips = 0
        self.positions = 0
        self.targeted = 0
        self.answers: set[int] = set()

    def add(self, ref_logp: np.ndarray, cand_logits: np.ndarray, targets: np.ndarray,
            req: int | None = None) -> None:
        """`ref_logp`: the reference's log-softmax (positions, vocab); `cand_logits`: the
        candidate's raw logits, same shape; `targets`: the forced next token per position, -1
        where there is none; `req`: the request (its answer differs when the step's last
        position flips and has a target)."""
        if ref_logp.shape != cand_logits.shape:
            raise ValueError(f"logits shapes differ: {ref_logp.shape} vs {cand_logits.shape}")
        cand = log_softmax(cand_logits)
        p = np.exp(ref_logp)
        self.kl += float(np.sum(p * (ref_logp - cand)))
        flipped = ref_logp.argmax(-1) != cand.argmax(-1)
        self.flips += int(np.sum(flipped))
        if req is not None and flipped.size and flipped[-1] and targets[-1] >= 0:
            self.answers.add(req)
        self.positions += ref_logp.shape[0]
        rows = np.nonzero(targets >= 0)[0]
        if rows.size:
            t = targets[rows]
            self.dlp += float(np.abs(ref_logp[rows, t] - cand[rows, t]).sum())
            self.targeted += int(rows.size)

    def gap(self) -> Gap:
        return Gap(self.dlp / max(self.targeted, 1), max(self.kl, 0.0) / max(self.positions, 1),
                   self.flips, self.positions, self.targeted, tuple(sorted(self.answers)))


def recovered(baseline: Gap, patched: Gap) -> dict[str, float | None]:
    """Share of the baseline gap a patch recovers, per metric: 1 - patched / baseline (1 = the
    reference's output, 0 = no better, < 0 = worse); None where the baseline has no gap on that
    metric (nothing to recover: never a division by zero)."""
    out: dict[str, float | None] = {}
    for m in METRICS:
        b = baseline.value(m)
        out[m] = None if b < NO_GAP[m] else 1.0 - patched.value(m) / b
    return out


def introduced(total: Gap, patched: Gap) -> dict[str, float | None]:
    """Noising: the share of the candidate's whole gap (`total`, its logits against REF's) that
    one site's tensor, patched into a reference-device run, brings in: patched / total (1 = the
    whole gap, 0 = none); None where the total has no gap on that metric."""
    out: dict[str, float | None] = {}
    for m in METRICS:
        t = total.value(m)
        out[m] = None if t < NO_GAP[m] else patched.value(m) / t
    return out
