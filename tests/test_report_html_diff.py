"""`accucheck diff --format html`: the page's verdict is the text report's headline, the planted
fault's culprit cell is marked and a clean pair marks nothing, cells not compared are hatched,
nothing is loaded from outside, an 80-layer x 15-kind x 8-step x 4-request diff renders within a
bounded size, the detail box holds both sides' statistics, the rank and the capture's input
links, the request switch colours and marks one request's records and shows its curves, the
control band is drawn per step, MoE routing agreement is charted per layer (and nothing without
a router), and the page opens in headless Chromium with no console errors, its request switch
working (screenshots left in /tmp/accucheck-diff-*.png for people to look at).

DOM checks parse the page with html.parser; the browser test drives Chromium over the DevTools
pipe (tests/browser.py), marked `browser`, skipped only when no chromium binary is installed.
"""
from __future__ import annotations

import base64
import html
import json
import math
import re
import shutil
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

import diffcases
import htmlcases
from accucheck.cli import main
from accucheck.compare.tolerances import ToleranceTable
from accucheck.report.diff import to_text, verdict_line
from accucheck.report.html_diff import BUCKETS, to_html
from accucheck.report.routing import routing_lines
from accucheck.verdict.locate import analyze
from test_diff import base, write
from test_moe import GATE, moe  # noqa: F401 (the fixture)

MAX_DEEP_PAGE = 4 << 20  # bytes, the 80 x 15 x 8 x 4 page (bench/bench_html_diff.py)


class Page(HTMLParser):
    """Tags with their attributes, the verdict's text and the cells' JSON blob."""

    def __init__(self, text: str):
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self._in: str | None = None
        self.verdict = ""
        self.blob = ""
        self.feed(text)
        self.cells = json.loads(self.blob) if self.blob else []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.append((tag, a))
        if a.get("id") in ("verdict", "acc-cells"):
            self._in = a["id"]

    def handle_endtag(self, tag):
        if tag in ("p", "script"):
            self._in = None

    def handle_data(self, data):
        if self._in == "verdict":
            self.verdict += data
        elif self._in == "acc-cells":
            self.blob += data

    def tds(self, cls: str) -> list[dict]:
        return [a for t, a in self.tags if t == "td" and cls in a.get("class", "").split()]

    def cell(self, td: dict) -> dict:
        from accucheck.report.html_assets import FIELDS

        row = self.cells[int(td["data-c"])]  # a row ends at its last non-empty field
        return dict(zip(FIELDS, row + [None] * (len(FIELDS) - len(row))))


@pytest.fixture(scope="module")
def tiny_pairs(tiny, tmp_path_factory):
    d = tmp_path_factory.mktemp("html_diff")
    model, tok = tiny
    ref = diffcases.make("ref", model, tok, d / "ref.h5")
    return {"ref": ref, "cand": diffcases.make("norm_bf16", model, tok, d / "cand.h5", ref),
            "same": diffcases.make("same", model, tok, d / "same.h5", ref)}


@pytest.fixture(scope="module")
def planted(tiny_pairs):
    a = analyze(tiny_pairs["ref"], tiny_pairs["cand"])
    return a, to_html(a)


@pytest.fixture(scope="module")
def clean(tiny_pairs):
    a = analyze(tiny_pairs["ref"], tiny_pairs["same"])
    return a, to_html(a)


def test_verdict_is_the_text_reports_headline(planted, clean):
    for a, text in (planted, clean):
        p = Page(text)
        assert p.verdict == verdict_line(a) == to_text(a).splitlines()[0]
        assert ('class="fail"' in text) == (not a.within)
    assert Page(planted[1]).verdict.startswith("FAIL: divergence starts at step 0, "
                                               f"{diffcases.NORM_FAULT} (out.0)")
    assert Page(clean[1]).verdict.startswith("PASS")


