"""A synthetic capture pair of a deep model for the HTML diff page's scale test and
bench/bench_html_diff.py (not a test module; no torch).

`deep_pair(d, layers=80, steps=8, reqs=4)` writes ref.h5 / cand.h5 with KINDS (15 module kinds,
o_proj's and down_proj's inputs among them) per layer, the embedding, final norm and logits
outside the layers, tiny tensors [1, n, HIDDEN]. The candidate carries a tiny relative noise
everywhere (well within float32's tolerance) and, from `fault_layer`'s post_attention_layernorm
on, an error of 1e-3 that the layers pass on.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

HIDDEN = 8
KINDS = ("input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
         "self_attn.o_proj#0:in", "self_attn.o_proj", "self_attn", "post_attention_layernorm",
         "mlp.gate_proj", "mlp.act_fn", "mlp.up_proj", "mlp.down_proj#0:in", "mlp.down_proj",
         "mlp", "")
FAULT = "post_attention_layernorm"


def _stats(x: np.ndarray) -> np.ndarray:
    x64 = x.astype(np.float64)
    return np.array([x64.min(), x64.max(), x64.mean(), x64.std(), np.abs(x64).max(),
                     np.sqrt(np.dot(x64.ravel(), x64.ravel())), 0, 0, 0, x.size])


def _keys(req: int, step: int, layers: int):
    yield f"r{req}.s{step}:model.embed_tokens#0:out.0"
    for i in range(layers):
        for k in KINDS:
            mod, _, role = k.partition("#0:")
            mod = f"model.layers.{i}" + (f".{mod}" if mod else "")
            yield f"r{req}.s{step}:{mod}#0:{role or 'out'}.0"
    yield f"r{req}.s{step}:model.norm#0:out.0"
    yield f"r{req}.s{step}:logits#0:out.0"


def deep_pair(d: Path, *, layers: int = 80, steps: int = 8, reqs: int = 4,
              fault_layer: int | None = 40, seed: int = 0) -> tuple[Path, Path]:
    from accucheck.keys import RecordKey
    from accucheck.store import CaptureWriter

    rng = np.random.default_rng(seed)
    ref, cand = d / "deep-ref.h5", d / "deep-cand.h5"
    prompt = (1, 2, 3)
    gen = tuple(range(4, 4 + steps))
    with CaptureWriter(ref, meta={"dtype": "float32"}, store="full", force=True) as wr, \
            CaptureWriter(cand, meta={"dtype": "float32"}, store="full", force=True) as wc:
        for req in range(reqs):
            for step in range(steps):
                n = len(prompt) if step == 0 else 1
                faulty = False
                for k in _keys(req, step, layers):
                    key = RecordKey.parse(k)
                    logits = key.is_logits
                    a = rng.standard_normal((1, n, 32 if logits else HIDDEN)).astype(np.float32)
                    if logits:
                        a *= 3
                    faulty = faulty or (fault_layer is not None and key.module ==
                                        f"model.layers.{fault_layer}.{FAULT}")
                    rel = 1e-3 if faulty else 1e-7
                    b = (a * (1 + rel * rng.standard_normal(a.shape))).astype(np.float32)
                    kind = "logits" if logits else "module"
                    for w, x in ((wr, a), (wc, b)):
                        w.add(key, kind, "float32", x.shape, _stats(x),
                              int(x.view(np.uint32).astype(np.int64).sum() % 2 ** 52), x)
        for w in (wr, wc):
            for req in range(reqs):
                w.set_request(req, prompt, gen)
    return ref, cand


def widen(a, steps: int, reqs: int):
    """`a` (an Analysis of one request and one step) as if every one of `reqs` requests and
    `steps` steps had recorded the same records: the page's scale without capturing and
    diffing them all (bench/bench_html_diff.py measures that too). Verdict fields unchanged."""
    from dataclasses import replace

    from accucheck.keys import RecordKey
    from accucheck.verdict.locate import Analysis

    def moved(k: RecordKey, req: int, step: int) -> RecordKey:
        return RecordKey(req, step, k.module, k.call, k.role, k.slot, k.op, k.op_index)

    d, L = a.diff, a.location
    grid = [(q, s) for q in range(reqs) for s in range(steps)]
    records = tuple(replace(r, key=moved(r.key, q, s)) for q, s in grid for r in d.records)
    locs = tuple(replace(x, key=moved(x.key, q, s)) for q, s in grid for x in L.records)
    curve = tuple(replace(p, req=q, step=s, key=moved(p.key, q, s)) for q, s in grid
                  for p in L.curve)
    logits = tuple(replace(x, key=moved(x.key, q, s)) for q, s in grid for x in d.logits)
    return Analysis(replace(d, records=records, logits=logits),
                    replace(L, records=locs, curve=curve))
