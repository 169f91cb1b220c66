"""Render a SignoffResult: report.json, report.md, self-contained report.html, plots. Formats only.

Imports report.signoff_result (the records), report.diff (the diff's JSON), report.plots (the
plots: matplotlib, an optional extra; without it the reports say so and carry no plots),
verdict.noise and verdict.culprit, tabulate.

`write_report(result, out_dir)` writes:
    report.json   machine-readable verdict, schema "accucheck.signoff" (docs/signoff-json.md)
    report.md     the same content for people (plots linked from plots/)
    report.html   one file, no external resources, no JavaScript: plots are PNGs embedded as
                  base64 data URIs
    diff.json     the full diff (schema "accucheck.diff", docs/diff-json.md)
    plots/*.png   layers.png (error by layer per step), logits_kl.png (KL by position),
                  tokens.png (token agreement curve), worst.png (worst records)
"""
from __future__ import annotations

import base64
import html
import json
import math
from pathlib import Path
from typing import Any

from accucheck.compare.observer import observer_effect
from accucheck.keys import layer_of
from accucheck.report.diff import BASIS_MARK
from accucheck.report.diff import to_json as diff_to_json
from accucheck.report.html_diff import to_html as diff_to_html
from accucheck.report.plots import PLOTS, make_plots
from accucheck.report.signoff_result import SignoffResult, worst_records
from accucheck.verdict.noise import layer_ratios
from accucheck.numbers import cosine, number, percent

SCHEMA = "accucheck.signoff"
SCHEMA_VERSION = 1
MAX_STEP_COLS = 6


def write_report(result: SignoffResult, out_dir: str | Path) -> dict[str, str]:
    """Write every report file into `out_dir` (which must exist). Returns name -> path."""
    out = Path(out_dir)
    diff_doc = diff_to_json(result.analysis)
    (out / "diff.json").write_text(json.dumps(diff_doc, indent=1) + "\n", encoding="utf-8")
    imp = result.impact
    (out / "diff.html").write_text(diff_to_html(result.analysis, imp and imp["line"]),
                                   encoding="utf-8")
    if imp is not None:
        (out / "impact.json").write_text(json.dumps(imp["result"], indent=2) + "\n",
                                         encoding="utf-8")
    pngs, plot_note = make_plots(result)
    files = {"json": "report.json", "markdown": "report.md", "html": "report.html",
             "diff": "diff.json", "diff_html": "diff.html",
             **({"impact": "impact.json"} if result.impact is not None else {})}
    if pngs:
        (out / "plots").mkdir(exist_ok=True)
        for name, data in pngs.items():
            (out / "plots" / f"{name}.png").write_bytes(data)
    doc = to_json(result, diff_doc, plots=sorted(pngs), out_dir=out)
    (out / "report.json").write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    (out / "report.md").write_text(to_markdown(result, doc, pngs, plot_note), encoding="utf-8")
    (out / "report.html").write_text(to_html(result, doc, pngs, plot_note), encoding="utf-8")
    return {k: str(out / v) for k, v in files.items()}


# ----------------------------------------------------------------------------- json