def test_planted_fault_cell_is_marked(planted):
    a, text = planted
    p = Page(text)
    assert a.culprit is not None and a.culprit.module == diffcases.NORM_FAULT
    (td,) = p.tds("m-culprit")  # one step names it: one cell
    c = p.cell(td)
    assert c["key"] == f"r0.s0:{diffcases.NORM_FAULT}#0:out.0" and "culprit" in c["marks"]
    assert c["status"] == "introduced" and c["rel_l2"] > c["tolerance"]
    assert len(c["per_request"]) == 2 and c["records"] == "2"  # the cell holds both requests
    assert c["input_from"].endswith("[inputs]") and c["input_rel_l2"] == 0
    assert text.split(f'data-c="{td["data-c"]}"', 1)[1].split(">", 1)[1][:1] == "\u2716"
    (first,) = p.tds("m-first")
    assert first is td
    # the cell sits in step 0's panel, in layer 2's row, in the post_attention_layernorm column
    panel = text.split('data-step="0"><h3>', 1)[1].split("</section>", 1)[0]
    head = re.findall(r"<th>([^<]*)</th>", panel.split("</thead>", 1)[0])
    row = panel.split("<tr><th>2</th>", 1)[1].split("</tr>", 1)[0]
    assert head[1 + [re.search(r'data-c="(\d+)"', t).group(1) if "data-c" in t else None
                     for t in re.findall(r"<td[^>]*>", row)].index(td["data-c"])] \
        == "post_attention_layernorm"
    # layers before it passed, cells after it are over tolerance
    assert all(p.cell(x)["status"] == "pass" for x in p.tds("z") + p.tds("b0"))
    assert p.tds("b7")


def test_detail_names_the_captures_input_links(planted):
    a, text = planted
    p = Page(text)
    src = {str(r.key): r.src for r in a.diff.records if r.src}
    shown = [c for c in map(p.cell, [td for t, td in p.tags if "data-c" in td])
             if c["key"] in src]
    assert shown
    for c in shown:  # what the capture stored, the producer's key without "r0.s0:"
        assert c["links"] == "; ".join(f"in.{slot} <- {site.split(':', 1)[1]}"
                                       for slot, site in src[c["key"]]), c


def test_clean_pair_marks_nothing(clean):
    a, text = clean
    p = Page(text)
    assert a.within and p.cells
    for m in ("m-culprit", "m-first", "m-sus", "m-over"):
        assert not p.tds(m), m
    assert all(c[1] == "pass" for c in p.cells)
    assert not any(p.tds(f"b{i}") for i in range(5, 10))


def test_not_compared_cells_carry_their_class(tmp_path):
    t = base(np.random.default_rng(1), steps=(0, 1))
    c = dict(t)
    gone = "r0.s1:model.layers.1.mlp#0:out.0"
    del c[gone]
    a = analyze(write(tmp_path / "a.h5", t), write(tmp_path / "b.h5", c))
    p = Page(to_html(a))
    (td,) = p.tds("nc")
    x = p.cell(td)
    assert x["status"] == "one side only" and x["key"] == f"{gone} (only in ref)"
    # the same cell at step 0 was compared and passed
    ok = [p.cell(t) for t in p.tds("z")]
    assert any(x["key"] == gone.replace(".s1:", ".s0:") for x in ok)
    assert all(not x["marks"] for x in ok)


def test_a_statistics_only_record_says_its_error_is_a_lower_bound(tmp_path):
    t = base(np.random.default_rng(3))
    c = dict(t)
    k = "r0.s0:model.layers.1.mlp#0:out.0"
    c[k] = t[k] * 1.01
    a = analyze(write(tmp_path / "a.h5", t, store="stats"),
                write(tmp_path / "b.h5", c, store="stats"))
    p = Page(to_html(a))
    tds = p.tds("z") + [td for i in range(10) for td in p.tds(f"b{i}")]
    cells = {x["key"]: x for x in map(p.cell, tds)}
    assert cells[k]["basis"] == "statistics only: rel_l2 is a lower bound"
    assert cells[k]["rel_l2"] >= 0.0099 and cells[k]["status"] != "pass"


def test_detail_holds_both_sides_statistics_and_the_rank(tmp_path):
    from accucheck.store import open_capture

    t = base(np.random.default_rng(4))
    k = "r0.s0:model.layers.1.mlp#0:out.0.rank1"  # tensor-parallel rank 1's copy
    t[k] = t["r0.s0:model.layers.1.mlp#0:out.0"]
    c = dict(t)
    c[k] = t[k] * 1.01
    ref, cand = write(tmp_path / "a.h5", t), write(tmp_path / "b.h5", c)
    p = Page(to_html(analyze(ref, cand)))
    cells = {x["key"]: x for x in map(p.cell, [td for t, td in p.tags if "data-c" in td])}
    x = cells[k]  # the worse record of layer 1's mlp cell
    with open_capture(ref) as R, open_capture(cand) as C:
        for side, cap in (("ref", R), ("cand", C)):
            st = cap.row(k).stats
            want = [float(f"{v:.3g}") for v in (st.min, st.max, st.mean, st.std, st.absmax,
                                                st.l2)]
            assert x[side] == want, (side, x[side], want)
    assert x["ref"] != x["cand"]
    assert x["rank"].startswith("tensor-parallel rank 1:")
    same = cells["r0.s0:model.layers.0.mlp#0:out.0"]  # identical sides: cand given as 0
    assert same["cand"] == 0 and len(same["ref"]) == 6 and same["rank"] is None


