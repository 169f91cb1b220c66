"""Render an Analysis (diff + locate) as table, json, csv or md. Imports diff, locate; formats only.
The html page is report.html_diff's `to_html` (it imports this module, so not the other way).

`render(analysis, fmt)` -> str. `verdict_line(analysis)` is the first line of every format:
`PASS ...` or `FAIL: divergence starts at step S, <module> (<slot>): rel_l2 X, input rel_l2 Y
-> introduced here`. The JSON schema is documented in docs/diff-json.md (SCHEMA_VERSION below);
non-finite numbers are written as the strings "inf", "-inf", "nan".
"""
from __future__ import annotations

import csv
import io
import json
import math
from typing import Any

from accucheck.compare.results import DiffResult, LogitsStep, RecordDiff, TokenFlip
from accucheck.compare.routing import JUDGED_ELSEWHERE, flip_line
from accucheck.compare.tolerances import NEAR_TIE_FACTOR, loosest_dtype
from accucheck.verdict.locate import Analysis
from accucheck.report.noise import control_json, control_lines
from accucheck.report.routing import routing_clause, routing_json, routing_lines
from accucheck.verdict.types import Divergence, RecordLocation
from accucheck.numbers import cosine, number

FORMATS = ("table", "json", "csv", "md")
SCHEMA = "accucheck.diff"
SCHEMA_VERSION = 1
TOP_ROWS = 12        # worst records shown in table / md
MAX_CURVE_ROWS = 24  # layers shown in table / md (evenly thinned above that)
MAX_STEP_COLS = 4    # steps shown in the layer curve (first ones and the last one)


BASIS_MARK = {"stats": " (>=)", "sample": " (~)"}  # lower bound / estimate, not exact


def render(analysis: Analysis, fmt: str = "table") -> str:
    if fmt == "json":
        return json.dumps(to_json(analysis), indent=1, sort_keys=False) + "\n"
    if fmt == "csv":
        return to_csv(analysis)
    if fmt in ("table", "md"):
        return to_text(analysis, md=fmt == "md")
    raise ValueError(f"unknown format {fmt!r}: use one of {', '.join(FORMATS)}")


# ----------------------------------------------------------------------------- verdict



def _slot(key) -> str:
    return f"{key.role}.{key.slot}"


def _where(fd: Divergence) -> str:
    req = f"request {fd.key.req}, " if fd.key.req else ""
    return f"step {fd.step}, {req}{fd.module} ({_slot(fd.key)})"


def first_difference_line(fd: Divergence) -> str:
    """Where two runs that agree bitwise at first start to compute otherwise."""
    line = (f"First difference: {_where(fd)}: rel_l2 {number(fd.error)} (tolerance "
            f"{number(fd.tolerance)}); every record before it is identical")
    if fd.key.role == "in" and "." in fd.module:
        line += (f"; it is an input no record produced: made by code of "
                 f"{fd.module.rsplit('.', 1)[0]} that no record covers")
    return line


# the one line every headline without a control run ends with: how to get one
CONTROL_HINT = ("no control run: `diff --control auto` (or `capture --control-for REF`) "
                "judges at the noise scale")
# a site more than the noise of ONE control run by less than this factor over its threshold:
# where correct devices were flagged (margins 1.00-1.49 against one dithered control, 4 of 400
# clean stats pairs and 8 of 800 full-store ones; 1 of 400 against two: docs/control.md), so
# the headline says a second control would tell
ONE_CONTROL_CLOSE = 1.5
ONE_CONTROL_HINT = ("1 control run: correct devices stood this close to the threshold in about "
                    "1 % of clean pairs, against two controls in 0.25 %; `diff --control auto` "
                    "makes two")


def verdict_line(a: Analysis) -> str:
    """The headline. Without a control run or a golden, in a reduced-precision run or when
    accumulated error over tolerance passes, it ends with how to get a control."""
    line = _verdict(a)
    d = a.diff
    low = loosest_dtype(d.compute_dtypes) not in ("float32", "float64", "int64")
    if a.location.noise is None and d.golden_path is None and (low or a.accumulated):
        line += f" [{CONTROL_HINT}]"
    return line


