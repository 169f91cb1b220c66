"""Graded faults for the control-rule tests and bench/bench_control.py (not a test module):
where each kind of fault is planted, the record it shows at, the module a right verdict names,
and how strong to make it so that its record's rel_l2 is s x the record's natural noise.

Each fault lives in code no record covers (inside the named module, or between its recorded
children):
    norm    model.layers.L.post_attention_layernorm, norm:part:D (variance over part of the row)
    linear  model.layers.L.mlp.down_proj, tile:D (one K tile accumulated with a wrong scale)
    act     model.layers.L.mlp.act_fn, act:slope:D (a wrong constant inside SiLU)
    core    model.layers.L.self_attn, attn:scale:1+D (the attention core's softmax scale off, in
            any attention implementation, sdpa's fused kernel included: between q/k/v_proj
            and o_proj, seen at o_proj's input, blamed on self_attn)
    rotary  model.rotary_emb, op:aten.cos|aten.sin:inscale:1+D (rotary angles off)
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

KINDS = ("norm", "linear", "act", "core", "rotary")


def fault(kind: str, layer: int, d: float) -> tuple[tuple[str, str], str, str]:
    """((module, fault spec), the site it shows at, the module a right verdict names)."""
    L = f"model.layers.{layer}"
    if kind == "norm":
        m = f"{L}.post_attention_layernorm"
        return (m, f"norm:part:{d:.6g}"), f"{m}#0:out.0", m
    if kind == "linear":
        m = f"{L}.mlp.down_proj"
        return (m, f"tile:{d:.6g}"), f"{m}#0:out.0", m
    if kind == "act":
        m = f"{L}.mlp.act_fn"
        return (m, f"act:slope:{d:.6g}"), f"{m}#0:out.0", m
    if kind == "core":
        m = f"{L}.self_attn"
        return (m, f"attn:scale:{1 + d:.8g}"), f"{m}.o_proj#0:in.0", m
    if kind == "rotary":
        m = "model.rotary_emb"
        return (m, f"op:aten.cos|aten.sin:inscale:{1 + d:.8g}"), f"{m}#0:out.0", m
    raise ValueError(kind)


def site_rel_l2(ref: Path, cand: Path, site: str) -> float:
    """rel_l2 of `site`, RMS over its requests and steps."""
    from accucheck.compare.diff import diff_captures

    d = diff_captures(ref, cand, include=(f"*{site}",))
    errs = [r.error for r in d.records if r.key.site == site]
    return math.sqrt(sum(e * e for e in errs) / len(errs))


def natural_noise(ref: Path, controls: list[Path], site: str) -> float:
    """The controls' rel_l2 at `site`, RMS over them and the site's records."""
    return math.sqrt(sum(site_rel_l2(ref, c, site) ** 2 for c in controls) / len(controls))


def size_fault(capture: Callable[[str, tuple[str, str], tuple[str, ...]], Path], ref: Path,
               kind: str, layer: int, s: float, noise: float, steps: int = 3) -> float:
    """The strength D whose error alone at its record is noise * sqrt(s^2 - 1), so that the
    faulty record's error is s x its natural noise (s > 1); below the noise (s <= 1), whose
    error alone is s x the noise: secant steps on fault-only runs (the reference's dtype, no
    dither, only the module recorded). `capture(name, planted, include)` makes one. NaN when
    the fault cannot be that strong (norm:part saturates at D = 1)."""
    target = noise * (math.sqrt(s * s - 1) if s > 1 else s)
    d = 0.01
    for _ in range(steps):
        planted, site, _ = fault(kind, layer, d)
        inc = (planted[0] + ".o_proj",) if kind == "core" else (planted[0],)
        f = site_rel_l2(ref, capture(f"cal-{kind}{layer}-{d:.6g}", planted, inc), site)
        if f <= 0 or not math.isfinite(f):
            return math.nan
        d = d * target / f
        if kind == "norm" and d > 1.0:
            return math.nan
    return d
