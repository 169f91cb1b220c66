"""vLLM's logprobs as a capture's logits: full raw logits (`step_logits`, `dense_logits`; the
engine's logprobs_mode raw_logits, every vocabulary entry) or top-k log-probabilities
(`step_topk`: capture --logits topk:K, logprobs_mode raw_logprobs, the layout of
store.logits_topk). vLLM gives each position's entries as [the token that follows (the prompt's
next token, the sampled one), the K largest...] (v1 Sampler.gather_logprobs); prompt position 0
has none. Imports numpy and accucheck.errors only.
"""
from __future__ import annotations

import numpy as np

from accucheck.errors import UserError


def step_logits(output, n_prompt: int, n_new: int, vocab: int,
                 with_prompt: bool = True) -> list[np.ndarray]:
    """Raw full-vocab logits per step: step 0 = [1, n_prompt, vocab] (positions 0..n-2 from the
    prompt logprobs, the last position from the first sample; without prompt logprobs
    (`prompt_logits`): [1, 1, vocab], the last position only), step k = [1, 1, vocab]."""
    sample = dense_logits(output.outputs[0].logprobs, vocab)
    if not with_prompt:
        if sample.shape[0] != n_new + 1:
            raise RuntimeError(f"vLLM logprobs cover {sample.shape[0]} sampled positions, "
                               f"expected {n_new + 1}")
        check_raw_logits(sample, "sampled")
        return [sample[k:k + 1][None] for k in range(n_new + 1)]
    prompt = dense_logits(output.prompt_logprobs, vocab)   # position 0 has none
    if prompt.shape[0] != n_prompt or sample.shape[0] != n_new + 1:
        raise RuntimeError(f"vLLM logprobs cover {prompt.shape[0]} prompt and {sample.shape[0]} "
                           f"sampled positions, expected {n_prompt} and {n_new + 1}")
    for what, rows in (("prompt", prompt[1:]), ("sampled", sample)):
        check_raw_logits(rows, what)
    steps = [np.concatenate([prompt[1:], sample[:1]])[None]]
    steps += [sample[k:k + 1][None] for k in range(1, n_new + 1)]
    return steps


def check_raw_logits(rows: np.ndarray, what: str) -> None:
    """Refuse rows that are log-probabilities (logsumexp about 0) where raw logits were asked
    (logprobs_mode raw_logits): a platform sampler that ignores the engine's logprobs_mode
    returns them (vllm-ascend's AscendSampler defaults to raw_logprobs). Raw logits whose
    logsumexp is within 1e-3 of 0 at every position do not happen by chance. A sampler that
    says its mode is refused before generating (vllm_facts.refuse_sampler_mode); this is for
    one that does not."""
    rows = rows[np.isfinite(rows).all(axis=-1)] if rows.size else rows
    if not rows.size:
        return
    x = rows.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    lse = (m[..., 0] + np.log(np.exp(x - m).sum(axis=-1)))
    if np.all(np.abs(lse) < 1e-3):
        raise UserError(f"vLLM returned log-probabilities, not raw logits, at the {what} "
                        f"positions (logsumexp {float(np.max(np.abs(lse))):.1e} at every one): "
                        f"the platform's sampler ignores logprobs_mode=raw_logits "
                        f"(vllm-ascend's AscendSampler uses raw_logprobs); a diff would blame "
                        f"the logits: refused")


def dense_logits(logprobs, vocab: int) -> np.ndarray:
    """FlatLogprobs (or a list of {token: Logprob}) with every token of every position -> a
    [positions, vocab] float32 array; a position without entries (prompt position 0) is NaN."""
    ids, vals, spans = _entries(logprobs)
    out = np.full((len(spans), vocab), np.nan, dtype=np.float32)
    for p, (s, e) in enumerate(spans):
        if e > s:
            out[p, ids[s:e]] = vals[s:e]
            if np.unique(ids[s:e]).size != vocab:
                raise RuntimeError(f"vLLM returned logits for {e - s} tokens at a position, "
                                   f"not the full vocabulary of {vocab}")
    return out


def step_topk(output, n_prompt: int, n_new: int, k: int, with_prompt: bool = True
              ) -> list[tuple[np.ndarray, np.ndarray]]:
    """Top-k log-probabilities per step, as (values [1, positions, k + 1] float32, ids
    [1, positions, k + 1] int64), positions as `step_logits` has them: column 0 the token that
    follows, then the k largest in descending order (NaN / -1 where vLLM gave fewer)."""
    sample = _topk_rows(output.outputs[0].logprobs, k)
    if sample[0].shape[0] != n_new + 1:
        raise RuntimeError(f"vLLM logprobs cover {sample[0].shape[0]} sampled positions, "
                           f"expected {n_new + 1}")
    rows = [(sample[0][j:j + 1], sample[1][j:j + 1]) for j in range(n_new + 1)]
    if with_prompt:
        pv, pi = _topk_rows(output.prompt_logprobs, k)   # position 0 has none
        if pv.shape[0] != n_prompt:
            raise RuntimeError(f"vLLM prompt logprobs cover {pv.shape[0]} positions, expected "
                               f"{n_prompt}")
        rows[0] = (np.concatenate([pv[1:], rows[0][0]]), np.concatenate([pi[1:], rows[0][1]]))
    return [(v[None], i[None]) for v, i in rows]


def _topk_rows(logprobs, k: int) -> tuple[np.ndarray, np.ndarray]:
    """FlatLogprobs (or a list of {token: Logprob}) -> ([positions, k + 1] float32 values,
    [positions, k + 1] int64 ids): the first entry of a position (the token that follows) in
    column 0, the rest sorted by value, largest first, in columns 1..k."""
    ids, vals, spans = _entries(logprobs)
    out_v = np.full((len(spans), k + 1), np.nan, dtype=np.float32)
    out_i = np.full((len(spans), k + 1), -1, dtype=np.int64)
    for p, (s, e) in enumerate(spans):
        if e <= s:
            continue
        out_v[p, 0], out_i[p, 0] = vals[s], ids[s]
        order = np.argsort(-vals[s + 1:e], kind="stable")[:k]
        out_v[p, 1:1 + order.size] = vals[s + 1:e][order]
        out_i[p, 1:1 + order.size] = ids[s + 1:e][order]
    return out_v, out_i


def _entries(logprobs) -> tuple[np.ndarray, np.ndarray, list[tuple[int, int]]]:
    """FlatLogprobs (or a list of {token: Logprob} per position) -> (token ids int64, values
    float32, each position's (start, end) in them)."""
    if hasattr(logprobs, "start_indices"):
        return (np.asarray(logprobs.token_ids, dtype=np.int64),
                np.asarray(logprobs.logprobs, dtype=np.float32),
                list(zip(logprobs.start_indices, logprobs.end_indices)))
    ids, vals, spans, n = [], [], [], 0
    for pos in logprobs:
        items = list((pos or {}).items())
        ids += [t for t, _ in items]
        vals += [lp.logprob for _, lp in items]
        spans.append((n, n + len(items)))
        n += len(items)
    return np.asarray(ids, dtype=np.int64), np.asarray(vals, dtype=np.float32), spans