def _verdict(a: Analysis) -> str:
    d, L = a.diff, a.location
    fd = L.first_divergence
    weaker = ""
    if d.basis in ("stats", "sample", "mixed"):
        weaker = (" [weaker: some records have statistics only, compared by a lower bound"
                  " and sampled values]")
    weaker += routing_clause(d.routing, d.records)
    if fd is not None and fd.routing is not None:
        return (f"FAIL: real MoE routing flip at {flip_line(fd.routing)}: the router's logits "
                f"moved more than their noise -> introduced here{weaker}")
    if L.noise is not None:
        return _control_line(a, weaker)
    if d.within:
        return _pass_line(a, weaker)
    if a.accumulated:
        return (f"PASS: nothing introduces more than rounding noise: {len(d.failed)} of "
                f"{len(d.records)} records over the {d.failed[0].tolerance.source} tolerance "
                f"carry error accumulated through the model ({L.no_culprit_reason}); largest at "
                f"{_where(L.worst)}: rel_l2 {number(L.worst.error)}{weaker}")
    if fd is None and L.first_over is not None:
        return _no_culprit_line(a, weaker)
    if fd is None:
        return _no_divergence_line(a, weaker)
    return _divergence_line(a, weaker)


def _pass_line(a: Analysis, weaker: str) -> str:
    """The headline of a diff within tolerance (no control run)."""
    d, L = a.diff, a.location
    worst = max((r for r in d.records
                 if not r.absorbed and r.routing not in JUDGED_ELSEWHERE),
                key=lambda r: r.error / max(r.tolerance.rel_l2, 1e-300), default=None)
    w = (f"; worst rel_l2 {number(worst.error)} at {worst.key} (tolerance "
         f"{number(worst.tolerance.rel_l2)})") if worst is not None else ""
    ref = sum(r.refereed and not r.within_tolerance for r in d.records)
    refereed = (f"; {ref} over tolerance judged no worse than the reference by the golden "
                f"referee") if ref else ""
    flip = ""
    if d.first_flip is not None:
        flip = (f"; near-tie token flip at request {d.first_flip.req} step "
                f"{d.first_flip.step}")
    sus = ""
    if L.suspicious:
        s = L.suspicious[0]
        sus = (f"; SUSPICIOUS: {len(L.suspicious)} record(s) far above the noise of their "
               f"peers, first {s.key}: amplifies its input error x{number(s.gain)}, peers "
               f"x{number(s.peers_median)}")
    return f"PASS: {len(d.records)} records within tolerance{w}{refereed}{flip}{sus}{weaker}"


def _no_culprit_line(a: Analysis, weaker: str) -> str:
    """Records over tolerance but none introduces the error: a real token flip, noise-like
    error at the first record, or diffuse / inherited error."""
    d, L = a.diff, a.location
    fo, wo = L.first_over, L.worst
    inp = number(fo.input_error) if fo.input_error is not None else "unknown"
    largest = "" if wo is None or wo.key == fo.key else \
        f"; largest at {_where(wo)}: rel_l2 {number(wo.error)}"
    sus = ""
    if L.suspicious:  # an outlier the noise floor found: the lead the tolerance missed
        x = L.suspicious[0]
        sus = (f"; SUSPICIOUS upstream: {len(L.suspicious)} record(s) far above the noise "
               f"of their peers, first {x.key}: amplifies its input error x{number(x.gain)}, "
               f"peers x{number(x.peers_median)}")
    flip = next((f for f in d.flips if f.near_tie is not True), None)
    if flip is not None and d.golden_path is None:
        # no culprit: a real token flip fails it (verdict.locate.Analysis.within)
        return (f"FAIL: generated token differs at request {flip.req} step {flip.step} "
                f"(ref {flip.ref_token}, cand {flip.cand_token}): {_flip_why(flip)}; no "
                f"culprit named: {len(d.failed)} records over tolerance, "
                f"{L.no_culprit_reason}{sus}{weaker}")
    if L.noise_like is not None:
        n = L.noise_like
        return (f"FAIL: {len(d.failed)} records over tolerance; the first to introduce "
                f"error, {n.key} (local rel_l2 {number(n.local)}), is at {n.reason}: rounding "
                f"noise of the dtype, or a defect every {n.kind} shares; no culprit "
                f"named{sus}{weaker}")
    return (f"FAIL: {len(d.failed)} records over tolerance, but no record introduces the "
            f"error (diffuse / inherited): first at {_where(fo)}: rel_l2 {number(fo.error)}, "
            f"input rel_l2 {inp}{largest} [tolerance {number(fo.tolerance)}]; no culprit "
            f"named{sus}{weaker}")


