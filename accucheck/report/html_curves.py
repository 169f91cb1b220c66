"""The diff page's charts (accucheck.report.html_diff): the per-layer error curves, the
candidate against the control runs' band, the logits table and token flips, the MoE routing
agreement, each as inline SVG or a table. Imports compare, verdict and report.diff / routing;
formats only.
"""
from __future__ import annotations

import html
import math

from accucheck.compare.results import DiffResult
from accucheck.report.diff import _g
from accucheck.report.routing import routing_lines
from accucheck.verdict.locate import Analysis


def _e(x: object) -> str:
    return html.escape(str(x), quote=True)


PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
           "#7f7f7f", "#bcbd22", "#17becf")


def _curves(a: Analysis) -> str:
    """rel_l2 of each decoder layer's output (max over requests), one line per step, log
    scale, with the layers' tolerance dashed; with control runs, a second chart: the
    candidate's error at the layer outputs within the band of the controls' (their measure,
    the mean elementwise relative error; max over requests and steps)."""
    L, d = a.location, a.diff
    pts: dict[str, dict[int, float]] = {}
    for p in sorted(L.curve, key=lambda p: p.step):
        s = pts.setdefault(f"step {p.step}", {})
        s[p.layer] = max(s.get(p.layer, 0.0), p.rel_l2)
    if not pts:
        return "<p>no decoder-layer outputs recorded</p>"
    curve = {str(p.key): p.layer for p in L.curve}
    held = [(curve[str(r.key)], r) for r in d.records if str(r.key) in curve]
    tol = max((r.tolerance.rel_l2 for _, r in held), default=0.0)
    out = _chart("curves", pts, (tol, "tolerance") if tol > 0 else None)
    band: dict[int, tuple[float, float]] = {}
    cand: dict[int, float] = {}
    for ly, r in held:
        if r.control:
            lo, hi = band.get(ly, (math.inf, 0.0))
            band[ly] = (min(lo, min(r.control)), max(hi, max(r.control)))
            cand[ly] = max(cand.get(ly, 0.0), r.elem_error)
    if band:
        out += ("<h3>Candidate against the control runs (mean elementwise relative error at "
                "the layer outputs; the band: the controls')</h3>"
                + _chart("control-curves", {"candidate": cand}, None, band))
    return out