def test_request_switch_colours_and_marks_one_request(tmp_path):
    rng = np.random.default_rng(6)
    one = base(rng, steps=(0, 1), layers=4)
    t = {**one, **{k.replace("r0.", "r1.", 1): v * 0.5 for k, v in one.items()}}
    c = dict(t)
    for k in ("r1.s0:model.layers.2.mlp#0:out.0", "r1.s0:model.layers.2#0:out.0"):
        c[k] = t[k] * (1 + 1e-2 * rng.standard_normal(t[k].shape))  # request 1 only
    a = analyze(write(tmp_path / "a.h5", t, prompts=((1, 2, 3),) * 2, gen=((4, 5),) * 2),
                write(tmp_path / "b.h5", c, prompts=((1, 2, 3),) * 2, gen=((4, 5),) * 2))
    assert a.culprit.module == "model.layers.2.mlp" and a.culprit.req == 1
    text = to_html(a)
    p = Page(text)
    bar = dict(next(x for t, x in p.tags if x.get("id") == "reqs"))
    assert bar["data-reqs"] == "0 1"
    assert [x["data-req"] for t, x in p.tags if t == "button" and "data-req" in x] == \
        ["all", "0", "1"]
    (td,) = p.tds("m-culprit")
    x = p.cell(td)
    assert td["data-q"].split() == ["culprit.1", "first.1"]  # request 1's record is marked
    assert x["req_colour"][0] in "z01234" and x["req_colour"][1] in "56789"
    assert x["per_request"][0] < x["tolerance"] < x["per_request"][1]
    for td in p.tds("z") + p.tds("b0"):  # passed over all requests: passed in each
        assert set(p.cell(td)["req_colour"]) <= set("z01234")
    # the curves: every request (the worst) and each one, the switch picks
    svg = text.split('<svg id="curves"', 1)[1].split("</svg>", 1)[0]
    groups = dict(re.findall(r'<g data-req="(\w+)"[^>]*>(.*?)</g>', svg))
    assert set(groups) == {"all", "0", "1"}
    assert groups["0"] != groups["1"] and groups["all"] == groups["1"]
    assert '<g data-req="0" class="alt">' in svg  # hidden until picked


def test_with_a_control_the_colour_is_the_excess_over_its_threshold(tmp_path):
    rng = np.random.default_rng(5)
    t = base(rng, steps=(0, 1), layers=6)

    def noisy(fault: str | None = None) -> dict:
        return {k: v * (1 + (1e-3 if fault and fault in k else 1e-6)
                        * rng.standard_normal(v.shape)) for k, v in t.items()}
    a = analyze(write(tmp_path / "ref.h5", t), write(tmp_path / "cand.h5",
                                                       noisy("layers.3.mlp#")),
                controls=[write(tmp_path / "ctl.h5", noisy())],
                tolerances=ToleranceTable.from_options(rel_l2=1e-2))
    assert a.location.noise is not None and a.culprit.module == "model.layers.3.mlp"
    text = to_html(a)
    p = Page(text)
    assert "colour: excess over the control threshold" in text
    (td,) = p.tds("m-culprit")
    c = p.cell(td)
    assert c["key"] == "r0.s0:model.layers.3.mlp#0:out.0" and c["excess"] > c["threshold"], c
    ratio = c["excess"] / c["threshold"]
    assert f"b{sum(math.log10(ratio) > b for b in BUCKETS)}" in td["class"]
    # within the (loose) tolerance, more than the control's noise: coloured by the control
    assert c["rel_l2"] < c["tolerance"]
    ok = [p.cell(x) for x in p.tds("b0") + p.tds("b1") + p.tds("b2") + p.tds("b3")]
    assert ok and all(x["excess"] is None or x["excess"] < x["threshold"] for x in ok)
    # the candidate's layer curve against the control's band (6 layers: 12 band corners)
    svgs = {a["id"] for t, a in p.tags if t == "svg" and "id" in a}
    assert svgs == {"curves", "control-curves"}
    bands = control_bands(text)
    assert set(bands) == {"all", "0", "1"}  # one band per step, and all steps' envelope
    assert all(len(b.split()) == 12 for b in bands.values())
    assert bands["0"] != bands["1"]  # each step its own controls' band


