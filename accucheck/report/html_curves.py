"""The diff page's charts (accucheck.report.html_diff): the per-layer error curves, the
candidate against the control runs' band, the logits table and token flips, the MoE routing
agreement, each as inline SVG or a table. Imports compare, verdict and report.diff / routing;
formats only.
"""
from __future__ import annotations

import html
import math

from accucheck.compare.results import DiffResult
from accucheck.compare.routing import RoutingResult
from accucheck.keys import layer_of
from accucheck.numbers import number
from accucheck.report.routing import routing_lines
from accucheck.verdict.locate import Analysis


def _e(x: object) -> str:
    return html.escape(str(x), quote=True)


PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
           "#7f7f7f", "#bcbd22", "#17becf")
W, H, X0, Y0 = 760, 280, 50, 20       # the chart's size and its plot area's corner
PW, PH = W - X0 - 110, H - Y0 - 30    # the plot area (the legend sits to its right)
# One <g> of a chart: (its selection attributes {"step": "3", "req": "all"} or {}, series label
# -> layer -> value, a (low, high) band per layer or None). The page's step and request switches
# show the groups whose attributes match the selection ("all": every step / request).
Group = tuple[dict, dict, "dict | None"]


def _selections(values) -> list[str]:
    """"all" then each value, when there is more than one; else "all" alone."""
    vs = sorted(set(values))
    return ["all"] + [str(v) for v in vs] if len(vs) > 1 else ["all"]


def _curves(a: Analysis) -> str:
    """rel_l2 of each decoder layer's output, one line per step, log scale, with the layers'
    tolerance dashed: for every request (max over them) and, with several, each request (the
    request switch picks). With control runs, a second chart: the candidate's error at the layer
    outputs within the band of the controls' (their measure, the mean elementwise relative
    error) for the step and request the switches pick ("all": max over them)."""
    L, d = a.location, a.diff
    reqs = _selections(p.req for p in L.curve)
    pts: dict[str, dict[str, dict[int, float]]] = {q: {} for q in reqs}
    for p in sorted(L.curve, key=lambda p: p.step):
        for q in {"all", str(p.req)} & set(reqs):
            s = pts[q].setdefault(f"step {p.step}", {})
            s[p.layer] = max(s.get(p.layer, 0.0), p.rel_l2)
    if not L.curve:
        return "<p>no decoder-layer outputs recorded</p>"
    curve = {str(p.key): p.layer for p in L.curve}
    held = [(curve[str(r.key)], r) for r in d.records if str(r.key) in curve]
    tol = max((r.tolerance.rel_l2 for _, r in held), default=0.0)
    groups = [({"req": q} if len(reqs) > 1 else {}, pts[q], None) for q in reqs]
    out = _chart("curves", groups, (tol, "tolerance") if tol > 0 else None)
    band = _control_groups(held, reqs)
    if band:
        out += ("<h3>Candidate against the control runs (elementwise relative error at "
                "the layer outputs; the band: the controls', for the step and request picked "
                "above)</h3>" + _chart("control-curves", band, None))
    return out


def _control_groups(held: list, reqs: list[str]) -> list[Group]:
    """One group per (step, request) selection: the candidate's elementwise error per layer and
    the band of the control runs' ("all": max / min over the steps or requests)."""
    recs = [(ly, r) for ly, r in held if r.control]
    steps = _selections(r.key.step for _, r in recs)
    band: dict[tuple[str, str], dict[int, tuple[float, float]]] = {}
    cand: dict[tuple[str, str], dict[int, float]] = {}
    for ly, r in recs:
        for s in {"all", str(r.key.step)} & set(steps):
            for q in {"all", str(r.key.req)} & set(reqs):
                b, c = band.setdefault((s, q), {}), cand.setdefault((s, q), {})
                lo, hi = b.get(ly, (math.inf, 0.0))
                b[ly] = (min(lo, min(r.control)), max(hi, max(r.control)))
                c[ly] = max(c.get(ly, 0.0), r.elem_error)
    out = []
    for (s, q), b in band.items():
        attrs = ({"step": s} if len(steps) > 1 else {}) | ({"req": q} if len(reqs) > 1 else {})
        out.append((attrs, {"candidate": cand[(s, q)]}, b))
    return out