def _chart(name: str, series: dict[str, dict[int, float]], hline: tuple | None,
           band: dict[int, tuple[float, float]] | None = None) -> str:
    """An inline SVG: x = layer, log-scale y, one polyline per series, an optional dashed
    (value, label) line and a shaded (low, high) band per layer."""
    vals = [v for s in series.values() for v in s.values() if 0 < v < math.inf]
    vals += [v for b in (band or {}).values() for v in b if 0 < v < math.inf]
    vals += [hline[0]] if hline else []
    lo = math.floor(math.log10(min(vals))) if vals else -8
    hi = max(math.ceil(math.log10(max(vals))) if vals else 0, lo + 1)
    layers = sorted({ly for s in series.values() for ly in s} | set(band or {}))
    W, H, X0, Y0 = 760, 280, 50, 20
    pw, ph = W - X0 - 110, H - Y0 - 30

    def x(ly: int) -> float:
        return X0 + pw * (ly - layers[0]) / max(1, layers[-1] - layers[0])

    def y(v: float) -> float:
        lv = min(max(math.log10(v), lo), hi) if v > 0 else lo
        return Y0 + ph * (hi - lv) / (hi - lo)
    out = [f'<svg id="{name}" width="{W}" height="{H}" viewBox="0 0 {W} {H}" role="img">',
           f'<rect x="{X0}" y="{Y0}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>']
    out += [f'<text x="{X0 - 4}" y="{y(10.0 ** e) + 3:.1f}" text-anchor="end">1e{e}</text>'
            for e in range(lo, hi + 1)]
    out += [f'<text x="{x(ly):.1f}" y="{Y0 + ph + 14}" text-anchor="middle">{ly}</text>'
            for ly in layers[::max(1, len(layers) // 16)]]
    out.append(f'<text x="{X0 + pw / 2}" y="{H - 2}" text-anchor="middle">layer</text>')
    if band:
        ks = sorted(band)
        edge = [f"{x(k):.1f},{y(band[k][1]):.1f}" for k in ks] + \
            [f"{x(k):.1f},{y(band[k][0]):.1f}" for k in reversed(ks)]
        out.append(f'<polygon class="band" points="{" ".join(edge)}" fill="#9ecae1" '
                   f'fill-opacity="0.5" stroke="none"/><text x="{X0 + pw + 4}" '
                   f'y="{Y0 + 12}" fill="#3182bd">controls</text>')
    if hline:
        yy = y(hline[0])
        out.append(f'<line x1="{X0}" x2="{X0 + pw}" y1="{yy:.1f}" y2="{yy:.1f}" '
                   f'stroke="#c0392b" stroke-dasharray="4 3"/><text x="{X0 + pw + 4}" '
                   f'y="{yy + 3:.1f}" fill="#c0392b">{_e(hline[1])}</text>')
    for i, (label, ys) in enumerate(series.items()):
        c = PALETTE[i % len(PALETTE)]
        line = " ".join(f"{x(ly):.1f},{y(ys[ly]):.1f}" for ly in layers if ly in ys)
        out.append(f'<polyline class="curve" fill="none" stroke="{c}" stroke-width="1.5" '
                   f'points="{line}"><title>{_e(label)}</title></polyline>')
        if i < 12:
            out.append(f'<text x="{X0 + pw + 4}" y="{Y0 + 36 + 12 * i}" fill="{c}">'
                       f"{_e(label)}</text>")
    return "".join(out) + "</svg>"


def _logits(d: DiffResult) -> str:
    """KL and top-1 agreement per logits record, then every token flip, labelled near-tie or
    real (the diff's label, never re-judged)."""
    if not d.logits and not d.flips:
        return "<p>no logits recorded</p>"
    rows = "".join(
        f"<tr><td>{s.key.req}</td><td>{s.key.step}</td><td>{len(s.positions)}</td>"
        f"<td>{_g(s.max_kl)}</td><td>{_g(s.top1_agreement)}</td>"
        f"<td>{_kl_bars(s)}</td></tr>" for s in d.logits)
    out = ('<table class="t" id="logits"><tr><th>request</th><th>step</th><th>positions</th>'
           '<th>max KL</th><th>top-1 agree</th><th>KL per position</th></tr>' + rows +
           "</table>")
    if not d.flips:
        return out + "<p>token flips: none</p>"
    items = "".join(
        f'<li class="{"tie" if f.near_tie else "real" if f.near_tie is False else ""}">'
        f"request {f.req} step {f.step} position {f.position}: ref {f.ref_token} vs cand "
        f"{f.cand_token}: {_e(f.label)} (margin {_g(f.margin)}, noise {_g(f.noise)})</li>"
        for f in d.flips[:50])
    more = f"<p>... {len(d.flips) - 50} more (--format json)</p>" if len(d.flips) > 50 else ""
    return out + f'<p>token flips:</p><ul id="flips">{items}</ul>{more}'


def _routing(d: DiffResult) -> str:
    """MoE routing agreement per router, as the text report says it (report.routing)."""
    if d.routing is None:
        return ""
    return ('<h2>MoE routing</h2><pre id="routing">'
            + _e("\n".join(routing_lines(d.routing, "simple"))) + "</pre>")


def _kl_bars(s) -> str:
    """A small bar per position: log10 KL from 1e-12 to 1, red where top-1 differs."""
    ps = s.positions[:200]
    if not ps:
        return ""
    w = 3
    bars = []
    for i, p in enumerate(ps):
        h = 0.0 if p.kl <= 0 else 20 * min(1.0, max(0.0, (math.log10(p.kl) + 12) / 12))
        bars.append(f'<rect x="{i * w}" y="{20 - h:.1f}" width="{w - 1}" height="{h:.1f}" '
                    f'fill="{"#2c7fb8" if p.agree else "#c0392b"}"/>')
    return (f'<svg width="{len(ps) * w}" height="20">'
            + "".join(bars) + "</svg>")