def _num(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {k: _num(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_num(v) for v in x]
    return x


def _rel(p: str | None, base: Path | None) -> str | None:
    if p is None:
        return None
    if base is not None:
        try:
            return str(Path(p).resolve().relative_to(base.resolve()))
        except ValueError:
            pass
    return str(p)


def to_json(result: SignoffResult, diff_doc: dict | None = None, *, plots=(),
            out_dir: Path | None = None) -> dict:
    """The report.json document (schema accucheck.signoff, version 1; docs/signoff-json.md)."""
    r, s = result, result.scenario
    diff_doc = diff_doc if diff_doc is not None else diff_to_json(r.analysis)
    fd = diff_doc.get("first_divergence")
    first = None
    if fd is not None:
        rec = r.analysis.diff.record(fd["key"])
        first = {k: fd.get(k) for k in ("key", "req", "step", "module", "op", "role", "slot",
                                        "cause", "rel_l2", "input_rel_l2", "input_from",
                                        "amplification", "tolerance", "basis", "path")}
        first["golden"] = rec.golden.label if rec.golden is not None else None

    def run(role: str, path: str | None, meta: dict | None):
        spec = s.run(role)
        if spec is None and path is None:
            return None
        return {"label": spec.label if spec else "capture", "capture": _rel(path, out_dir),
                "device": (meta or {}).get("device"), "dtype": (meta or {}).get("dtype"),
                "mode": (meta or {}).get("mode"), "runner": (meta or {}).get("runner"),
                "planted_fault": (meta or {}).get("planted_fault"),
                "observer_effect": observer_effect(meta or {})}

    thr = dict(s.thresholds.__dict__)
    thr["tolerances"] = {p: v for p, v in s.thresholds.tolerances}
    reg = None
    if r.regression is not None:
        reg = {"previous": r.regression.previous, "verdict": r.regression.verdict,
               "sentence": r.regression.sentence, "note": r.regression.note,
               "items": [dict(i.__dict__) for i in r.regression.items]}
    flips = diff_doc.get("logits", {}).get("flips", [])
    doc = {
        "schema": SCHEMA, "schema_version": SCHEMA_VERSION,
        "verdict": r.verdict, "exit_code": r.exit_code, "summary": r.summary,
        "scenario": {"name": s.name, "description": s.description,
                     "path": str(s.path) if s.path else None, "model": s.model,
                     "prompts": len(s.prompts), "max_new_tokens": s.max_new_tokens},
        "runs": {"reference": run("reference", r.ref_path, r.ref_meta),
                 "candidate": run("candidate", r.cand_path, r.cand_meta),
                 "golden": run("golden", r.golden_path, None) if r.golden_path else None,
                 "control": dict(run("control", r.control_paths[0], None),
                                 captures=[_rel(p, out_dir) for p in r.control_paths])
                 if r.control_paths else None},
        "thresholds": thr,
        "checks": [dict(c.__dict__) for c in r.checks],
        "failed_checks": [c.name for c in r.failed_checks],
        "metrics": r.metrics.as_dict(),
        "culprit": r.culprit,
        "impact": ({k: v for k, v in r.impact.items() if k != "result"}
                   if r.impact is not None else None),
        "first_divergence": first,
        "layers": diff_doc.get("layers", []),
        "control": ({"flagged": diff_doc["control"]["flagged"],
                     "layers": diff_doc["control"]["layers"]}
                    if diff_doc.get("control") else None),
        "suspicious": diff_doc.get("suspicious", []),
        "routing": ({k: diff_doc["routing"][k] for k in
                     ("agreement", "tokens", "flipped", "forced", "first_flip", "real_flip",
                      "per_router")} if diff_doc.get("routing") else None),
        "tokens": {"agreement": r.metrics.token_agreement,
                   "compared": r.metrics.tokens_compared,
                   "near_tie_flips": r.metrics.near_tie_flips,
                   "real_flips": r.metrics.real_flips, "flips": flips},
        "regression": reg,
        "matrix": ({k: r.matrix[k] for k in ("runner", "knobs", "expect_invariant",
                                              "violations", "summaries", "dir")}
                   if r.matrix else None),
        "environment": [{"field": e.field, "ref": e.ref, "cand": e.cand, "differs": e.differs}
                        for e in r.environment],
        "planted_faults": r.planted_faults,
        "notes": list(r.analysis.diff.notes),
        "files": {"markdown": "report.md", "html": "report.html", "diff": "diff.json",
                  "diff_html": "diff.html", "plots": [f"plots/{p}.png" for p in plots],
                  **({"impact": "impact.json"} if r.impact is not None else {})},
        "seconds": round(r.seconds, 3),
    }
    return _num(doc)


# ----------------------------------------------------------------------------- shared rows

def check_rows(r: SignoffResult) -> tuple[list[str], list[list[str]]]:
    rows = []
    for c in r.checks:
        lim = "-" if c.limit is None else f"{c.op} {number(c.limit)}"
        val = cosine(c.value) if c.name == "layer_cosine" else number(c.value)
        rows.append(["PASS" if c.passed else "FAIL", c.name, val, lim, c.detail])
    return ["", "check", "value", "limit", "detail"], rows


def layer_rows(r: SignoffResult) -> tuple[list[str], list[list[str]], list[bool]]:
    """Per-layer table: rel_l2 / cosine of each decoder layer's output per step (max over
    requests); steps thinned to the first ones and the last. Third value: row within tolerance."""
    curve = r.analysis.location.curve
    if not curve:
        return [], [], []
    steps = sorted({p.step for p in curve})
    if len(steps) > MAX_STEP_COLS:
        steps = steps[:MAX_STEP_COLS - 1] + [steps[-1]]
    cell: dict[tuple[int, int], Any] = {}
    worst: dict[int, Any] = {}
    for p in curve:
        c = cell.get((p.layer, p.step))
        if c is None or p.rel_l2 > c.rel_l2:
            cell[(p.layer, p.step)] = p
        w = worst.get(p.layer)
        if w is None or p.rel_l2 > w.rel_l2:
            worst[p.layer] = p
    golden = {}
    for p in curve:
        rec = r.analysis.diff.record(p.key)
        if rec.golden is not None and p.key == worst[p.layer].key:
            golden[p.layer] = rec.golden.label
    head = ["layer"] + [f"step {s}" for s in steps] + ["max rel_l2", "status"]
    if golden:
        head.append("golden")
    rows, oks = [], []
    for ly in sorted(worst):
        row = [str(ly)]
        for s in steps:
            c = cell.get((ly, s))
            row.append("-" if c is None else f"{number(c.rel_l2)} / {cosine(c.cosine)}"
                       + ("" if c.within else " *"))
        ok = all(p.within for p in curve if p.layer == ly)
        row += [number(worst[ly].rel_l2), "ok" if ok else "over tolerance"]
        if golden:
            row.append(golden.get(ly, "-"))
        rows.append(row)
        oks.append(ok)
    return head, rows, oks


def control_rows(r: SignoffResult) -> tuple[list[str], list[list[str]], list[bool]]:
    """Candidate / control per decoder layer (accucheck.verdict.noise.layer_ratios): the
    ratio at the layer's output and the largest site excess inside it; third value: no site
    of that layer is more than noise."""
    noise = r.analysis.location.noise
    if noise is None:
        return [], [], []
    rows, oks = [], []
    for ly, ratio, excess, site in layer_ratios(noise):
        ok = not any(layer_of(s.key.module) == ly for s in noise.flagged)
        rows.append([str(ly), f"x{number(ratio)}", f"x{number(excess)}", site,
                     "ok" if ok else "MORE THAN NOISE"])
        oks.append(ok)
    return ["layer", "cand / control at output", "largest excess inside", "at", "status"], \
        rows, oks


def matrix_rows(r: SignoffResult) -> tuple[list[str], list[list[str]], list[bool]]:
    """The scenario's configuration matrix, a row per run (accucheck.matrix: matrix.json)."""
    if not r.matrix:
        return [], [], []
    rows, oks = [], []
    invariant = set(r.matrix["expect_invariant"])
    for row, line in zip(r.matrix["rows"], r.matrix["summaries"]):
        worst = max((d["max_dlogprob"] for d in row["requests"]), default=0.0)
        where = (row["localisation"] or {}).get("where") or ""
        culprit = (row["localisation"] or {}).get("culprit") or ""
        gated = len(row["flips"]) == 1 and next(iter(row["flips"])) in invariant
        rows.append([row["label"], row["error"] or (", ".join(map(str, row["moved"]))
                                                    or "none (bitwise equal)"),
                     number(worst), where, culprit])
        oks.append(not (gated and (row["error"] or row["moved"])))
    return ["run", "requests moved", "max |dlogprob|", "first difference", "culprit"], rows, oks


def routing_rows(r: SignoffResult) -> tuple[list[str], list[list[str]], list[bool]]:
    """MoE: per router, tokens, flips, weights differing, agreement and the first flip
    (accucheck.compare.routing); third value: no flip there. Empty for a dense model."""
    routing = r.analysis.diff.routing
    if routing is None:
        return [], [], []
    rows, oks = [], []
    for d in routing.per_router():
        f = d["first_flip"]
        rows.append([d["router"], str(d["tokens"]), str(d["flipped"]),
                     str(d["weights_differ"]), percent(d["agreement"]),
                     "-" if f is None else f"r{f['req']}.s{f['step']} token {f['token']}: "
                     f"{f['ref_experts']} -> {f['cand_experts']} ({f['label']})"])
        oks.append(f is None)
    return ["router", "tokens", "flipped", "weights differ", "agreement", "first flip"], rows, \
        oks


def token_rows(r: SignoffResult) -> tuple[list[str], list[list[str]]]:
    by_step: dict[int, list] = {}
    for s in r.analysis.diff.logits:
        by_step.setdefault(s.key.step, []).append(s)
    rows = []
    for st in sorted(by_step):
        ss = by_step[st]
        pos = [p for s in ss for p in s.positions]
        gen = [s.positions[-1] for s in ss if s.positions]
        rows.append([str(st), str(len(pos)), number(max((p.kl for p in pos), default=0.0)),
                     f"{sum(p.agree for p in pos)}/{len(pos)}",
                     f"{sum(p.agree for p in gen)}/{len(gen)}",
                     number(min((p.top5_overlap for p in pos), default=1.0))])
    return ["step", "positions", "max KL", "top-1 agree (all positions)",
            "generated token agrees", "min top-5 overlap"], rows


def flip_rows(r: SignoffResult) -> tuple[list[str], list[list[str]]]:
    rows = []
    for f in r.analysis.diff.flips:
        rows.append([str(f.req), str(f.step), str(f.position), str(f.ref_token),
                     str(f.cand_token), number(f.margin), number(f.noise), f.label])
    return ["request", "step", "position", "ref token", "cand token", "ref margin",
            "logit noise", "label"], rows


def worst_rows(r: SignoffResult) -> tuple[list[str], list[list[str]], list[bool]]:
    a = r.analysis
    locs = {str(x.key): x for x in a.location.records}
    recs = worst_records(r)
    has_golden = a.diff.golden_path is not None
    head = ["record", "status", "rel_l2", "input rel_l2", "cosine", "tolerance"] + (
        ["golden"] if has_golden else [])
    rows, oks = [], []
    for x in recs:
        loc = locs[str(x.key)]
        row = [str(x.key), "ok" if x.within else (loc.cause or "over"),
               number(x.error) + BASIS_MARK.get(x.basis, ""), number(loc.input_error),
               cosine(x.cosine), number(x.tolerance.rel_l2)]
        if has_golden:
            row.append(x.golden.label if x.golden else "-")
        rows.append(row)
        oks.append(x.within)
    return head, rows, oks


def regression_rows(r: SignoffResult) -> tuple[list[str], list[list[str]]]:
    if r.regression is None:
        return [], []
    return ["metric", "last release", "this run", "change"], [
        [i.metric, number(i.previous), number(i.current), i.change]
        for i in r.regression.items]


def divergence_lines(r: SignoffResult) -> list[str]:
    """The culprit block: the same Culprit (verdict.culprit) that `accucheck diff` prints."""
    from accucheck.verdict.culprit import culprit_lines

    a = r.analysis
    L = a.location
    fd = L.first_divergence
    if fd is None and L.diffuse:
        fo, wo = L.first_over, L.worst
        head = (f"No culprit: {len(a.diff.failed)} records over tolerance, but each is "
                f"explained by what feeds it (diffuse / inherited error, "
                f"x{number(L.amplification)} rule).") if L.noise_like is None else \
            (f"No culprit: {len(a.diff.failed)} records over tolerance; "
             f"{L.no_culprit_reason}: rounding noise of the dtype, or a defect every "
             f"{L.noise_like.kind} shares; a [control] run tells which.")
        return [head,
                f"First over tolerance: {fo.module} (step {fo.step}, request {fo.key.req}), "
                f"rel_l2 {number(fo.error)}; largest: {wo.module} (step {wo.step}, request "
                f"{wo.key.req}), rel_l2 {number(wo.error)} "
                f"(tolerance {number(wo.tolerance)})."]
    if fd is None:
        lines = ["No record is over tolerance: no divergence to locate."]
        for x in L.suspicious[:3]:
            lines.append(f"Suspicious (noise floor): {x.key}: rel_l2 {number(x.error)}, "
                         f"amplifies "
                         f"its input error x{number(x.gain)}, its {x.peers} peers "
                         f"x{number(x.peers_median)}")
        return lines
    rec = a.diff.record(fd.key)
    lines = [x.strip() for x in culprit_lines(a.culprit)]
    if r.impact is not None:
        lines.append(r.impact["line"])
    lines.append(f"Cause: introduced here: its output error is more than "
                 f"{number(L.amplification)}x what feeds it")
    if fd.path:
        lines.append("Inside: " + " > ".join(fd.path))
    if fd.input_from:
        lines.append(f"Input error ({fd.input_basis}) from: " + ", ".join(fd.input_from[:4]))
    if rec.golden is not None:
        lines.append(f"Golden referee: {rec.golden.label} "
                     f"(ref RMSE {number(rec.golden.ref_rmse)}, "
                     f"cand RMSE {number(rec.golden.cand_rmse)})")
    elif a.diff.golden_path is None:
        lines.append("Golden referee: none (add a [golden] run, e.g. dtype = \"float64\" on "
                     "the CPU, to tell whose error it is)")
    return lines


# ----------------------------------------------------------------------------- markdown

def _md_table(head: list[str], rows: list[list[str]]) -> str:
    from tabulate import tabulate

    return tabulate(rows, head, tablefmt="github", disable_numparse=True)


def to_markdown(r: SignoffResult, doc: dict, pngs: dict, plot_note: str) -> str:
    s = r.scenario
    out = [f"# accucheck sign-off: {s.name}", "", f"**{r.summary}**", ""]
    for f in r.planted_faults:
        out += [f"> WARNING: planted fault ({f}): a testing / demo run, not a real sign-off.", ""]
    if s.description:
        out += [s.description, ""]
    out += [f"reference: {r.ref_path}  ", f"candidate: {r.cand_path}{_forced(r)}  "]
    if r.golden_path:
        out.append(f"golden: {r.golden_path}  ")
    if r.control_paths:
        out.append(f"control: {', '.join(r.control_paths)}  ")
    out += ["", "## Checks", "", _md_table(*check_rows(r)), ""]
    env = [[("**" + e.field + "**") if e.differs else e.field,
            e.ref, e.cand, "differs" if e.differs else ""] for e in r.environment]
    out += ["## Environment", "", _md_table(["", "reference", "candidate", ""], env), ""]
    out += ["## First divergence", ""] + [f"- {x}" for x in divergence_lines(r)] + [""]
    if pngs:
        out += ["## Plots", ""] + [f"![{t}](plots/{n}.png)" for n, t in PLOTS if n in pngs] \
            + [""]
    elif plot_note:
        out += ["## Plots", "", plot_note, ""]
    head, rows, _ = layer_rows(r)
    if rows:
        out += ["## Per-layer error (decoder-layer outputs: rel_l2 / cosine, max over requests;"
                " * over tolerance)", "", _md_table(head, rows), ""]
    head, rows, _ = control_rows(r)
    if rows:
        out += ["## Candidate / control per layer (elementwise relative error ratio; "
                "excess: over what feeds it, more than noise above its kind's threshold)", "",
                _md_table(head, rows), ""]
    head, rows, _ = matrix_rows(r)
    if rows:
        out += ["## Configuration matrix (each knob flipped alone from the reference's settings, "
                "teacher-forced; expected invariant: "
                f"{', '.join(r.matrix['expect_invariant']) or 'none'}; {r.matrix['dir']})", "",
                _md_table(head, rows), ""]
    head, rows, _ = routing_rows(r)
    if rows:
        out += ["## MoE routing (tokens routed to other experts; records after a flip are not "
                "judged)", "", f"agreement {percent(r.metrics.routing_agreement)}"
                + (" (routing forced from the reference)" if r.analysis.diff.routing.forced
                   else ""), "", _md_table(head, rows), ""]
    m = r.metrics
    out += ["## Tokens and logits", "",
            f"token agreement: {percent(m.token_agreement)} of {m.tokens_compared} generated "
            f"tokens; top-1 agreement: {percent(m.top1_agreement)} of {m.logits_positions} "
            f"positions; max KL: {number(m.max_logits_kl)}; "
            f"flips: {m.near_tie_flips} near-tie, "
            f"{m.real_flips} real", ""]
    head, rows = token_rows(r)
    if rows:
        out += [_md_table(head, rows), ""]
    head, rows = flip_rows(r)
    if rows:
        out += ["Generated-token flips:", "", _md_table(head, rows), ""]
    out += ["## Regression against the last release", ""]
    if r.regression is None:
        out += ["No previous release given (set previous = \"...report.json\" in the scenario "
                "or pass --previous).", ""]
    else:
        out += [f"**{r.regression.sentence}** (previous: {r.regression.previous})", ""]
        if r.regression.note:
            out += [f"NOTE: {r.regression.note}", ""]
        out += [_md_table(*regression_rows(r)), ""]
    head, rows, _ = worst_rows(r)
    out += ["## Worst records", "", _md_table(head, rows), ""]
    if r.analysis.diff.notes:
        out += ["## Notes", ""] + [f"- {n}" for n in r.analysis.diff.notes] + [""]
    out += ["---", f"report.json (schema {SCHEMA} v{SCHEMA_VERSION}), diff.json (full diff); "
            f"{r.seconds:.1f} s", ""]
    return "\n".join(out)


def _forced(r: SignoffResult) -> str:
    tf = (r.cand_meta.get("options") or {}).get("tokens_from")
    return " (teacher-forced on the reference's tokens)" if tf else ""


# ----------------------------------------------------------------------------- html

_CSS = """
body{font-family:-apple-system,"Segoe UI",Helvetica,Arial,sans-serif;margin:24px auto;
max-width:1200px;color:#1b1f23;padding:0 16px}
h1{font-size:22px;margin-bottom:8px}h2{font-size:17px;margin-top:28px;border-bottom:1px solid
#d0d7de;padding-bottom:4px}
.verdict{padding:12px 16px;border-radius:6px;font-size:16px;font-weight:600}
.pass{background:#dafbe1;border:1px solid #4ac26b}.fail{background:#ffebe9;border:1px solid
#ff8182}.warn{background:#fff8c5;border:1px solid #d4a72c;padding:8px 12px;border-radius:6px;
margin-top:8px}
table{border-collapse:collapse;font-size:13px;margin:8px 0}
th,td{border:1px solid #d0d7de;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f6f8fa}td.num{font-family:ui-monospace,Menlo,monospace}
tr.differs td{background:#fff8c5}tr.differs td:first-child{font-weight:700}
tr.bad td{background:#ffebe9}td.PASS{color:#1a7f37;font-weight:700}
td.FAIL{color:#cf222e;font-weight:700}
.plots{display:grid;grid-template-columns:repeat(auto-fit,minmax(520px,1fr));gap:12px}
figure{margin:0;border:1px solid #d0d7de;border-radius:6px;padding:6px}
figure img{width:100%;height:auto}figcaption{font-size:13px;color:#57606a}
code,.mono{font-family:ui-monospace,Menlo,monospace;font-size:12px}
ul{margin:4px 0}.small{color:#57606a;font-size:12px}
"""


def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _html_table(head: list[str], rows: list[list[str]], row_class: list[str] | None = None,
                cell_class=None) -> str:
    out = ["<table>"]
    if head:
        out.append("<tr>" + "".join(f"<th>{_e(h)}</th>" for h in head) + "</tr>")
    for i, row in enumerate(rows):
        cls = row_class[i] if row_class else ""
        out.append(f'<tr class="{cls}">' if cls else "<tr>")
        for j, c in enumerate(row):
            cc = cell_class(j, c) if cell_class else ""
            out.append(f'<td class="{cc}">{_e(c)}</td>' if cc else f"<td>{_e(c)}</td>")
        out.append("</tr>")
    out.append("</table>")
    return "".join(out)


def to_html(r: SignoffResult, doc: dict, pngs: dict, plot_note: str) -> str:
    b = _html_head(r) + _html_checks(r) + _html_plots(pngs, plot_note) + _html_layers(r)
    b += _html_tokens(r) + _html_regression(r)
    head, rows, oks = worst_rows(r)
    b += ["<h2>Worst records</h2>", _html_table(head, rows, ["" if ok else "bad" for ok in oks])]
    if r.analysis.diff.notes:
        b += ["<h2>Notes</h2>", "<ul>"] + [f"<li>{_e(n)}</li>" for n in r.analysis.diff.notes] \
            + ["</ul>"]
    b.append(f'<p class="small">report.json (schema {SCHEMA} v{SCHEMA_VERSION}), diff.json (full'
             f" diff); {r.seconds:.1f} s</p></body></html>")
    return "\n".join(b) + "\n"


def _html_head(r: SignoffResult) -> list[str]:
    """The page head, the verdict, planted-fault warnings, the description and the runs' files."""
    s = r.scenario
    b = ['<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">',
         f"<title>accucheck sign-off: {_e(s.name)} ({r.verdict.upper()})</title>",
         f"<style>{_CSS}</style></head><body>",
         f"<h1>accucheck sign-off: {_e(s.name)}</h1>",
         f'<div class="verdict {r.verdict}" id="verdict">{_e(r.summary)}</div>']
    for f in r.planted_faults:
        b.append(f'<div class="warn">WARNING: planted fault ({_e(f)}): a testing / demo run, '
                 f"not a real sign-off.</div>")
    if s.description:
        b.append(f"<p>{_e(s.description)}</p>")
    b.append('<p class="small mono">reference: ' + _e(r.ref_path) + "<br>candidate: "
             + _e(r.cand_path + _forced(r))
             + (("<br>golden: " + _e(r.golden_path)) if r.golden_path else "")
             + (("<br>control: " + _e(", ".join(r.control_paths))) if r.control_paths
                else "")
             + "</p>")
    return b


def _html_checks(r: SignoffResult) -> list[str]:
    """Checks, environment, first divergence and the link to diff.html."""
    head, rows = check_rows(r)
    b = ["<h2>Checks</h2>", _html_table(head, rows, cell_class=lambda j, c: c if j == 0 else "")]
    b += ["<h2>Environment</h2>",
          '<p class="small">Rows that differ between the two runs are highlighted.</p>',
          _html_table(["", "reference", "candidate"],
                      [[e.field, e.ref, e.cand] for e in r.environment],
                      ["differs" if e.differs else "" for e in r.environment])]
    b += ["<h2>First divergence</h2>", "<ul>"] + [f"<li>{_e(x)}</li>"
                                                  for x in divergence_lines(r)] + ["</ul>"]
    b.append('<p>The whole diff as a page, the model as a heatmap: '
             '<a href="diff.html">diff.html</a></p>')
    return b


def _html_plots(pngs: dict, plot_note: str) -> list[str]:
    """The plots, inlined as base64 PNGs in PLOTS order, or why there are none."""
    b = ["<h2>Plots</h2>"]
    if pngs:
        b.append('<div class="plots">')
        for name, title in PLOTS:
            if name in pngs:
                data = base64.b64encode(pngs[name]).decode("ascii")
                b.append(f'<figure><img id="plot-{name}" alt="{_e(title)}" '
                         f'src="data:image/png;base64,{data}"><figcaption>{_e(title)}'
                         f"</figcaption></figure>")
        b.append("</div>")
    else:
        b.append(f"<p>{_e(plot_note)}</p>")
    return b


def _html_layers(r: SignoffResult) -> list[str]:
    """The per-layer, control, configuration-matrix and MoE-routing tables, those with rows."""
    b: list[str] = []
    head, rows, oks = layer_rows(r)
    if rows:
        b += ["<h2>Per-layer error</h2>",
              '<p class="small">Decoder-layer outputs: rel_l2 / cosine per step, max over '
              "requests; * over tolerance.</p>",
              _html_table(head, rows, ["" if ok else "bad" for ok in oks])]
    head, rows, oks = control_rows(r)
    if rows:
        b += ["<h2>Candidate / control per layer</h2>",
              '<p class="small">Mean elementwise relative error of the candidate over the '
              "control's, at each decoder layer's output; excess: over what feeds it.</p>",
              _html_table(head, rows, ["" if ok else "bad" for ok in oks])]
    head, rows, oks = matrix_rows(r)
    if rows:
        b += ["<h2>Configuration matrix</h2>",
              f'<p class="small">Each knob flipped alone from the reference\'s settings, '
              f"teacher-forced; expected invariant: "
              f"{_e(', '.join(r.matrix['expect_invariant']) or 'none')}; "
              f"{_e(r.matrix['dir'])}</p>",
              _html_table(head, rows, ["" if ok else "bad" for ok in oks])]
    head, rows, oks = routing_rows(r)
    if rows:
        b += ["<h2>MoE routing</h2>",
              f'<p class="small">Token routings (token x router call) whose expert set '
              f"differs; agreement <b>{percent(r.metrics.routing_agreement)}</b>. Records after "
              f"a flip compare other experts' computations and are not judged.</p>",
              _html_table(head, rows, ["" if ok else "bad" for ok in oks])]
    return b


def _html_tokens(r: SignoffResult) -> list[str]:
    """Token and logits agreement, the token table and the generated-token flips."""
    m = r.metrics
    b = ["<h2>Tokens and logits</h2>",
         f"<p>token agreement: <b>{percent(m.token_agreement)}</b> of {m.tokens_compared} "
         f"generated tokens; top-1 agreement: <b>{percent(m.top1_agreement)}</b> of "
         f"{m.logits_positions} positions; max KL: <b>{_e(number(m.max_logits_kl))}</b>; "
         f"flips: {m.near_tie_flips} near-tie, {m.real_flips} real</p>"]
    head, rows = token_rows(r)
    if rows:
        b.append(_html_table(head, rows))
    head, rows = flip_rows(r)
    if rows:
        b += ["<p>Generated-token flips:</p>",
              _html_table(head, rows, ["" if x[-1] == "near-tie" else "bad" for x in rows])]
    return b


def _html_regression(r: SignoffResult) -> list[str]:
    """The comparison with the last release's sign-off, or how to give one."""
    b = ["<h2>Regression against the last release</h2>"]
    if r.regression is None:
        b.append("<p>No previous release given (set <code>previous</code> in the scenario or "
                 "pass <code>--previous</code>).</p>")
    else:
        b.append(f"<p><b>{_e(r.regression.sentence)}</b> (previous: "
                 f"<span class='mono'>{_e(r.regression.previous)}</span>)</p>")
        if r.regression.note:
            b.append(f"<p>NOTE: {_e(r.regression.note)}</p>")
        head, rows = regression_rows(r)
        b.append(_html_table(head, rows, ["bad" if x[-1] == "worse" else "" for x in rows]))
    return b
