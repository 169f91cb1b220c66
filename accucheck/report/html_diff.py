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

The request switch recolours the heatmap from one request's records (each cell carries one
colour character per request, `req_colour`, and its marks' requests, `data-q`) and shows that
request's curves; the detail box then gives that request's largest rel_l2 in the cell and, in
full, the cell's worst record over all requests (one record per cell, not per request: the
80 x 15 x 8 x 4 page stays near 2.8 MB). The detail box holds both sides' index statistics
(store.Stats, 3 digits), the capture's input links, the tensor-parallel rank, and dtype /
shape where the sides differ.
"""
from __future__ import annotations

import json
import math
from bisect import bisect_left
from dataclasses import dataclass, field

from accucheck.compare.results import RecordDiff
from accucheck.compare.routing import JUDGED_ELSEWHERE
from accucheck.keys import RecordKey, layer_kind, rank_slot, split_rank
from accucheck.numbers import number
from accucheck.report.diff import to_text, verdict_line
from accucheck.report.html_assets import CSS, FIELDS, JS, STATS, TEXT_FIELDS
from accucheck.report.html_curves import _curves, _e, _logits, _routing
from accucheck.store import Stats
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
    req_value: dict = field(default_factory=dict)    # request -> its largest `value` here
    reqs: set = field(default_factory=set)           # requests with a record here
    one_side: list = field(default_factory=list)  # "KEY (only in ref)" of missing records
    marks: dict = field(default_factory=dict)     # mark -> the requests of its records


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


def to_html(a: Analysis, impact: str | None = None) -> str:
    """The page. Same verdict as every other format: `verdict_line(a)` verbatim. `impact`:
    the line `diff --impact` adds (accucheck.impact.join.impact_line), under the culprit."""
    d, cu = a.diff, a.culprit  # a property that searches: once
    cells, kinds, outside = _cells(a, _marks(a, cu))
    steps = sorted({c[0] for c in cells})
    layers = sorted({c[1] for c in cells if c[1] is not None})
    reqs = sorted({q for x in cells.values() for q in x.reqs})
    blob: list[list] = []
    panels = [_panel(cells, s, layers, kinds, outside, blob, reqs) for s in steps]
    verdict = verdict_line(a)
    cls = "pass" if a.within else "fail"
    culprit = ""
    if cu is not None:
        from accucheck.verdict.culprit import culprit_lines

        culprit = "<h2>Culprit</h2><pre id=\"culprit\">" + _e(
            "\n".join(culprit_lines(cu))) + "</pre>"
    if impact:
        culprit += f"<p id=\"impact\">{_e(impact)}</p>"
    first = a.location.first_divergence
    start = str(first.step) if first is not None else (str(steps[0]) if steps else "all")
    data = json.dumps(blob, separators=(",", ":"), allow_nan=False).replace("</", "<\\/")
    js = JS
    for name, value in (("FIELDS", FIELDS), ("TEXT_FIELDS", TEXT_FIELDS), ("STATS", STATS),
                        ("MARKS", [(m, sym) for m, sym, _ in MARKS])):
        js = js.replace(f"%{name}%", json.dumps(list(value)))
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
        _switches(steps, reqs, start),
        "<div class=\"wrap\"><div>", "".join(panels) or "<p>no records compared</p>",
        "</div><div id=\"detail\">hover a cell for its metrics; click to pin</div></div>",
        "<h2>Error per layer</h2>", _curves(a),
        "<h2>Logits</h2>", _logits(d),
        _routing(d),
        "<h2>Text report</h2><details><summary>the same diff as text</summary><pre>",
        _e(to_text(a)), "</pre></details>",
        f"<script type=\"application/json\" id=\"acc-cells\">{data}</script>",
        f"<script>{js}</script></body></html>\n"])


def _switches(steps: list[int], reqs: list[int], start: str) -> str:
    """The step switch (one panel, `start` first) and, with several requests, the request
    switch (the heatmap's colours, marks and the curves of one request, or of all: the worst
    over them)."""
    out = ('<div class="steps" id="steps" data-first="' + start + '">'
           + "".join(f'<button type="button" data-step="{s}">step {s}</button>' for s in steps)
           + '<button type="button" data-step="all">all</button></div>')
    if len(reqs) > 1:
        out += ('<div class="steps" id="reqs" data-reqs="' + " ".join(map(str, reqs)) + '">'
                + '<button type="button" data-req="all">all requests</button>'
                + "".join(f'<button type="button" data-req="{q}">request {q}</button>'
                          for q in reqs) + "</div>")
    return out


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
        x.reqs.add(r.key.req)
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
        x.req_value[q] = max(x.req_value.get(q, -1.0), v)
        pin = str(r.key) in marked
        if x.rec is None or (pin and not x.pinned) or (v >= x.value and not x.pinned):
            x.rec, x.loc, x.noise, x.pinned = r, loc, ns, pin
    for m in d.missing:
        key = RecordKey.parse(m.key)
        c = cell_of(key)
        (kinds if c[1] is not None else outside).setdefault(c[2], None)
        x = cells.setdefault(c, _Cell())
        x.one_side.append(f"{m.key} (only in {m.only_in})")
        x.reqs.add(key.req)
    for k, ms in marked.items():
        key = RecordKey.parse(k)
        c = cells.get(cell_of(key))
        for m in ms if c is not None else ():
            c.marks.setdefault(m, set()).add(key.req)
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
    return f"b{bisect_left(BUCKETS, math.log10(v))}"  # how many edges lie below it


def _n(x: float | None, digits: int = 4) -> float | str | None:
    """A number for the JSON blob: 4 significant digits (3 for what is only shown: the detail
    box shows 3); inf / nan as strings."""
    if x is None:
        return None
    if not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    return float(_DIGITS[digits] % x)


_DIGITS = {3: "%.3g", 4: "%.4g"}


def _stats(r: RecordDiff) -> tuple[list | None, list | int | None]:
    """Each side's index statistics for the blob (html_assets.STATS order, 3 digits): the
    counts only as far as one is not zero; the candidate's as 0 where it shows the same."""
    def one(st: Stats | None) -> list | None:
        if st is None:
            return None
        v = [float("%.3g" % x) if math.isfinite(x) else _n(x)
             for x in (st.min, st.max, st.mean, st.std, st.absmax, st.l2)]
        counts = [st.nan, st.inf, st.zero]
        while counts and not counts[-1]:
            counts.pop()
        return v + counts
    ref, cand = one(r.ref_stats), one(r.cand_stats)
    return ref, (0 if cand is not None and cand == ref else cand)