def _no_divergence_line(a: Analysis, weaker: str) -> str:
    """No record over tolerance: only a real token flip, or only recorded inputs ("in") differ."""
    d = a.diff
    f = next((f for f in d.flips if f.near_tie is not True), None)
    if f is None:
        r = d.failed[0]
        return (f"FAIL: only recorded inputs differ, first {r.key}: rel_l2 {number(r.error)} "
                f"[tolerance {number(r.tolerance.rel_l2)}]; their producer is not recorded: "
                f"widen --include{weaker}")
    return (f"FAIL: generated token differs at request {f.req} step {f.step} (ref "
            f"{f.ref_token}, cand {f.cand_token}): {_flip_why(f)}{weaker}")


def _divergence_line(a: Analysis, weaker: str) -> str:
    """The headline that names where the divergence starts (the first record introducing it)."""
    d, fd = a.diff, a.location.first_divergence
    if fd.basis == "shape":
        r = d.record(fd.key)
        return (f"FAIL: divergence starts at {_where(fd)}: shape {list(r.ref_shape)} vs "
                f"{list(r.cand_shape)}{weaker}")
    bound = {"stats": "rel_l2 >= ", "sample": "rel_l2 ~ "}.get(fd.basis, "rel_l2 ")
    inp = (f"{number(fd.input_error)} ({fd.input_basis})" if fd.input_error is not None
           else "unknown")
    nan = ""
    if fd.metrics is not None and fd.metrics.nan_inf_mismatch:
        nan = f", {fd.metrics.nan_inf_mismatch} NaN/Inf positions differ"
    r = d.record(fd.key)
    judged = "; golden referee: cand worse" if r.refereed else ""
    return (f"FAIL: divergence starts at {_where(fd)}: {bound}{number(fd.error)}, input rel_l2 "
            f"{inp} -> introduced here [tolerance {number(fd.tolerance)}{nan}{judged}]{weaker}")


def _control_line(a: Analysis, weaker: str) -> str:
    """The headline when control runs decide: more than noise, or not."""
    d, L = a.diff, a.location
    noise, fd = L.noise, L.first_divergence
    k = len(noise.controls)
    ctl = f"{k} control run{'s' if k > 1 else ''}"
    whose = "the control run's" if k == 1 else f"the {k} control runs'"
    flip = next((f for f in d.flips if f.near_tie is not True), None)
    if fd is not None:
        s = fd.noise
        x = noise.record(fd.key)
        made = (f" (an input no record produced: code of {fd.path[-1]} that no record covers)"
                if fd.key.role == "in" and fd.path else "")
        flagged = noise.lead_of or s  # the site more than noise
        close = (f" [{ONE_CONTROL_HINT}]" if k == 1 and
                 flagged.excess < ONE_CONTROL_CLOSE * flagged.threshold else "")
        if noise.lead_of is not None:  # the origin of a site more than noise downstream
            o = noise.lead_of
            return (f"FAIL: more than noise from {_where(fd)}{made}: excess x{number(s.excess)} "
                    f"over the site's {s.records} records, within "
                    f"{100 * (1 - s.origin):.0f} % of its threshold x{number(s.threshold)}, "
                    f"and it feeds {o.site}, more than noise (x{number(o.excess)} > "
                    f"x{number(o.threshold)}), in its layer -> introduced here (the origin)"
                    f"{weaker}{close}")
        return (f"FAIL: more than noise from {_where(fd)}{made}: x{number(x.ratio)} "
                f"{whose} error, what feeds it x{number(x.input_ratio)}; excess "
                f"x{number(s.excess)} over the site's {s.records} records (more than noise above "
                f"x{number(s.threshold)}) -> introduced here{weaker}{close}")
    if flip is not None:
        return (f"FAIL: generated token differs at request {flip.req} step {flip.step} (ref "
                f"{flip.ref_token}, cand {flip.cand_token}): {_flip_why(flip)}; no record is "
                f"more than {whose} noise{weaker}")
    top = noise.sites[0] if noise.sites else None
    worst = (f"; closest to more than noise: {top.site}, excess x{number(top.excess)} (threshold "
             f"x{number(top.threshold)})") if top is not None else ""
    over = sum(not r.within_tolerance for r in d.records)
    tol = f"; {over} over the dtype tolerance, as the control is" if over else ""
    return (f"PASS: {len(noise.records)} records within the noise of {ctl}{worst}{tol}"
            f"{weaker}")