def control_bands(text: str) -> dict[str, str]:
    """step -> the points of the control band the step switch shows for it (every request)."""
    svg = text.split('<svg id="control-curves"', 1)[1].split("</svg>", 1)[0]
    out = {}
    for attrs, body in re.findall(r"<g([^>]*)>(.*?)</g>", svg):
        a = dict(re.findall(r'data-(\w+)="([^"]*)"', attrs))
        if a.get("req", "all") == "all":
            (pts,) = re.findall(r'<polygon class="band" points="([^"]*)"', body)
            out[a.get("step", "all")] = pts
    return out


def test_moe_routing_is_shown_and_the_router_marked(moe):
    _, cap, _ = moe
    a = analyze(cap("ref"), cap("shift", fault=(GATE.format(1), "router:3:0.3")))
    assert a.culprit.module == GATE.format(1) and a.diff.routing is not None
    text = to_html(a)
    p = Page(text)
    assert p.verdict == verdict_line(a)
    (td,) = p.tds("m-culprit")
    assert p.cell(td)["key"].startswith(f"r0.s0:{GATE.format(1)}#")  # the router's cell
    routing = text.split('<pre id="routing">', 1)[1].split("</pre>", 1)[0]
    assert html.unescape(routing) == "\n".join(routing_lines(a.diff.routing, "simple"))
    assert "mlp.gate" in routing
    # the agreement per layer as a chart: 100 % before the shifted router, less at its layer
    svg = text.split('<svg id="routing-curves"', 1)[1].split("</svg>", 1)[0]
    lines = re.findall(r'<g(?: data-req="all")?>(.*?)</g>', svg)[0]
    per_layer = {}
    for pts in re.findall(r'class="curve"[^>]*points="([^"]*)"', lines):
        for x, y in (xy.split(",") for xy in pts.split()):
            per_layer.setdefault(float(x), []).append(float(y))
    xs = sorted(per_layer)  # layers 0, 1, ... left to right; y grows downwards
    calls = [c for c in a.diff.routing.calls if c.router == GATE.format(1)]
    assert any(c.flipped for c in calls) and not any(
        c.flipped for c in a.diff.routing.calls if c.router == GATE.format(0))
    assert max(per_layer[xs[0]]) == min(y for ys in per_layer.values() for y in ys)  # 100 %
    assert max(per_layer[xs[1]]) > max(per_layer[xs[0]])


def test_nothing_is_loaded_from_outside(planted):
    text = planted[1]
    p = Page(text)
    assert not [t for t, _ in p.tags if t in ("link", "iframe", "img", "object", "embed")]
    for t, a in p.tags:
        for attr in ("src", "href", "action", "data", "srcset"):
            assert attr not in a or not re.match(r"(?i)\s*(https?:)?//", a[attr]), (t, a)
    assert not re.search(r"(?i)url\(|@import|https?://", text.split("<h2>Text report", 1)[0])
    assert 'id="curves"' in text and 'id="control-curves"' not in text  # no control run
    assert "routing-curves" not in text and "MoE routing" not in text  # no router: no chart
    scripts = [a for t, a in p.tags if t == "script"]
    assert len(scripts) == 2 and not any("src" in a for a in scripts)


def test_deep_model_renders_bounded(tmp_path):
    ref, cand = htmlcases.deep_pair(tmp_path, layers=80, steps=1, reqs=1)
    one = analyze(ref, cand)
    a = htmlcases.widen(one, steps=8, reqs=4)
    assert len(a.diff.records) == 32 * len(one.diff.records) > 80 * 15 * 8 * 4
    text = to_html(a)
    p = Page(text)
    assert p.verdict == verdict_line(a)
    assert len([x for t, x in p.tags if t == "section"]) == 8
    assert len([x for t, x in p.tags if t == "td" and "data-c" in x]) == 8 * (80 * 15 + 3)
    assert len(p.cells) == 8 * (80 * 15 + 3)  # one entry per cell, not per record
    (td,) = p.tds("m-culprit")
    assert p.cell(td)["key"].startswith(f"r0.s0:model.layers.40.{htmlcases.FAULT}#0")
    assert len(text.encode()) < MAX_DEEP_PAGE, len(text.encode())