def _req_colour(x: _Cell, reqs: list[int]) -> str:
    """One character per request of the page: its colour bucket here ("0".."9", "z": identical),
    "n": recorded but not compared, "-": no record of it here."""
    out = []
    for q in reqs:
        if q in x.req_value:
            b = _bucket(x.req_value[q])
            out.append(b[1:] or b)
        else:
            out.append("n" if q in x.reqs else "-")
    return "".join(out)


def _row(x: _Cell, reqs: list[int]) -> list:
    """The cell's fields for the blob, in html_assets.FIELDS order, without the empty ones at
    the end (rare fields come last: the page stays small)."""
    marks = [m for m, _, _ in MARKS if m in x.marks]
    several = len(reqs) > 1
    per_req = [_n(x.per_request.get(q), 3) for q in reqs] if several else None
    colour = _req_colour(x, reqs) if several else None
    n = f"{x.records}" + (f" (+{len(x.one_side)} one side only)" if x.one_side else "")
    if x.rec is None:
        status = "one side only" if x.one_side else "not judged here (MoE routing)"
        key = x.one_side[0] if x.one_side else ""
        return _trim([key, status] + [None] * 6
                     + [str(x.records + len(x.one_side)), per_req, colour] + [None] * 8
                     + [marks])
    r, loc, m = x.rec, x.loc, x.rec.metrics
    status = "pass" if r.within else ("shape differs" if r.basis == "shape"
                                      else loc.cause or "over")
    if r.within and not r.within_tolerance:
        status = "pass (golden referee)"
    own = f"r{r.key.req}.s{r.key.step}:"  # the producers' keys share it: left out
    feeds = ", ".join(k.removeprefix(own) for k in loc.input_from[:1]) + (
        f" (+{len(loc.input_from) - 1})" if len(loc.input_from) > 1 else "") + \
        f" [{loc.input_basis}]" if loc.input_from else None
    basis = None if r.basis == "tensor" else BASES.get(r.basis, r.basis)
    return _trim([str(r.key), status, _n(r.error), _n(m.cosine if m else None),
                  _n(m.max_abs if m else None), _n(r.tolerance.rel_l2), _n(loc.input_error),
                  feeds, n, per_req, colour, *_stats(r), basis,
                  *map(_n, x.noise), _control(r),
                  r.golden.label if r.golden is not None else None, marks, *_notes(r)])