class _Frame:
    """A chart's axes: x = layer, y = value on a log10 scale (or a linear one)."""

    def __init__(self, layers: list[int], vals: list[float], log: bool):
        self.layers, self.log = layers, log
        if log:
            pos = [v for v in vals if 0 < v < math.inf]
            self.lo = math.floor(math.log10(min(pos))) if pos else -8
            self.hi = max(math.ceil(math.log10(max(pos))) if pos else 0, self.lo + 1)
        else:
            fin = [v for v in vals if math.isfinite(v)]
            self.hi = math.ceil(max(fin, default=1.0))
            self.lo = min(math.floor(min(fin, default=0.0)), self.hi - 1)

    def x(self, ly: int) -> float:
        ls = self.layers
        return X0 + PW * (ly - ls[0]) / max(1, ls[-1] - ls[0])

    def y(self, v: float) -> float:
        if self.log:
            v = math.log10(v) if v > 0 else self.lo
        v = min(max(v, self.lo), self.hi) if not math.isnan(v) else self.lo
        return Y0 + PH * (self.hi - v) / (self.hi - self.lo)

    def ticks(self) -> list[tuple[float, str]]:
        if self.log:
            return [(10.0 ** e, f"1e{e}") for e in range(self.lo, self.hi + 1)]
        step = (self.hi - self.lo) / 4
        return [(self.lo + i * step, f"{self.lo + i * step:g}") for i in range(5)]


