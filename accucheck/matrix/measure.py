"""How far one request of one run is from the baseline: the facts a matrix row holds.

Both runs are raw full-vocabulary logits at the request's generating positions (step 0 = the
last prompt position, step k = the k-th forced token), the run teacher-forced to the baseline's
tokens, so position k of one is position k of the other. Imports numpy and compare.metrics /
tolerances.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from accucheck.compare.metrics import kl_div, log_softmax, logit_noise, top2_margin
from accucheck.compare.tolerances import NEAR_TIE_FACTOR


@dataclass(frozen=True)
class Flip:
    step: int
    base_token: int
    run_token: int
    margin: float        # the baseline's top-1 minus top-2 logit there
    noise: float         # spread of run - baseline over the baseline's top logits there

    @property
    def near_tie(self) -> bool:
        return self.margin <= NEAR_TIE_FACTOR * self.noise

    @property
    def label(self) -> str:
        return "near-tie" if self.near_tie else "real"


@dataclass(frozen=True)
class RequestDelta:
    """One request of one run against the baseline."""
    request: int
    steps: int
    bitwise: bool
    max_dlogprob: float       # max over steps |logprob(run) - logprob(base)| of the forced token
    max_kl: float             # max over steps KL(base || run)
    top1: float               # fraction of steps with the same argmax
    flip: Flip | None         # the first step whose argmax differs
    first_step: int | None = None     # the first step whose logits differ at all
    cached_tokens: int | None = None  # prompt tokens the engine served from its prefix cache

    @property
    def moved(self) -> bool:
        return not self.bitwise

    def to_json(self) -> dict:
        d = asdict(self)
        d["moved"] = self.moved
        if self.flip is not None:
            d["flip"]["label"] = self.flip.label
        return d


def request_delta(request: int, base: np.ndarray, run: np.ndarray, tokens: list[int],
                  cached_tokens: int | None = None) -> RequestDelta:
    """`base`, `run`: [steps, vocab] raw logits; `tokens`: the forced token at each step (the
    baseline's greedy choice)."""
    if base.shape != run.shape:
        raise ValueError(f"request {request}: logits {base.shape} against {run.shape}")
    steps = base.shape[0]
    bitwise = bool(np.array_equal(base, run, equal_nan=True))
    if bitwise:
        return RequestDelta(request, steps, True, 0.0, 0.0, 1.0, None, None, cached_tokens)
    lb, lr = log_softmax(base), log_softmax(run)
    rows = np.arange(steps)
    tok = np.asarray(tokens[:steps], dtype=np.int64)
    dlp = float(np.max(np.abs(lr[rows, tok] - lb[rows, tok])))
    kl = float(np.max(kl_div(base, run)))
    a, b = base.argmax(-1), run.argmax(-1)
    agree = a == b
    flip = None
    if not agree.all():
        k = int(np.argmin(agree))
        flip = Flip(k, int(a[k]), int(b[k]), float(top2_margin(base[k])[0]),
                    float(logit_noise(base[k], run[k])[0]))
    same = [np.array_equal(base[k], run[k], equal_nan=True) for k in range(steps)]
    return RequestDelta(request, steps, False, dlp, kl, float(agree.mean()), flip,
                        same.index(False), cached_tokens)