def test_cli_writes_the_page_with_the_diffs_exit_code(tmp_path, capsys):
    t = base(np.random.default_rng(2))
    c = dict(t)
    k = "r0.s0:model.layers.1.mlp#0:out.0"
    c[k] = t[k] * 1.01
    ref, cand = write(tmp_path / "a.h5", t), write(tmp_path / "b.h5", c)
    out = tmp_path / "diff.html"

    def run(*args):
        with pytest.raises(SystemExit) as e:
            main(["diff", str(ref), *map(str, args)])
        return e.value.code, capsys.readouterr()

    code, (o, err) = run(cand, "--format", "html")
    assert code == 2 and "give -o FILE.html" in err and not o
    code, (o, err) = run(cand, "--format", "html", "-o", out)
    assert code == 1 and not o and f"wrote {out}" in err
    assert Page(out.read_text()).verdict == verdict_line(analyze(ref, cand))
    code, (_, err) = run(ref, "--format", "html", "-o", out)
    assert code != 0 and "exists" in err and "PASS" not in out.read_text()
    code, _ = run(ref, "--format", "html", "-o", out, "--force")
    assert code == 0 and Page(out.read_text()).verdict.startswith("PASS")
    assert to_html(analyze(ref, ref)) == out.read_text()


# ----------------------------------------------------------------------------- browser

HOVER = """(function(){
 var td=document.querySelector('td.m-culprit')||document.querySelector('td[data-c]');
 td.dispatchEvent(new MouseEvent('mouseover',{bubbles:true}));
 var shown=document.getElementById('detail').textContent;
 var b=document.querySelector('#steps button[data-step="1"]'); if(b) b.click();
 var vis=Array.from(document.querySelectorAll('section.panel')).filter(
   function(s){return s.offsetParent!==null;}).map(function(s){return s.dataset.step;});
 var b0=document.querySelector('#steps button[data-step="0"]'); if(b0) b0.click();
 var req={};  // the request switch: the culprit's mark in its own request only, the curves
 ['1','0','all'].forEach(function(q){
   var rb=document.querySelector('#reqs button[data-req="'+q+'"]'); if(!rb) return; rb.click();
   var g=document.querySelector('#curves g[data-req="'+q+'"]');
   req[q]={cls:td.className, text:td.textContent,
           curve:g?getComputedStyle(g).display:null};});
 return JSON.stringify({shown:shown, visible:vis, req:req,
   height:document.documentElement.scrollHeight});})()"""


@pytest.mark.browser
def test_page_opens_in_headless_chromium(planted, clean, tmp_path):
    from browser import DevTools, chromium, open_page, png_size

    binary = chromium()
    if binary is None:
        pytest.skip("chromium not installed (Debian: apt-get install -y chromium)")
    dt = DevTools(binary, tmp_path / "profile", tmp_path / "chromium.log")
    shots = {}
    try:
        for name, (a, text) in (("planted", planted), ("clean", clean)):
            page = tmp_path / f"{name}.html"
            page.write_text(text, encoding="utf-8")
            session, problems, info = open_page(dt, page.as_uri())
            assert problems == [], problems
            assert info["verdict"] == verdict_line(a)
            r = dt.send("Runtime.evaluate", {"expression": HOVER, "returnByValue": True},
                        session=session)
            assert "exceptionDetails" not in r, r
            got = json.loads(r["result"]["value"])
            if name == "planted":
                assert f"{diffcases.NORM_FAULT}#0:out.0" in got["shown"], got
                assert "culprit" in got["shown"] and "introduced" in got["shown"]
                assert "per_request" in got["shown"] and "NaN" not in got["shown"]
                assert "absmax" in got["shown"] and "refcand" in got["shown"]  # both sides
                r = got["req"]  # the culprit is request 0's record
                assert "m-culprit" in r["0"]["cls"] and "m-culprit" not in r["1"]["cls"], r
                assert r["1"]["text"] == "" and r["all"]["text"] == "\u2716", r
                assert r["1"]["curve"] == "inline" and r["0"]["curve"] == "inline", r
            assert got["visible"] == ["1"], got  # the step switch shows one panel
            height = min(int(got["height"]), 6000)
            dt.send("Emulation.setDeviceMetricsOverride", {"width": 1280, "height": height,
                    "deviceScaleFactor": 1, "mobile": False}, session=session)
            shot = dt.send("Page.captureScreenshot", {"format": "png", "clip": {
                "x": 0, "y": 0, "width": 1280, "height": height, "scale": 1}},
                session=session)
            shots[name] = base64.b64decode(shot["data"])
            _, problems, _ = open_page(dt, "about:blank")
    finally:
        dt.close()
    for name, data in shots.items():
        w, h = png_size(data)
        assert w == 1280 and h > 800, (name, w, h)
        out = tmp_path / f"accucheck-diff-{name}.png"
        out.write_bytes(data)
        try:
            shutil.copyfile(out, Path(f"/tmp/accucheck-diff-{name}.png"))
        except OSError:
            pass
        assert len(data) > 30_000, (name, len(data))