def _chart(name: str, groups: list[Group], hline: tuple | None, log: bool = True) -> str:
    """An inline SVG: x = layer, y on a log scale (`log`) or a linear one, an optional dashed
    (value, label) line, and per group (see Group) a shaded band and one polyline per series;
    a series' colour is its label's, the same in every group."""
    labels = list(dict.fromkeys(lb for _, series, _ in groups for lb in series))
    colour = {lb: PALETTE[i % len(PALETTE)] for i, lb in enumerate(labels)}
    vals = [v for _, series, b in groups for s in series.values() for v in s.values()]
    vals += [v for _, _, b in groups for lh in (b or {}).values() for v in lh]
    vals += [hline[0]] if hline else []
    layers = sorted({ly for _, series, b in groups for s in [*series.values(), b or {}]
                     for ly in s})
    f = _Frame(layers, vals, log)
    out = [f'<svg id="{name}" width="{W}" height="{H}" viewBox="0 0 {W} {H}" role="img">',
           f'<rect x="{X0}" y="{Y0}" width="{PW}" height="{PH}" fill="none" stroke="#999"/>']
    out += [f'<text x="{X0 - 4}" y="{f.y(v) + 3:.1f}" text-anchor="end">{t}</text>'
            for v, t in f.ticks()]
    out += [f'<text x="{f.x(ly):.1f}" y="{Y0 + PH + 14}" text-anchor="middle">{ly}</text>'
            for ly in layers[::max(1, len(layers) // 16)]]
    out.append(f'<text x="{X0 + PW / 2}" y="{H - 2}" text-anchor="middle">layer</text>')
    if hline:
        yy = f.y(hline[0])
        out.append(f'<line x1="{X0}" x2="{X0 + PW}" y1="{yy:.1f}" y2="{yy:.1f}" '
                   f'stroke="#c0392b" stroke-dasharray="4 3"/><text x="{X0 + PW + 4}" '
                   f'y="{yy + 3:.1f}" fill="#c0392b">{_e(hline[1])}</text>')
    for attrs, series, band in groups:
        alt = any(v != "all" for v in attrs.values())  # hidden until a switch picks it
        out.append("<g" + "".join(f' data-{k}="{_e(v)}"' for k, v in attrs.items())
                   + (' class="alt"' if alt else "") + ">")
        if band:
            ks = sorted(band)
            edge = [f"{f.x(k):.1f},{f.y(band[k][1]):.1f}" for k in ks] + \
                [f"{f.x(k):.1f},{f.y(band[k][0]):.1f}" for k in reversed(ks)]
            out.append(f'<polygon class="band" points="{" ".join(edge)}" fill="#9ecae1" '
                       f'fill-opacity="0.5" stroke="none"/>')
        for label, ys in series.items():
            line = " ".join(f"{f.x(ly):.1f},{f.y(ys[ly]):.1f}" for ly in layers if ly in ys)
            out.append(f'<polyline class="curve" fill="none" stroke="{colour[label]}" '
                       f'stroke-width="1.5" points="{line}"><title>{_e(label)}</title>'
                       "</polyline>")
        out.append("</g>")
    if any(b for _, _, b in groups):
        out.append(f'<text x="{X0 + PW + 4}" y="{Y0 + 12}" fill="#3182bd">controls</text>')
    out += [f'<text x="{X0 + PW + 4}" y="{Y0 + 36 + 12 * i}" fill="{colour[lb]}">{_e(lb)}'
            "</text>" for i, lb in enumerate(labels[:12])]
    return "".join(out) + "</svg>"


def _logits(d: DiffResult) -> str:
    """KL and top-1 agreement per logits record, then every token flip, labelled near-tie or
    real (the diff's label, never re-judged)."""
    if not d.logits and not d.flips:
        return "<p>no logits recorded</p>"
    rows = "".join(
        f"<tr><td>{s.key.req}</td><td>{s.key.step}</td><td>{len(s.positions)}</td>"
        f"<td>{number(s.max_kl)}</td><td>{number(s.top1_agreement)}</td>"
        f"<td>{_kl_bars(s)}</td></tr>" for s in d.logits)
    out = ('<table class="t" id="logits"><tr><th>request</th><th>step</th><th>positions</th>'
           '<th>max KL</th><th>top-1 agree</th><th>KL per position</th></tr>' + rows +
           "</table>")
    if not d.flips:
        return out + "<p>token flips: none</p>"
    items = "".join(
        f'<li class="{"tie" if f.near_tie else "real" if f.near_tie is False else ""}">'
        f"request {f.req} step {f.step} position {f.position}: ref {f.ref_token} vs cand "
        f"{f.cand_token}: {_e(f.label)} (margin {number(f.margin)}, noise {number(f.noise)})</li>"
        for f in d.flips[:50])
    more = f"<p>... {len(d.flips) - 50} more (--format json)</p>" if len(d.flips) > 50 else ""
    return out + f'<p>token flips:</p><ul id="flips">{items}</ul>{more}'


def _routing(d: DiffResult) -> str:
    """MoE routing: the agreement per layer as a chart (one line per step; the request switch
    picks a request) and per router as the text report says it (report.routing); nothing when
    the diff holds no router."""
    if d.routing is None:
        return ""
    return ("<h2>MoE routing</h2>" + _routing_chart(d.routing) + '<pre id="routing">'
            + _e("\n".join(routing_lines(d.routing, "simple"))) + "</pre>")


def _routing_chart(routing: RoutingResult) -> str:
    """Per decoder layer, the share of (token, router call) pairs sent to the same experts on
    both sides, in %; "" when no router call sits in a layer."""
    calls = [(layer_of(c.router), c) for c in routing.calls]
    calls = [(ly, c) for ly, c in calls if ly is not None and c.tokens]
    if not calls:
        return ""
    reqs = _selections(c.key.req for _, c in calls)
    tally: dict[str, dict[str, dict[int, list[int]]]] = {q: {} for q in reqs}
    for ly, c in sorted(calls, key=lambda x: x[1].key.step):
        for q in {"all", str(c.key.req)} & set(reqs):
            t = tally[q].setdefault(f"step {c.key.step}", {}).setdefault(ly, [0, 0])
            t[0] += len(c.flipped)
            t[1] += c.tokens
    groups = [({"req": q} if len(reqs) > 1 else {},
               {s: {ly: 100.0 * (1 - f / n) for ly, (f, n) in t.items()}
                for s, t in tally[q].items()}, None) for q in reqs]
    return ("<h3>Routing agreement per layer (% of token routings sent to the same experts)"
            "</h3>" + _chart("routing-curves", groups, None, log=False))


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
