"""The diff as one self-contained HTML page (`accucheck diff --format html`): the verdict line,
the model as a heatmap (rows: layers, columns: module kinds in execution order, one panel per
step), each cell's metrics on hover / click, then the charts (report.html_curves: error per layer,
logits, MoE routing). Imports report.diff (the headline and text report, never re-derived),
verdict, compare and keys; formats only. Offline: inline CSS and script (report.html_assets),
nothing loaded.

A cell is one (step, layer, kind) over every request, call, operator and rank: it shows its
worst record, by error / tolerance or, with control runs, by the record's excess over its
site's threshold. Kinds: the module path below the layer ("self_attn.q_proj"; the layer block
itself: "block"), " in.S" for recorded inputs (o_proj's input is the attention core's output),
" out.S" for a second output; records outside the layers (embedding, final norm, logits) get
their own row. A marked record (culprit, first divergence, SUSPICIOUS) is the one its cell shows.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from accucheck.compare.results import RecordDiff
from accucheck.compare.routing import JUDGED_ELSEWHERE
from accucheck.keys import RecordKey, layer_kind, rank_slot, split_rank
from accucheck.report.diff import to_text, verdict_line
from accucheck.report.html_assets import CSS, FIELDS, JS, TEXT_FIELDS
from accucheck.report.html_curves import _curves, _e, _logits, _routing
from accucheck.verdict.locate import Analysis
from accucheck.verdict.types import RecordLocation

# cell marks, strongest first: CSS class m-<name>, the symbol shown in the cell, its meaning
MARKS = (("culprit", "\u2716", "culprit (the module the verdict names)"),
         ("first", "\u25b6", "first divergence"),
         ("sus", "!", "SUSPICIOUS (far above its peers' noise)"),
         ("over", "\u25c6", "first record over tolerance (no culprit named)"))
# colour buckets of log10(error / tolerance): b0..b4 within, b5..b9 over; z: identical
BUCKETS = (-3.0, -2.0, -1.0, -0.3, 0.0, 0.3, 1.0, 2.0, 3.0)
Cell = tuple[int, "int | None", str]  # (step, layer or None, kind)
# a record not compared on its tensors: what its rel_l2 is (shown in the detail box)
BASES = {"stats": "statistics only: rel_l2 is a lower bound",
         "sample": "statistics and sampled values: rel_l2 is an estimate",
         "shape": "shapes differ"}


@dataclass
class _Cell:
    """Accumulates the records of one heatmap cell (report-internal)."""
    value: float = -1.0               # worst error / tolerance (or excess / threshold)
    rec: RecordDiff | None = None
    loc: RecordLocation | None = None
    noise: tuple = (None, None, None)  # control ratio, excess, threshold of the record shown
    pinned: bool = False              # `rec` is a marked record (shown whatever its error)
    records: int = 0
    judged: int = 0                   # records compared and judged here
    per_request: dict = field(default_factory=dict)  # request -> its largest rel_l2 here
    one_side: list = field(default_factory=list)  # "KEY (only in ref)" of missing records
    marks: set = field(default_factory=set)


def column(key: RecordKey) -> tuple[int | None, str]:
    """(layer or None, kind) of the heatmap column a record falls in (module docstring)."""
    layer, kind = layer_kind(key.module)
    kind = kind or "block"
    slot = split_rank(key.slot)[0]
    if key.is_op:
        return layer, kind
    if key.role == "in":
        return layer, f"{kind} in.{slot}"
    return layer, kind if slot == "0" else f"{kind} out.{slot}"


def cell_of(key: RecordKey) -> Cell:
    return (key.step, *column(key))


def to_html(a: Analysis) -> str:
    """The page. Same verdict as every other format: `verdict_line(a)` verbatim."""
    d, cu = a.diff, a.culprit  # a property that searches: once
    cells, kinds, outside = _cells(a, _marks(a, cu))
    steps = sorted({c[0] for c in cells})
    layers = sorted({c[1] for c in cells if c[1] is not None})
    blob: list[list] = []
    panels = [_panel(cells, s, layers, kinds, outside, blob) for s in steps]
    verdict = verdict_line(a)
    cls = "pass" if a.within else "fail"
    culprit = ""
    if cu is not None:
        from accucheck.verdict.culprit import culprit_lines

        culprit = "<h2>Culprit</h2><pre id=\"culprit\">" + _e(
            "\n".join(culprit_lines(cu))) + "</pre>"
    buttons = "".join(f'<button type="button" data-step="{s}">step {s}</button>'
                      for s in steps) + '<button type="button" data-step="all">all</button>'
    first = a.location.first_divergence
    start = str(first.step) if first is not None else (str(steps[0]) if steps else "all")
    data = json.dumps(blob, separators=(",", ":"), allow_nan=False).replace("</", "<\\/")
    js = JS.replace("%FIELDS%", json.dumps(list(FIELDS))).replace(
        "%TEXT_FIELDS%", json.dumps(list(TEXT_FIELDS)))
    return "".join([
        "<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">",
        f"<title>accucheck diff: {a.verdict.upper()}</title><style>{CSS}</style></head><body>",
        f"<h1>accucheck diff</h1><p id=\"verdict\" class=\"{cls}\">{_e(verdict)}</p>",
        f"<p class=\"meta\">ref {_e(d.ref_path)} | cand {_e(d.cand_path)}"
        + (f" | golden {_e(d.golden_path)}" if d.golden_path else "")
        + f" | basis {_e(d.basis)} | {len(d.records)} compared, {len(d.failed)} over "
        f"tolerance, {len(d.missing)} on one side only</p>",
        culprit,
        "<h2>Model</h2>", _legend(a),
        f"<div class=\"steps\" id=\"steps\" data-first=\"{start}\">{buttons}</div>",
        "<div class=\"wrap\"><div>", "".join(panels) or "<p>no records compared</p>",
        "</div><div id=\"detail\">hover a cell for its metrics; click to pin</div></div>",
        "<h2>Error per layer</h2>", _curves(a),
        "<h2>Logits</h2>", _logits(d),
        _routing(d),
        "<h2>Text report</h2><details><summary>the same diff as text</summary><pre>",
        _e(to_text(a)), "</pre></details>",
        f"<script type=\"application/json\" id=\"acc-cells\">{data}</script>",
        f"<script>{js}</script></body></html>\n"])


# ----------------------------------------------------------------------------- cells

def _cells(a: Analysis, marked: dict[str, set[str]]) -> tuple[dict, list[str], list[str]]:
    """cell -> _Cell, the layer kinds and the outside-layer kinds in order of first appearance;
    `marked`: record key -> its marks (`_marks`)."""
    d, L = a.diff, a.location
    noise = L.noise
    by_key = {str(x.key): x for x in noise.records} if noise is not None else {}
    sites = {s.site: s for s in noise.sites} if noise is not None else {}
    cells: dict[Cell, _Cell] = {}
    kinds: dict[str, None] = {}
    outside: dict[str, None] = {}
    for r, loc in zip(d.records, L.records):
        c = cell_of(r.key)
        (kinds if c[1] is not None else outside).setdefault(c[2], None)
        x = cells.setdefault(c, _Cell())
        x.records += 1
        if r.routing in JUDGED_ELSEWHERE or r.absorbed:
            continue  # not judged by its numbers here: shown as not compared unless others are
        x.judged += 1
        rn, site = by_key.get(str(r.key)), sites.get(r.key.site)
        if rn is not None and site is not None:
            v, ns = rn.excess / site.threshold, (rn.ratio, rn.excess, site.threshold)
        else:
            tol = r.tolerance.rel_l2
            v = r.error / tol if tol > 0 else (math.inf if r.error else 0.0)
            ns = (None, None, None)
        v = math.inf if math.isnan(v) else v
        x.value = max(x.value, v)
        q = r.key.req
        x.per_request[q] = max(x.per_request.get(q, 0.0), r.error)
        pin = str(r.key) in marked
        if x.rec is None or (pin and not x.pinned) or (v >= x.value and not x.pinned):
            x.rec, x.loc, x.noise, x.pinned = r, loc, ns, pin
    for m in d.missing:
        key = RecordKey.parse(m.key)
        c = cell_of(key)
        (kinds if c[1] is not None else outside).setdefault(c[2], None)
        cells.setdefault(c, _Cell()).one_side.append(f"{m.key} (only in {m.only_in})")
    for k, ms in marked.items():
        c = cells.get(cell_of(RecordKey.parse(k)))
        if c is not None:
            c.marks.update(ms)
    return cells, list(kinds), list(outside)


def _marks(a: Analysis, cu) -> dict[str, set[str]]:
    """record key -> its marks: the culprit (`cu`, a.culprit), the first divergence,
    SUSPICIOUS records and, when no record is named, the first record over tolerance."""
    L, out = a.location, {}
    diffed = {str(r.key) for r in a.diff.records}
    if cu is not None:
        own = RecordKey(cu.req, cu.step, cu.module, cu.call, "out",
                        "0" if cu.rank is None else rank_slot("0", cu.rank))
        k = next((str(k) for k in (own, cu.seen_at, cu.op_key)
                  if k is not None and str(k) in diffed), None)
        if k is not None:
            out.setdefault(k, set()).add("culprit")
    if L.first_divergence is not None:
        out.setdefault(str(L.first_divergence.key), set()).add("first")
    elif L.first_over is not None:
        out.setdefault(str(L.first_over.key), set()).add("over")
    for x in L.suspicious:
        out.setdefault(str(x.key), set()).add("sus")
    return out


def _bucket(v: float) -> str:
    if v <= 0:
        return "z"
    lv = math.log10(v)
    return f"b{sum(lv > b for b in BUCKETS)}"


def _n(x: float | None) -> float | str | None:
    """A number for the JSON blob: 4 significant digits; inf / nan as strings."""
    if x is None:
        return None
    if not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    return float(f"{x:.4g}")


def _row(x: _Cell) -> list:
    """The cell's fields for the blob, in html_assets.FIELDS order."""
    marks = [m for m, _, _ in MARKS if m in x.marks]
    if x.rec is None:
        status = "one side only" if x.one_side else "not judged here (MoE routing)"
        key = x.one_side[0] if x.one_side else ""
        return [key, status] + [None] * 10 + [str(x.records + len(x.one_side)), [], None, marks]
    r, loc, m = x.rec, x.loc, x.rec.metrics
    status = "pass" if r.within else ("shape differs" if r.basis == "shape"
                                      else loc.cause or "over")
    if r.within and not r.within_tolerance:
        status = "pass (golden referee)"
    n = f"{x.records}" + (f" (+{len(x.one_side)} one side only)" if x.one_side else "")
    feeds = (loc.input_from[0] + (f" (+{len(loc.input_from) - 1})" if len(loc.input_from) > 1
                                  else "") + f" [{loc.input_basis}]") if loc.input_from else None
    reqs = [_n(x.per_request[q]) for q in sorted(x.per_request)] if len(x.per_request) > 1 \
        else []
    basis = None if r.basis == "tensor" else BASES.get(r.basis, r.basis)
    return [str(r.key), status, basis, _n(r.error), _n(m.cosine if m else None),
            _n(m.max_abs if m else None), _n(r.tolerance.rel_l2), *map(_n, x.noise),
            _n(loc.input_error), feeds, n, reqs,
            r.golden.label if r.golden is not None else None, marks]


