"""The sign-off report's plots, as PNG bytes (report.signoff embeds or links them).

Imports report.signoff_result; matplotlib lazily (the optional extra "plots": without it,
`make_plots` returns none and says why). No pyplot: no global state.
"""
from __future__ import annotations

import io
import math

from accucheck.numbers import percent
from accucheck.report.signoff_result import SignoffResult, worst_records

PLOTS = (("layers", "Error by layer, per step"),
         ("logits_kl", "Logits KL(ref || cand) by position"),
         ("tokens", "Token agreement curve"),
         ("worst", "Worst records (error / tolerance)"))
LOG_FLOOR = 1e-12    # zeros are drawn here on log axes
MAX_STEP_LINES = 8


def make_plots(r: SignoffResult) -> tuple[dict[str, bytes], str]:
    """PNG bytes per plot name; ({}, why) when matplotlib is not installed."""
    try:
        from matplotlib.figure import Figure  # noqa: F401  (no pyplot: no global state)
    except ImportError:
        return {}, ("No plots: matplotlib is not installed (pip install 'accucheck[plots]').")
    out = {}
    for name, fn in (("layers", _plot_layers), ("logits_kl", _plot_kl),
                     ("tokens", _plot_tokens), ("worst", _plot_worst)):
        out[name] = fn(r)
    return out, ""


def _fig():
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 3.6), dpi=100, layout="constrained")
    return fig, fig.add_subplot()


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _floor(x: float) -> float:
    return x if x > LOG_FLOOR else LOG_FLOOR


def _empty(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, fontsize=10,
            color="#57606a")


def _plot_layers(r: SignoffResult) -> bytes:
    fig, ax = _fig()
    curve = r.analysis.location.curve
    ax.set_title("Error by layer (decoder-layer outputs, max over requests)", fontsize=10)
    ax.set_xlabel("decoder layer")
    ax.set_ylabel("rel L2 error")
    if not curve:
        _empty(ax, "no decoder-layer records in these captures")
        return _png(fig)
    steps = sorted({p.step for p in curve})
    if len(steps) > MAX_STEP_LINES:
        k = math.ceil(len(steps) / MAX_STEP_LINES)
        steps = sorted(set(steps[::k]) | {steps[-1]})
    ax.set_yscale("log")
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    pos = [p.rel_l2 for p in curve if p.rel_l2 > 0]
    floor = max(LOG_FLOOR, min(pos) / 100) if pos else LOG_FLOOR
    for st in steps:
        pts: dict[int, float] = {}
        for p in curve:
            if p.step == st:
                pts[p.layer] = max(pts.get(p.layer, 0.0), p.rel_l2)
        xs = sorted(pts)
        ax.plot(xs, [max(pts[x], floor) for x in xs], marker="o", ms=3,
                label="prefill (step 0)" if st == 0 else f"step {st}")
    tols = [r.analysis.diff.record(p.key).tolerance.rel_l2 for p in curve]
    if tols and max(tols) < 1e299:
        ax.axhline(max(tols), color="#cf222e", ls="--", lw=1, label="record tolerance")
    if r.scenario.thresholds.layer_rel_l2 is not None:
        ax.axhline(r.scenario.thresholds.layer_rel_l2, color="#9a6700", ls=":", lw=1,
                   label="layer_rel_l2 threshold")
    if not pos:
        _empty(ax, f"all layer outputs identical (rel L2 = 0, drawn at {LOG_FLOOR:g})")
    elif min(p.rel_l2 for p in curve) == 0:
        ax.axhline(floor, color="#8c959f", ls=":", lw=1, label="0 (identical) drawn here")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(True, which="major", alpha=0.3)
    return _png(fig)


def _plot_kl(r: SignoffResult) -> bytes:
    fig, ax = _fig()
    ax.set_title("Logits KL(ref || cand) by token position", fontsize=10)
    ax.set_xlabel("token position (prefill positions, then one per decode step)")
    ax.set_ylabel("KL")
    steps = r.analysis.diff.logits
    if not steps:
        _empty(ax, "no logits stored (capture with store = \"full\")")
        return _png(fig)
    ax.set_yscale("log")
    by_req: dict[int, list] = {}
    for s in steps:
        by_req.setdefault(s.key.req, []).append(s)
    allzero = True
    for req, ss in sorted(by_req.items()):
        xs, ys, prefill = [], [], 0
        flips_real, flips_tie = [], []
        for s in sorted(ss, key=lambda s: s.key.step):
            if s.key.step == 0:
                prefill = len(s.positions)
                base = 0
            else:
                base = prefill - 1 + s.key.step
            for i, p in enumerate(s.positions):
                x = base + i
                xs.append(x)
                ys.append(_floor(p.kl))
                allzero &= p.kl <= 0
                if not p.agree and i == len(s.positions) - 1:
                    (flips_tie if p.near_tie else flips_real).append((x, _floor(p.kl)))
        line, = ax.plot(xs, ys, marker=".", ms=3, lw=1, label=f"request {req}")
        if prefill and len(by_req) <= 4:
            ax.axvline(prefill - 0.5, color=line.get_color(), ls=":", lw=0.8)
        for pts, mk, col, lab in ((flips_tie, "o", "#d4a72c", "near-tie flip"),
                                  (flips_real, "X", "#cf222e", "real flip")):
            if pts:
                ax.scatter(*zip(*pts), marker=mk, s=50, color=col, zorder=5, label=lab)
    if r.scenario.thresholds.logits_kl is not None:
        ax.axhline(r.scenario.thresholds.logits_kl, color="#9a6700", ls="--", lw=1,
                   label="logits_kl threshold")
    if allzero:
        _empty(ax, f"identical logits (KL = 0, drawn at {LOG_FLOOR:g})")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(True, alpha=0.3)
    return _png(fig)