def _control(r: RecordDiff) -> str | None:
    if not r.control:
        return None
    return (f"cand {number(r.elem_error)}; controls " + ", ".join(number(c) for c in r.control)
            + (" (RMS elementwise error, from the sketches)" if r.sketch is not None
               else " (mean elementwise relative error)"))


def _notes(r: RecordDiff) -> list[str | None]:
    """dtype, shape (where the sides differ), the capture's input links, the tensor-parallel
    rank, the candidate's key (op alignment), MoE routing: FIELDS' last six."""
    rank, own = split_rank(r.key.slot)[1], f"r{r.key.req}.s{r.key.step}:"
    return [f"ref {r.ref_dtype}, cand {r.cand_dtype}" if r.ref_dtype != r.cand_dtype else None,
            f"ref {list(r.ref_shape)}, cand {list(r.cand_shape)}"
            if r.ref_shape != r.cand_shape else None,
            "; ".join(f"in.{slot} <- {site.removeprefix(own)}" for slot, site in r.src) or None,
            None if rank is None else
            f"tensor-parallel rank {rank}: that rank's copy of the tensor (or its shard, "
            "compared with its slice of the other side's) against the other side's record",
            str(r.cand_key) if r.cand_key is not None else None,
            None if r.routing is None else r.routing + (
                f" ({r.rows_excluded} token rows routed differently left out)"
                if r.rows_excluded else "")]


def _trim(row: list) -> list:
    while row and row[-1] in (None, [], ""):
        row.pop()
    return row


def _td(x: _Cell | None, blob: list, reqs: list[int]) -> str:
    if x is None:
        return '<td class="e"></td>'
    cls = [_bucket(x.value)] if x.judged else ["nc"]
    sym = ""
    for m, s, _ in MARKS:
        if m in x.marks:
            cls.append(f"m-{m}")
            sym = sym or s
    blob.append(_row(x, reqs))
    qs = " ".join(f"{m}.{q}" for m, _, _ in MARKS for q in sorted(x.marks.get(m, ())))
    return (f'<td class="{" ".join(cls)}" data-c="{len(blob) - 1}"'
            + (f' data-q="{qs}"' if qs and len(reqs) > 1 else "") + f">{sym}</td>")


def _panel(cells: dict, step: int, layers: list[int], kinds: list[str], outside: list[str],
           blob: list, reqs: list[int]) -> str:
    """One step's heatmap: the layers' table, then the row of records outside the layers."""
    head = "".join(f"<th>{_e(k)}</th>" for k in kinds)
    rows = "".join(f"<tr><th>{ly}</th>"
                   + "".join(_td(cells.get((step, ly, k)), blob, reqs) for k in kinds) + "</tr>"
                   for ly in layers)
    out = (f'<section class="panel" data-step="{step}"><h3>step {step}'
           f'{" (prefill)" if step == 0 else " (decode)"}</h3>')
    if layers:
        out += (f'<table class="hm layers"><thead><tr><th>layer</th>{head}</tr></thead>'
                f"<tbody>{rows}</tbody></table>")
    if outside:
        head = "".join(f"<th>{_e(k)}</th>" for k in outside)
        tds = "".join(_td(cells.get((step, None, k)), blob, reqs) for k in outside)
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