def _td(x: _Cell | None, blob: list) -> str:
    if x is None:
        return '<td class="e"></td>'
    cls = [_bucket(x.value)] if x.judged else ["nc"]
    sym = ""
    for m, s, _ in MARKS:
        if m in x.marks:
            cls.append(f"m-{m}")
            sym = sym or s
    blob.append(_row(x))
    return f'<td class="{" ".join(cls)}" data-c="{len(blob) - 1}">{sym}</td>'


def _panel(cells: dict, step: int, layers: list[int], kinds: list[str], outside: list[str],
           blob: list) -> str:
    """One step's heatmap: the layers' table, then the row of records outside the layers."""
    head = "".join(f"<th>{_e(k)}</th>" for k in kinds)
    rows = "".join(f"<tr><th>{ly}</th>"
                   + "".join(_td(cells.get((step, ly, k)), blob) for k in kinds) + "</tr>"
                   for ly in layers)
    out = (f'<section class="panel" data-step="{step}"><h3>step {step}'
           f'{" (prefill)" if step == 0 else " (decode)"}</h3>')
    if layers:
        out += (f'<table class="hm layers"><thead><tr><th>layer</th>{head}</tr></thead>'
                f"<tbody>{rows}</tbody></table>")
    if outside:
        head = "".join(f"<th>{_e(k)}</th>" for k in outside)
        tds = "".join(_td(cells.get((step, None, k)), blob) for k in outside)
        out += (f'<table class="hm outside"><thead><tr><th></th>{head}</tr></thead>'
                f"<tbody><tr><th>outside layers</th>{tds}</tr></tbody></table>")
    return out + "</section>"


def _legend(a: Analysis) -> str:
    what = ("excess over the control threshold" if a.location.noise is not None
            else "rel_l2 / tolerance")
    edges = ["0"] + [f"1e{b:g}" if b not in (0.3, -0.3) else f"{10 ** b:.1f}"
                     for b in BUCKETS]
    spans = ['<span class="z">identical</span>'] + [
        f'<span class="b{i}">{"&le;" if i < 9 else "&gt;"} '
        f'{edges[i + 1] if i < 9 else edges[9]}</span>' for i in range(10)]
    marks = " ".join(f"{s} {_e(t)}" for _, s, t in MARKS)
    return (f'<p class="legend">colour: {what} (worst record of the cell, over requests, '
            f'calls and operators) {"".join(spans)}<span class="nc">not compared</span>'
            f"<br>{marks}</p>")