def _plot_tokens(r: SignoffResult) -> bytes:
    fig, ax = _fig()
    ax.set_title("Token agreement: does the candidate pick the reference's token?", fontsize=10)
    ax.set_xlabel("generated token (decode step that chooses it)")
    ax.set_ylabel("fraction of requests")
    steps = r.analysis.diff.logits
    if not steps:
        _empty(ax, "no logits stored: token agreement from generated ids only\n"
                   f"({percent(r.metrics.token_agreement)} of {r.metrics.tokens_compared})")
        return _png(fig)
    by_step: dict[int, list[bool]] = {}
    ties, reals = [], []
    for s in steps:
        if not s.positions:
            continue
        p = s.positions[-1]
        by_step.setdefault(s.key.step, []).append(p.agree)
    xs = sorted(by_step)
    per = [sum(v) / len(v) for v in (by_step[x] for x in xs)]
    n_agree = n = 0
    cum = []
    for x in xs:
        n_agree += sum(by_step[x])
        n += len(by_step[x])
        cum.append(n_agree / n)
    ax.plot(xs, per, marker="o", label="agreement at this step")
    ax.plot(xs, cum, marker="s", ls="--", label="cumulative token agreement")
    for f in r.analysis.diff.flips:
        if f.step in by_step:
            y = sum(by_step[f.step]) / len(by_step[f.step])
            (ties if f.near_tie else reals).append((f.step, y))
    if ties:
        ax.scatter(*zip(*ties), marker="o", s=80, facecolors="none", edgecolors="#d4a72c",
                   lw=2, zorder=5, label="near-tie flip")
    if reals:
        ax.scatter(*zip(*reals), marker="X", s=80, color="#cf222e", zorder=5, label="real flip")
    if r.scenario.thresholds.token_agreement is not None:
        ax.axhline(r.scenario.thresholds.token_agreement, color="#9a6700", ls=":", lw=1,
                   label="token_agreement threshold")
    ax.set_ylim(-0.05, 1.1)
    ax.set_xticks(xs)
    ax.legend(fontsize=7, loc="lower left")
    ax.grid(True, alpha=0.3)
    return _png(fig)


def _plot_worst(r: SignoffResult) -> bytes:
    fig, ax = _fig()
    ax.set_title("Worst records: rel L2 error / tolerance", fontsize=10)
    recs = [x for x in worst_records(r) if x.error > 0]
    locs = {str(x.key): x for x in r.analysis.location.records}
    if not recs:
        _empty(ax, "every record identical (rel L2 = 0)")
        ax.set_xticks([])
        ax.set_yticks([])
        return _png(fig)
    ratios = [min(x.error / max(x.tolerance.rel_l2, 1e-300), 1e12) for x in recs]
    labels = [f"s{x.key.step} r{x.key.req} {x.key.module}"
              + (f"/{x.key.op}" if x.key.op else "") for x in recs]
    labels = [lab if len(lab) <= 48 else "..." + lab[-45:] for lab in labels]
    ys = list(range(len(recs)))[::-1]
    kinds = ["ok" if x.within else (locs[str(x.key)].cause or "inherited") for x in recs]
    colors = {"ok": "#2da44e", "introduced": "#a40e26", "inherited": "#ff8182"}
    for kind, lab in (("introduced", "over tolerance, introduced here"),
                      ("inherited", "over tolerance, inherited"), ("ok", "within tolerance")):
        sel = [i for i, k in enumerate(kinds) if k == kind]
        if sel:
            ax.barh([ys[i] for i in sel], [max(ratios[i], LOG_FLOOR) for i in sel],
                    color=colors[kind], log=True, label=lab)
    ax.legend(fontsize=7, loc="lower right")
    ax.set_yticks(ys)
    ax.set_yticklabels(labels, fontsize=6)
    ax.axvline(1.0, color="#57606a", ls="--", lw=1)
    ax.set_xlabel("error / tolerance (> 1: over tolerance)")
    ax.grid(True, axis="x", alpha=0.3)
    return _png(fig)