def _flip_why(f: TokenFlip) -> str:
    if f.near_tie is None:
        return "no logits stored to tell a near-tie from a real flip (capture with --store full)"
    return (f"reference margin {number(f.margin)} vs logit noise {number(f.noise)} (a "
            f"near-tie up to x{NEAR_TIE_FACTOR:g}): "
            f"{'a near-tie' if f.near_tie else 'a real flip'}")


# ----------------------------------------------------------------------------- json

def _num(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    return x


def _clean(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return _num(obj)


def _key_fields(key) -> dict:
    return {"key": str(key), "req": key.req, "step": key.step, "module": key.module,
            "call": key.call, "op": key.op, "op_index": key.op_index, "role": key.role,
            "slot": key.slot}


def _record_json(r: RecordDiff, loc: RecordLocation) -> dict:
    out = _key_fields(r.key)
    out.update({
        "kind": r.kind, "ref_dtype": r.ref_dtype, "cand_dtype": r.cand_dtype,
        "ref_shape": list(r.ref_shape), "cand_shape": list(r.cand_shape), "basis": r.basis,
        "within": r.within, "cause": loc.cause, "rel_l2": r.error, "cosine": r.cosine,
        "routing": r.routing, "rows_excluded": r.rows_excluded,
        "input_rel_l2": loc.input_error, "input_from": list(loc.input_from),
        "input_basis": loc.input_basis, "inner_rel_l2": loc.inner_error,
        "refereed": r.refereed, "within_tolerance": r.within_tolerance,
        "src": dict(r.src),
        "introduced": loc.introduced, "tolerance": r.tolerance.as_dict(),
        "metrics": r.metrics.as_dict() if r.metrics is not None else None,
        "stats": ({"identical": r.stats.identical,
                   "rel_l2_lower_bound": r.stats.rel_l2_lower_bound,
                   "bound_from": r.stats.bound_from,
                   "nan_inf_mismatch": r.stats.nan_inf_mismatch}
                  if r.stats is not None else None),
        "shadow": r.shadow.as_dict() if r.shadow is not None else None,
        "golden": (dict(r.golden.__dict__) if r.golden is not None else None),
    })
    return out


def _flip_json(f: TokenFlip | None) -> dict | None:
    if f is None:
        return None
    return {"req": f.req, "step": f.step, "position": f.position, "ref_token": f.ref_token,
            "cand_token": f.cand_token, "margin": f.margin, "noise": f.noise,
            "generating": f.generating, "near_tie": f.near_tie, "label": f.label,
            "source": f.source}


def _logits_json(s: LogitsStep) -> dict:
    return {"key": str(s.key), "req": s.key.req, "step": s.key.step, "max_kl": s.max_kl,
            "top1_agreement": s.top1_agreement,
            "positions": [{"position": p.position, "kl": p.kl, "top1_ref": p.top1_ref,
                           "top1_cand": p.top1_cand, "agree": p.agree,
                           "top5_overlap": p.top5_overlap, "margin": p.margin,
                           "noise": p.noise} for p in s.positions]}


def to_json(a: Analysis) -> dict:
    d, L = a.diff, a.location
    def div(fd: Divergence | None) -> dict | None:
        if fd is None:
            return None
        return dict(_key_fields(fd.key), **{
            "cause": fd.cause, "rel_l2": fd.error, "input_rel_l2": fd.input_error,
            "input_from": list(fd.input_from), "input_basis": fd.input_basis,
            "inner_rel_l2": fd.inner_error, "amplification": fd.amplification,
            "tolerance": fd.tolerance, "basis": fd.basis, "path": list(fd.path),
            "metrics": fd.metrics.as_dict() if fd.metrics is not None else None})
    golden = None
    if d.golden_path is not None:
        labels = [dict(_key_fields(r.key), **r.golden.__dict__) for r in d.records
                  if r.golden is not None]
        counts: dict[str, int] = {}
        for x in labels:
            counts[x["label"]] = counts.get(x["label"], 0) + 1
        golden = {"path": d.golden_path, "counts": counts, "labels": labels}
    out = {
        "schema": SCHEMA, "schema_version": SCHEMA_VERSION,
        "verdict": a.verdict, "exit_code": a.exit_code, "summary": verdict_line(a),
        "ref": d.ref_path, "cand": d.cand_path, "golden_path": d.golden_path,
        "basis": d.basis, "notes": list(d.notes),
        "tolerances": d.tolerances.as_dict(), "amplification": L.amplification,
        "counts": {"compared": len(d.records), "over_tolerance": len(d.failed),
                   "missing": len(d.missing), "skipped": d.skipped},
        "compared_steps": [{"req": r, "last_step": s if s >= 0 else None}
                           for r, s in d.compared_steps],
        "io": None if d.io is None else {k: d.io[k] for k in (
            "bytes_read", "bytes_data", "unread_identical", "jobs")},
        "first_divergence": div(L.first_divergence),
        "diffuse": L.diffuse,
        "noise_like": None if L.noise_like is None else {
            "key": str(L.noise_like.key), "error": L.noise_like.error,
            "local": L.noise_like.local, "peers_median": L.noise_like.peers_median,
            "peers": L.noise_like.peers, "kind": L.noise_like.kind, "ratio": L.noise_like.ratio,
            "records": L.noise_like.records, "gate": L.noise_like.gate,
            "bounded": L.noise_like.bounded},
        "first_over": div(L.first_over),
        "worst": div(L.worst),
        "first_difference": div(L.first_difference),
        "suspicious": [dict(_key_fields(x.key), rel_l2=x.error, local=x.local,
                            gain=x.gain, peers_median=x.peers_median, ratio=x.ratio, peers=x.peers,
                            kind=x.kind, tolerance=x.tolerance,
                            within=x.within) for x in L.suspicious],
        "precision_findings": [dict(_key_fields(r.key), ref_dtype=r.ref_dtype,
                                    cand_dtype=r.cand_dtype)
                               for r in d.precision_findings],
        "compute_dtypes": {"ref": d.compute_dtypes[0], "cand": d.compute_dtypes[1]},
        "top": [str(x.key) for x in L.top],
        "records": [_record_json(r, l) for r, l in zip(d.records, L.records)],
        "missing": [{"key": m.key, "only_in": m.only_in} for m in d.missing],
        "layers": [{"req": p.req, "step": p.step, "layer": p.layer, "key": str(p.key),
                    "rel_l2": p.rel_l2, "cosine": p.cosine, "within": p.within}
                   for p in L.curve],
        "logits": {"steps": [_logits_json(s) for s in d.logits],
                   "first_flip": _flip_json(d.first_flip),
                   "flips": [_flip_json(f) for f in d.flips]},
        "golden": golden,
        "culprit": a.culprit.as_dict() if a.culprit is not None else None,
        "control": control_json(L.noise),
        "routing": routing_json(d.routing),
        "mapping": d.mapping,
        "ops": ({"matches": [m.__dict__ for m in d.ops.matches],
                 "one_sided": [o.__dict__ for o in d.ops.one_sided]}
                if d.ops is not None else None),
    }
    return _clean(out)


# ----------------------------------------------------------------------------- csv

CSV_COLUMNS = ("key", "req", "step", "module", "op", "role", "slot", "kind", "ref_dtype",
               "cand_dtype", "basis", "within", "cause", "rel_l2", "input_rel_l2", "cosine",
               "max_abs", "mean_abs", "max_rel", "sqnr_db", "rmse", "max_ulp",
               "frac_rel_lt_1e3", "frac_rel_lt_5e3", "nan_inf_mismatch", "tol_rel_l2",
               "golden")


def to_csv(a: Analysis) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(CSV_COLUMNS)
    for r, loc in zip(a.diff.records, a.location.records):
        m = r.metrics
        w.writerow([_num(x) for x in (
            str(r.key), r.key.req, r.key.step, r.key.module, r.key.op or "", r.key.role,
            r.key.slot, r.kind, r.ref_dtype, r.cand_dtype, r.basis, int(r.within),
            loc.cause or "", r.error,
            "" if loc.input_error is None else loc.input_error,
            "" if m is None else m.cosine, "" if m is None else m.max_abs,
            "" if m is None else m.mean_abs, "" if m is None else m.max_rel,
            "" if m is None else m.sqnr_db, "" if m is None else m.rmse,
            "" if m is None or m.max_ulp is None else m.max_ulp,
            "" if m is None else m.frac_rel_lt_1e3, "" if m is None else m.frac_rel_lt_5e3,
            "" if m is None else m.nan_inf_mismatch, r.tolerance.rel_l2,
            r.golden.label if r.golden is not None else "")])
    return buf.getvalue()


# ----------------------------------------------------------------------------- table / md

def to_text(a: Analysis, md: bool = False) -> str:
    fmt = "github" if md else "simple"
    h = "### " if md else ""  # the heading mark of every section
    out = _head_lines(a, md) + _culprit_lines(a, h) + _finding_lines(a, fmt, h)
    out += ["", h + "Worst records", _worst_table(a, fmt)]
    return "\n".join(out + _tail_lines(a, fmt, h)) + "\n"


def _head_lines(a: Analysis, md: bool) -> list[str]:
    """The verdict line, the files and counts, the notes and the first difference."""
    d, L = a.diff, a.location
    out = [("**" + verdict_line(a) + "**") if md else verdict_line(a)]
    out.append(f"ref {d.ref_path} | cand {d.cand_path}"
               + (f" | golden {d.golden_path}" if d.golden_path else "")
               + f" | basis {d.basis} | {len(d.records)} compared, {len(d.failed)} over "
               f"tolerance, {len(d.missing)} on one side only"
               + (f", {d.skipped} skipped" if d.skipped else ""))
    for n in d.notes:
        out.append(f"NOTE: {n}")
    if L.first_difference is not None:
        out.append(first_difference_line(L.first_difference))
    return out


def _culprit_lines(a: Analysis, h: str) -> list[str]:
    """The culprit section, or why there is none (noise-like or diffuse error); else nothing."""
    L = a.location
    culprit = a.culprit  # module + op with evidence (accucheck.verdict.culprit)
    if culprit is not None:
        from accucheck.verdict.culprit import culprit_lines

        return ["", h + "Culprit"] + culprit_lines(culprit)
    if L.noise_like is not None:
        n, wo = L.noise_like, L.worst
        return ["", h + "No culprit",
                f"The first record to introduce error over tolerance, {n.key}, introduces "
                f"{number(n.local)} (local rel_l2) and is at {n.reason}. This is what rounding "
                f"noise at this dtype looks like in a deep model (or a defect that every "
                f"{n.kind} shares). Largest at {_where(wo)}: rel_l2 {number(wo.error)}. A control "
                f"run judges at the noise scale: `accucheck diff REF CAND --control auto`, or "
                f"`accucheck capture MODEL --control-for REF.h5 -o ctl.h5`, then `accucheck "
                f"diff REF CAND --control ctl.h5` (docs/control.md)."]
    if L.diffuse:
        wo = L.worst
        return ["", h + "No culprit",
                f"The error is diffuse / inherited: every record over tolerance is explained by "
                f"what feeds it (x{number(L.amplification)} rule). Largest at {_where(wo)}: "
                f"rel_l2 {number(wo.error)}, input {number(wo.input_error)}. Compare with a golden "
                f"(float64) capture (--golden) to see whether the candidate is worse or just "
                f"different."]
    return []


def _finding_lines(a: Analysis, fmt: str, h: str) -> list[str]:
    """The control, MoE routing, suspicious and precision sections, those with something."""
    d, L = a.diff, a.location
    out: list[str] = []
    if L.noise is not None:
        out += ["", h + "Control (more than noise?)"]
        out += control_lines(L.noise, fmt)
    if d.routing is not None:
        out += ["", h + "MoE routing"] + routing_lines(d.routing, fmt)
    if L.suspicious:
        out += ["", h + "Suspicious (noise floor)"]
        for x in L.suspicious[:8]:
            out.append(f"SUSPICIOUS: {x.key}: rel_l2 {number(x.error)} (tolerance "
                       f"{number(x.tolerance)}), local {number(x.local)}: it amplifies what "
                       f"feeds it x{number(x.gain)}, its {x.peers} peers ({x.kind}) "
                       f"x{number(x.peers_median)} (median)")
    findings = d.precision_findings
    if findings:
        out += ["", h + "Precision findings"]
        for r in findings[:8]:
            out.append(f"PRECISION: {r.key}: candidate {r.cand_dtype}, reference {r.ref_dtype} "
                       f"(both runs {d.compute_dtypes[0]})")
        if len(findings) > 8:
            out.append(f"... {len(findings) - 8} more (--format json)")
    return out


def _worst_records(a: Analysis) -> list[RecordDiff]:
    """At most TOP_ROWS records, inputs left out: the introducing ones first (at most half,
    most introduced first), then the rest by error relative to tolerance."""
    d, L = a.diff, a.location
    locs = {str(x.key): x for x in L.records}
    shown = []
    seen = set()
    for x in L.top:
        if x.key.role != "in":
            shown.append(d.record(x.key))
            seen.add(str(x.key))
    rest = sorted((r for r in d.records if str(r.key) not in seen and r.key.role != "in"),
                  key=lambda r: -(r.error / max(r.tolerance.rel_l2, 1e-300)))
    shown = sorted(shown, key=lambda r: -locs[str(r.key)].introduced)[:TOP_ROWS // 2]
    shown += rest[:TOP_ROWS - len(shown)]
    return shown


def _worst_table(a: Analysis, fmt: str) -> str:
    from tabulate import tabulate  # lazy: keeps `import accucheck.report.diff` light

    d = a.diff
    locs = {str(x.key): x for x in a.location.records}
    rows = []
    for r in _worst_records(a):
        loc = locs[str(r.key)]
        m = r.metrics
        row = [str(r.key), r.routing if r.routing in JUDGED_ELSEWHERE else
               "ok" if r.within else (loc.cause or "over"),
               number(r.error) + BASIS_MARK.get(r.basis, ""),
               number(loc.input_error), number(loc.introduced),
               cosine(m.cosine) if m else "-", number(m.max_abs) if m else "-",
               (number(float(m.max_ulp)) if m and m.max_ulp is not None else "-"),
               number(r.tolerance.rel_l2)]
        if d.golden_path:
            row.append(r.golden.label if r.golden else "-")
        rows.append(row)
    heads = ["record", "status", "rel_l2", "input", "introduced", "cosine", "max_abs", "ulp",
             "tol"] + (["golden"] if d.golden_path else [])
    return tabulate(rows, heads, tablefmt=fmt, disable_numparse=True)


def _tail_lines(a: Analysis, fmt: str, h: str) -> list[str]:
    """After the worst records: the layer curve, logits, golden counts, one-sided records."""
    d = a.diff
    out: list[str] = []
    curve = _curve_table(a.location, fmt)
    if curve:
        out += ["", h + "Per-layer error (layer outputs: rel_l2 / cosine, "
                "max over requests)", curve]
    if d.logits or d.first_flip:
        out += ["", h + "Logits", _logits_table(d, fmt)]
    if d.golden_path:
        counts: dict[str, int] = {}
        for r in d.records:
            if r.golden is not None:
                counts[r.golden.label] = counts.get(r.golden.label, 0) + 1
        out += ["", "Golden referee: " + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()))]
    if d.missing:
        sample = ", ".join(m.key for m in d.missing[:3])
        out += ["", f"On one side only ({len(d.missing)}): {sample}"
                + (" ..." if len(d.missing) > 3 else "") + "  (full list: --format json)"]
    return out


def _curve_table(L, fmt: str) -> str:
    from tabulate import tabulate

    if not L.curve:
        return ""
    steps = sorted({p.step for p in L.curve})
    hidden = ""
    if len(steps) > MAX_STEP_COLS:
        left_out = steps[MAX_STEP_COLS - 1:-1]
        span = f"step {left_out[0]}" if len(left_out) == 1 else \
            f"steps {left_out[0]}..{left_out[-1]}"
        hidden = f"\n({span} not shown here: --format json has every step)"
        steps = steps[:MAX_STEP_COLS - 1] + [steps[-1]]
    layers = sorted({p.layer for p in L.curve})
    if len(layers) > MAX_CURVE_ROWS:
        k = math.ceil(len(layers) / MAX_CURVE_ROWS)
        layers = layers[::k] + ([layers[-1]] if layers[-1] not in layers[::k] else [])
    cell: dict[tuple[int, int], tuple[float, float | None, bool]] = {}
    for p in L.curve:
        c = cell.get((p.layer, p.step))
        if c is None or p.rel_l2 > c[0]:
            cell[(p.layer, p.step)] = (p.rel_l2, p.cosine, p.within)
    rows = []
    for ly in layers:
        row = [ly]
        for s in steps:
            c = cell.get((ly, s))
            row.append("-" if c is None else
                       f"{number(c[0])} / {cosine(c[1])}"
                       + ("" if c[2] else " *"))
        rows.append(row)
    return tabulate(rows, ["layer"] + [f"step {s}" for s in steps], tablefmt=fmt,
                    disable_numparse=True) + hidden


def _logits_table(d: DiffResult, fmt: str) -> str:
    from tabulate import tabulate

    by_step: dict[int, list[LogitsStep]] = {}
    for s in d.logits:
        by_step.setdefault(s.key.step, []).append(s)
    rows = []
    for st in sorted(by_step)[:8]:
        ss = by_step[st]
        pos = [p for s in ss for p in s.positions]
        rows.append([st, len(pos), number(max(p.kl for p in pos) if pos else 0.0),
                     f"{sum(p.agree for p in pos)}/{len(pos)}",
                     number(min((p.top5_overlap for p in pos), default=1.0))])
    text = tabulate(rows, ["step", "positions", "max KL", "top-1 agree", "min top-5 overlap"],
                    tablefmt=fmt, disable_numparse=True) if rows else ""
    f = d.first_flip
    line = "first token flip: none" if f is None else (
        f"first token flip: request {f.req} step {f.step} position {f.position}"
        f"{' (generated)' if f.generating else ''}: ref {f.ref_token} vs cand {f.cand_token}, "
        f"{_flip_why(f)}")
    return (text + "\n" if text else "") + line


def flip_context(d: DiffResult) -> list[str]:
    """What can move the output besides a culprit's error, for `diff --impact`'s line
    (accucheck.impact.join): a near-tie token flip at a generating position (any small
    difference upstream can flip it), a routing flip (other experts compute from there on)."""
    out = []
    f = next((f for f in d.flips if f.near_tie), None)
    if f is not None:
        out.append(f"the token flip at request {f.req} step {f.step} is a near-tie (margin "
                   f"{number(f.margin)}, logit noise {number(f.noise)}): a small difference "
                   f"anywhere upstream can flip it")
    if d.routing is not None and d.routing.first_flip is not None:
        out.append(f"a routing flip ({flip_line(d.routing.first_flip)}): other experts compute "
                   f"from there on; patch the routers (impact --include '*.mlp.gate')")
    return out
