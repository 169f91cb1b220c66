"""report.diff probed where a plausible wrong rendering gives another text (issue 16: tests that
can fail): every form of the verdict line, the JSON / csv fields, the text
report's sections and row choice, the layer curve's thinning and the logits table. Analyses are
built record by record (test_verdict_mutants.D, no files, no model); each assertion is on the
exact text or value. Milliseconds per test."""
from __future__ import annotations

import csv
import dataclasses
import io
import json
import math

import pytest

from accucheck.compare.results import (GoldenLabel, LogitsPosition, LogitsStep, MissingKey,
                                       StatsDelta, TokenFlip)
from accucheck.compare.metrics import TensorMetrics
from accucheck.compare.opmatch import OneSided, OpAlignment, OpMatch
from accucheck.keys import RecordKey
from accucheck.report.diff import (CSV_COLUMNS, _curve_table, _logits_table, render,
                                   to_csv, to_json, to_text, verdict_line)
from accucheck.verdict.locate import Analysis
from accucheck.verdict.types import LayerPoint, Suspicious
from test_verdict_mutants import D

E0, A = "r0.s0:e#0:out.0", "r0.s0:a#0:out.0"


def _pass():
    """e#0 exact, a#0 5e-3 (within 1e-2)."""
    return D().add(E0).add(A, 5e-3, src={"0": "e#0:out.0"})


def _fail():
    """a#0 introduces rel_l2 0.5 behind an exact e#0."""
    return D().add(E0).add(A, 0.5, src={"0": "e#0:out.0"})


def _with(a: Analysis, *, diff=None, **loc) -> Analysis:
    d = dataclasses.replace(a.diff, **(diff or {}))
    return Analysis(d, dataclasses.replace(a.location, **loc))


def _rec(d: D, i: int, **kw):
    d.recs[i] = dataclasses.replace(d.recs[i], **kw)
    return d


def _stats(bound: float, nan_inf: int = 0) -> StatsDelta:
    return StatsDelta(False, bound, "l2", nan_inf)


def _flip(near_tie: bool | None, *, req=0, step=1, position=5, generating=True) -> TokenFlip:
    m, n = {True: (0.1, 0.2), False: (2.0, 0.2), None: (None, None)}[near_tie]
    return TokenFlip(req, step, position, 11, 12, m, n, generating, "logits")


# ----------------------------------------------------------------------------- verdict line

def test_pass_line_names_the_worst_record_relative_to_its_tolerance():
    d = D().add(E0, 4e-3).add(A, 5e-3, src={"0": "e#0:out.0"}, tol=0.1)
    assert verdict_line(d.analysis()) == ("PASS: 2 records within tolerance; worst rel_l2 0.004 at"
                                          " r0.s0:e#0:out.0 (tolerance 0.01)")
    # a zero tolerance and an exact record: 0 / 1e-300 = 0, never a division by zero
    z = D().add(E0, 0.0, tol=0.0).add(A, 1e-3, src={"0": "e#0:out.0"})
    assert verdict_line(z.analysis()) == ("PASS: 2 records within tolerance; worst rel_l2 0.001 "
                                          "at r0.s0:a#0:out.0 (tolerance 0.01)")
    empty = D().analysis()
    assert verdict_line(empty) == "PASS: 0 records within tolerance"


def test_pass_line_counts_refereed_records_near_tie_flips_and_suspicious():
    d = D().add(E0).add(A, 0.5, src={"0": "e#0:out.0"}, golden="ref worse")
    d.add("r0.s0:b#0:out.0", 0.2, src={"0": "a#0:out.0"}, golden="both within noise")
    # refereed too, but within its tolerance anyway: not one of those the referee let pass
    d.add("r0.s0:c#0:out.0", 5e-3, src={"0": "b#0:out.0"}, golden="both within noise")
    a = d.analysis(golden_path="g.h5")
    s = Suspicious(RecordKey.parse(A), 0.5, 0.4, 12.5, 1.25, 3, "a#0:out.0", 1e-2, True)
    s2 = dataclasses.replace(s, key=RecordKey.parse("r0.s0:b#0:out.0"), gain=7.0)
    a = _with(a, diff=dict(first_flip=_flip(True, req=1, step=2)), suspicious=(s, s2))
    assert verdict_line(a) == (
        "PASS: 4 records within tolerance; worst rel_l2 0.5 at r0.s0:a#0:out.0 (tolerance 0.01)"
        "; 2 over tolerance judged no worse than the reference by the golden referee"
        "; near-tie token flip at request 1 step 2"
        "; SUSPICIOUS: 2 record(s) far above the noise of their peers, first r0.s0:a#0:out.0: "
        "amplifies its input error x12.5, peers x1.25")


def test_fail_line_divergence_forms():
    assert verdict_line(_fail().analysis()) == (
        "FAIL: divergence starts at step 0, a (out.0): rel_l2 0.5, input rel_l2 0 (links) -> "
        "introduced here [tolerance 0.01]")
    # request 1, no known input, NaN positions, refereed by the golden
    d = D().add("r1.s2:m.x#0:out.0", 0.5, nan_inf=3, golden="cand worse")
    assert verdict_line(d.analysis(golden_path="g.h5")) == (
        "FAIL: divergence starts at step 2, request 1, m.x (out.0): rel_l2 0.5, input rel_l2 "
        "unknown -> introduced here [tolerance 0.01, 3 NaN/Inf positions differ; golden "
        "referee: cand worse]")


@pytest.mark.parametrize("basis, bound, weaker", [
    ("stats", "rel_l2 >= ", True), ("sample", "rel_l2 ~ ", True)])
def test_fail_line_says_a_statistics_bound_is_weaker(basis, bound, weaker):
    d = _fail()
    metrics = None if basis == "stats" else d.recs[1].metrics
    _rec(d, 1, basis=basis, metrics=metrics, stats=_stats(0.5))
    line = verdict_line(d.analysis())
    assert line == (f"FAIL: divergence starts at step 0, a (out.0): {bound}0.5, input rel_l2 0 "
                    f"(links) -> introduced here [tolerance 0.01] [weaker: some records have "
                    f"statistics only, compared by a lower bound and sampled values]")


def test_fail_line_shape_mismatch():
    d = D().add(E0).add(A, shape=True, src={"0": "e#0:out.0"})
    assert verdict_line(d.analysis()) == ("FAIL: divergence starts at step 0, a (out.0): shape "
                                          "[1, 8] vs [1, 9]")


def test_fail_line_diffuse_names_first_and_largest():
    d = D().add(E0, 6e-3).add(A, 2e-2, src={"0": "e#0:out.0"})
    d.add("r0.s0:b#0:out.0", 7e-2, src={"0": "a#0:out.0"})
    # with a golden referee: diffuse error fails, named first and largest
    assert verdict_line(d.analysis(golden_path="g.h5")) == (
        "FAIL: 2 records over tolerance, but no record introduces the error (diffuse / "
        "inherited): first at step 0, a (out.0): rel_l2 0.02, input rel_l2 0.006; largest at "
        "step 0, b (out.0): rel_l2 0.07 [tolerance 0.01]; no culprit named")
    # without one (and without a control): accumulated error is no failure by itself
    assert verdict_line(d.analysis()) == (
        "PASS: nothing introduces more than rounding noise: 2 of 3 records over the default "
        "tolerance carry error accumulated through the model (diffuse / inherited); largest at "
        "step 0, b (out.0): rel_l2 0.07 [no control run: `diff --control auto` (or `capture "
        "--control-for REF`) judges at the noise scale]")
    one = D().add(E0, 6e-3).add(A, 2e-2, src={"0": "e#0:out.0"})
    assert verdict_line(one.analysis(golden_path="g.h5")) == (
        "FAIL: 1 records over tolerance, but no record introduces the error (diffuse / "
        "inherited): first at step 0, a (out.0): rel_l2 0.02, input rel_l2 0.006 [tolerance "
        "0.01]; no culprit named")


def test_fail_line_only_inputs_or_only_a_token():
    d = D().add(E0).add("r0.s0:a#0:in.0", 0.5).add(A)
    assert verdict_line(d.analysis()) == (
        "FAIL: only recorded inputs differ, first r0.s0:a#0:in.0: rel_l2 0.5 [tolerance 0.01]; "
        "their producer is not recorded: widen --include")
    ok = _pass().analysis()
    for flips, why in (((_flip(True), _flip(False)), "reference margin 2 vs logit noise 0.2 (a near-tie up to x8): a "
                        "real flip"),
                       ((_flip(None),), "no logits stored to tell a near-tie from a real flip "
                        "(capture with --store full)")):
        a = _with(ok, diff=dict(flips=flips))
        assert verdict_line(a) == ("FAIL: generated token differs at request 0 step 1 (ref 11, "
                                   f"cand 12): {why}")


# ----------------------------------------------------------------------------- json / csv

def test_json_fields_of_a_failing_analysis():
    d = _fail()
    d.add("r0.s0:b#0:out.0", 0.3, src={"0": "a#0:out.0"}, golden="both within noise")
    a = d.analysis(golden_path="g.h5", compute=("float32", "bfloat16"))
    a = _with(a, diff=dict(missing=(MissingKey("r0.s0:z#0:out.0", "cand"),), skipped=4,
                           compared_steps=((0, 2), (1, -1), (2, 0)), notes=("note one",)))
    j = to_json(a)
    assert (j["schema"], j["schema_version"], j["verdict"], j["exit_code"]) == (
        "accucheck.diff", 1, "fail", 1)
    assert j["summary"] == verdict_line(a) and j["basis"] == "tensor"
    assert (j["ref"], j["cand"], j["golden_path"], j["notes"]) == ("ref.h5", "cand.h5", "g.h5",
                                                                   ["note one"])
    # b is over its tolerance, but the golden referee judges it no worse: not counted
    assert j["counts"] == {"compared": 3, "over_tolerance": 1, "missing": 1, "skipped": 4}
    assert j["compared_steps"] == [{"req": 0, "last_step": 2}, {"req": 1, "last_step": None},
                                   {"req": 2, "last_step": 0}]   # -1: every step compared
    assert j["missing"] == [{"key": "r0.s0:z#0:out.0", "only_in": "cand"}]
    fd = j["first_divergence"]
    assert (fd["key"], fd["cause"], fd["rel_l2"], fd["input_rel_l2"], fd["amplification"],
            fd["tolerance"], fd["basis"], fd["input_from"], fd["path"]) == (
        A, "introduced", 0.5, 0.0, "inf", 0.01, "tensor", [E0], [])
    assert fd["metrics"]["rel_l2"] == 0.5
    assert (j["first_over"]["key"], j["worst"]["key"], j["diffuse"]) == (A, A, False)
    assert j["first_difference"]["key"] == A
    assert j["golden"] == {"path": "g.h5", "counts": {"both within noise": 1}, "labels": [
        {"key": "r0.s0:b#0:out.0", "req": 0, "step": 0, "module": "b", "call": 0, "op": None,
         "op_index": None, "role": "out", "slot": "0", "label": "both within noise",
         "ref_rmse": 1.0, "cand_rmse": 1.0, "multiplier": 2.0}]}
    assert j["compute_dtypes"] == {"ref": "float32", "cand": "bfloat16"}
    assert j["top"] == [A] and j["culprit"]["module"] == "a" and j["ops"] is None
    r = j["records"][1]
    assert (r["key"], r["req"], r["step"], r["module"], r["call"], r["op"], r["role"],
            r["slot"], r["kind"], r["within"], r["cause"], r["rel_l2"], r["cosine"],
            r["input_rel_l2"], r["input_from"], r["input_basis"], r["introduced"],
            r["refereed"], r["within_tolerance"], r["src"], r["stats"], r["shadow"],
            r["golden"]) == (
        A, 0, 0, "a", 0, None, "out", "0", "module", False, "introduced", 0.5, 1.0, 0.0, [E0],
        "links", 0.5, False, False, {"0": E0}, None, None, None)
    assert r["tolerance"] == {"rel_l2": 0.01, "rtol": None, "atol": None, "source": "default"}
    assert j["records"][2]["golden"] == {"label": "both within noise", "ref_rmse": 1.0,
                                         "cand_rmse": 1.0, "multiplier": 2.0}
    assert json.loads(render(a, "json")) == j


def test_json_stats_shadow_ops_suspicious_and_logits():
    d = _fail()
    _rec(d, 1, basis="stats", metrics=None, stats=StatsDelta(False, 0.5, "max", 2))
    d.add("r0.s0:b#0:out.0", 0.1, src={"0": "a#0:out.0"}, shadow=0.25)
    ops = OpAlignment((OpMatch("x@0", "x@1", "aligned"),), (OneSided("y@0", "cand", "a#0"),), ())
    a = d.analysis(ops=ops)
    s = Suspicious(RecordKey.parse(A), 0.5, 0.4, 12.5, 0.0, 3, "a#0:out.0", 1e-2, False)
    pos = (LogitsPosition(0, 0.5, 1, 2, 0.8, 1.0, 0.1),)
    step = LogitsStep(RecordKey.parse("r0.s1:logits#0:out.0"), pos)
    a = _with(a, diff=dict(logits=(step,), first_flip=_flip(False), flips=(_flip(False),)),
              suspicious=(s,))
    j = to_json(a)
    assert j["basis"] == "mixed"
    assert j["records"][1]["stats"] == {"identical": False, "rel_l2_lower_bound": 0.5,
                                        "bound_from": "max", "nan_inf_mismatch": 2}
    assert j["records"][1]["metrics"] is None
    assert j["records"][2]["shadow"]["rel_l2"] == 0.25
    assert j["ops"] == {"matches": [{"ref": "x@0", "cand": "x@1", "kind": "aligned"}],
                        "one_sided": [{"ident": "y@0", "only_in": "cand", "site": "a#0"}]}
    assert j["suspicious"] == [{**{k: v for k, v in j["first_divergence"].items()
                                   if k in ("key", "req", "step", "module", "call", "op",
                                            "op_index", "role", "slot")},
                                "rel_l2": 0.5, "local": 0.4, "gain": 12.5, "peers_median": 0.0,
                                "ratio": "inf", "peers": 3, "kind": "a#0:out.0",
                                "tolerance": 0.01, "within": False}]
    assert j["logits"]["steps"] == [{"key": "r0.s1:logits#0:out.0", "req": 0, "step": 1,
                                     "max_kl": 0.5, "top1_agreement": 0.0, "positions": [
                                         {"position": 0, "kl": 0.5, "top1_ref": 1,
                                          "top1_cand": 2, "agree": False, "top5_overlap": 0.8,
                                          "margin": 1.0, "noise": 0.1}]}]
    flip = {"req": 0, "step": 1, "position": 5, "ref_token": 11, "cand_token": 12,
            "margin": 2.0, "noise": 0.2, "generating": True, "near_tie": False,
            "label": "real", "source": "logits"}
    assert j["logits"]["first_flip"] == flip and j["logits"]["flips"] == [flip]
    assert to_json(_pass().analysis())["logits"]["first_flip"] is None
    assert to_json(_pass().analysis())["golden"] is None


def test_json_writes_non_finite_numbers_as_strings_everywhere():
    d = D().add(E0).add(A, shape=True, src={"0": "e#0:out.0"})
    j = to_json(d.analysis())
    assert j["records"][1]["rel_l2"] == "inf" and j["first_divergence"]["rel_l2"] == "inf"
    assert j["first_divergence"]["amplification"] == "inf"
    n = D().add(E0, float("nan")).analysis()
    assert to_json(n)["records"][0]["rel_l2"] == "nan"
    neg = to_json(_with(_pass().analysis(), amplification=-math.inf))
    assert neg["amplification"] == "-inf"
    assert json.loads(json.dumps(neg)) == neg     # plain JSON, no NaN / Infinity literals


def _metrics(**kw) -> TensorMetrics:
    base = dict(numel=8, max_abs=0.25, mean_abs=0.125, max_rel=0.75, rel_l2=0.5, cosine=0.875,
                sqnr_db=6.5, rmse=0.375, max_ulp=None, ulp_dtype=None, frac_rel_lt_1e3=0.625,
                frac_rel_lt_5e3=0.6875, nan_inf_mismatch=0, worst_index=None, worst_ref=None,
                worst_cand=None)
    return TensorMetrics(**(base | kw))


def test_csv_rows_have_every_column_in_order():
    d = _fail()
    _rec(d, 1, metrics=_metrics(max_ulp=7, ulp_dtype="float32"),
         golden=GoldenLabel("cand worse", 1.0, 2.0, 2.0))
    d.add("r0.s0:a#0/aten.mm.default@1:out.0", 0.0)
    _rec(d, 2, metrics=None, basis="stats", stats=_stats(0.0), ref_dtype="int64")
    text = to_csv(d.analysis())
    rows = list(csv.reader(io.StringIO(text)))
    assert rows[0] == list(CSV_COLUMNS) and len(rows) == 4 and text.endswith("\n")
    assert "\r" not in text
    assert rows[1] == ["r0.s0:e#0:out.0", "0", "0", "e", "", "out", "0", "module", "float32",
                       "float32", "tensor", "1", "", "0.0", "", "1.0", "0.0", "0.0", "0.0", "0.0",
                       "0.0", "", "1.0", "1.0", "0", "0.01", ""]
    assert rows[2] == ["r0.s0:a#0:out.0", "0", "0", "a", "", "out", "0", "module", "float32",
                       "float32", "tensor", "0", "introduced", "0.5", "0.0", "0.875", "0.25",
                       "0.125", "0.75", "6.5", "0.375", "7", "0.625", "0.6875", "0", "0.01",
                       "cand worse"]
    assert rows[3][:14] == ["r0.s0:a#0/aten.mm.default@1:out.0", "0", "0", "a",
                            "aten.mm.default", "out", "0", "op", "int64", "float32", "stats",
                            "1", "", "0.0"]
    assert rows[3][14] == str(d.analysis().location.records[2].input_error)
    assert rows[3][15:] == [""] * 10 + ["0.01", ""]
    inf = to_csv(D().add(E0, shape=True).analysis())
    assert list(csv.reader(io.StringIO(inf)))[1][13] == "inf"
    assert render(d.analysis(), "csv") == text


# ----------------------------------------------------------------------------- text

def test_render_dispatches_and_refuses_unknown_formats():
    a = _fail().analysis()
    assert render(a) == to_text(a) and render(a, "table") == to_text(a)
    assert render(a, "md") == to_text(a, md=True)
    text = render(a, "json")
    # one-space indent, the schema's own key order (schema first, as docs/diff-json.md lists)
    assert text.splitlines()[:3] == ['{', ' "schema": "accucheck.diff",',
                                     ' "schema_version": 1,'] and text.endswith("}\n")
    assert json.loads(text) == to_json(a)
    with pytest.raises(ValueError) as e:
        render(a, "xml")
    assert str(e.value) == "unknown format 'xml': use one of table, json, csv, md"


def test_text_header_notes_and_sections():
    d = _fail()
    d.add("r0.s0:b#0:out.0", 0.3, src={"0": "a#0:out.0"}, golden="both within noise")
    d.add("r0.s0:c#0:out.0", 0.0, src={"0": "b#0:out.0"}, golden="ref worse")
    _rec(d, 1, golden=GoldenLabel("cand worse", 1.0, 2.0, 2.0))
    a = d.analysis(golden_path="g.h5")
    missing = tuple(MissingKey(f"r0.s0:z{i}#0:out.0", "cand") for i in range(4))
    a = _with(a, diff=dict(notes=("first note", "second note"), skipped=2, missing=missing))
    lines = to_text(a).splitlines()
    assert lines[0] == verdict_line(a)
    assert lines[1] == ("ref ref.h5 | cand cand.h5 | golden g.h5 | basis tensor | 4 compared, "
                        "1 over tolerance, 4 on one side only, 2 skipped")
    assert lines[2:4] == ["NOTE: first note", "NOTE: second note"]
    assert lines[4].startswith("First difference: step 0, a (out.0)")
    assert lines[5:8] == ["", "Culprit", "CULPRIT: step 0, a#0"]
    i = lines.index("Worst records")
    assert lines[i + 1].split() == ["record", "status", "rel_l2", "input", "introduced",
                                    "cosine", "max_abs", "ulp", "tol", "golden"]
    rows = [ln.split() for ln in lines[i + 3:i + 7]]
    assert rows == [
        ["r0.s0:a#0:out.0", "introduced", "0.5", "0", "0.5", "1", "0.5", "-", "0.01",
         "cand", "worse"],
        ["r0.s0:b#0:out.0", "ok", "0.3", "0.5", "0", "1", "0.3", "-", "0.01", "both", "within",
         "noise"],
        ["r0.s0:e#0:out.0", "ok", "0", "-", "0", "1", "0", "-", "0.01", "-"],
        ["r0.s0:c#0:out.0", "ok", "0", "0.3", "0", "1", "0", "-", "0.01", "ref", "worse"]]
    assert lines[-3:] == ["Golden referee: both within noise: 1, cand worse: 1, ref worse: 1",
                          "",
                          "On one side only (4): r0.s0:z0#0:out.0, r0.s0:z1#0:out.0, "
                          "r0.s0:z2#0:out.0 ...  (full list: --format json)"]
    plain = to_text(_with(_pass().analysis(), diff=dict(missing=missing[:3]))).splitlines()
    assert plain[1] == ("ref ref.h5 | cand cand.h5 | basis tensor | 2 compared, 0 over "
                        "tolerance, 3 on one side only")
    assert plain[-1] == ("On one side only (3): r0.s0:z0#0:out.0, r0.s0:z1#0:out.0, "
                         "r0.s0:z2#0:out.0  (full list: --format json)")
    assert "Culprit" not in plain and "No culprit" not in plain and "Logits" not in plain
    assert not any(x.startswith(("Golden referee", "NOTE")) for x in plain)
    assert plain[2].startswith("First difference: step 0, a (out.0)")   # e#0 is identical
    exact = to_text(D().add(E0).analysis()).splitlines()
    assert exact[2] == "" and exact[3] == "Worst records"   # no first difference, no culprit


def test_md_marks_the_verdict_and_headings():
    d = D().add(E0, 6e-3).add(A, 2e-2, src={"0": "e#0:out.0"})
    md = to_text(d.analysis(), md=True).splitlines()
    assert md[0] == "**" + verdict_line(d.analysis()) + "**"
    assert "### No culprit" in md and "### Worst records" in md
    assert md[md.index("### Worst records") + 1].startswith("| record ")
    assert "No culprit" in to_text(d.analysis()).splitlines()


def test_text_diffuse_explains_the_largest_record():
    d = D().add(E0, 6e-3).add(A, 2e-2, src={"0": "e#0:out.0"})
    d.add("r0.s0:b#0:out.0", 7e-2, src={"0": "a#0:out.0"})
    lines = to_text(d.analysis()).splitlines()
    i = lines.index("No culprit")
    assert lines[i - 1] == "" and lines[i + 1] == (
        "The error is diffuse / inherited: every record over tolerance is explained by what "
        "feeds it (x4 rule). Largest at step 0, b (out.0): rel_l2 0.07, input 0.02. Compare "
        "with a golden (float64) capture (--golden) to see whether the candidate is worse or "
        "just different.")


def test_text_suspicious_and_precision_findings_are_capped_at_eight():
    d = _pass()
    for i in range(10):
        d.add(f"r0.s0:p{i}#0:out.0", 0.0, cand_dtype="float16")
    a = d.analysis(compute=("float32", "float32"))
    sus = tuple(Suspicious(RecordKey.parse(f"r0.s0:s{i}#0:out.0"), 5e-3, 4e-3, 20.0, 2.0, 3,
                           f"s{i}", 1e-2, True) for i in range(9))
    lines = to_text(_with(a, suspicious=sus)).splitlines()
    i = lines.index("Suspicious (noise floor)")
    assert lines[i + 1] == ("SUSPICIOUS: r0.s0:s0#0:out.0: rel_l2 0.005 (tolerance 0.01), local "
                            "0.004: it amplifies what feeds it x20, its 3 peers (s0) x2 (median)")
    assert sum(x.startswith("SUSPICIOUS: ") for x in lines) == 8
    j = lines.index("Precision findings")
    assert lines[j + 1] == ("PRECISION: r0.s0:p0#0:out.0: candidate float16, reference float32 "
                            "(both runs float32)")
    assert sum(x.startswith("PRECISION: ") for x in lines) == 8
    assert lines[j + 9] == "... 2 more (--format json)"
    few = to_text(_with(a, diff=dict(records=a.diff.records[:10]),
                        records=a.location.records[:10])).splitlines()
    assert sum(x.startswith("PRECISION: ") for x in few) == 8 and not any(
        x.startswith("... ") for x in few)
    nine = to_text(_with(a, diff=dict(records=a.diff.records[:11]),
                         records=a.location.records[:11])).splitlines()
    assert nine[nine.index("Precision findings") + 9] == "... 1 more (--format json)"
    assert "Suspicious (noise floor)" not in to_text(a)


def test_worst_rows_introduced_first_then_by_error_over_tolerance_twelve_at_most():
    d = D().add(E0)
    prev = "e#0:out.0"
    for i in range(8):   # each introduces more than 4x what feeds it: 1e-3 x 5^i
        d.add(f"r0.s0:i{i}#0:out.0", 1e-3 * 5 ** i, src={"0": prev})
        prev = f"i{i}#0:out.0"
    for i in range(8):   # inherited (fed by i7), error / tolerance = i / 10
        d.add(f"r0.s0:w{i}#0:out.0", i * 1e-3, tol=1e-2, src={"0": prev})
    d.add("r0.s0:w0#0:in.0", 0.5)
    a = d.analysis()
    lines = to_text(a).splitlines()
    i = lines.index("Worst records")
    shown = [ln.split()[0] for ln in lines[i + 3:] if ln.startswith("r0.")]
    # top: the introduced records largest first (6 of them), then the rest by error / tol
    assert shown[:6] == [f"r0.s0:i{k}#0:out.0" for k in (7, 6, 5, 4, 3, 2)]
    assert shown[6:] == ["r0.s0:w7#0:out.0", "r0.s0:w6#0:out.0", "r0.s0:w5#0:out.0",
                         "r0.s0:w4#0:out.0", "r0.s0:w3#0:out.0", "r0.s0:w2#0:out.0"]
    assert len(shown) == 12


def test_worst_rows_fill_up_when_few_are_introduced_and_skip_inputs():
    d = _fail()
    d.add("r0.s0:b#0:in.0", 0.9).add("r0.s0:b#0:out.0", 0.1, src={"0": "a#0:out.0"})
    _rec(d, 3, metrics=_metrics(rel_l2=0.1, cosine=0.99995, max_abs=3.0, max_ulp=12))
    lines = to_text(d.analysis()).splitlines()
    i = lines.index("Worst records")
    rows = [ln.split() for ln in lines[i + 3:] if ln.startswith("r0.")]
    assert rows == [["r0.s0:a#0:out.0", "introduced", "0.5", "0", "0.5", "1", "0.5", "-",
                     "0.01"],
                    ["r0.s0:b#0:out.0", "inherited", "0.1", "0.9", "0", "1-5.0e-05", "3", "12",
                     "0.01"],
                    ["r0.s0:e#0:out.0", "ok", "0", "-", "0", "1", "0", "-", "0.01"]]
    s = D().add(E0).add(A, 0.5, src={"0": "e#0:out.0"})
    _rec(s, 1, basis="stats", metrics=None, stats=_stats(0.5))
    _rec(s, 0, basis="sample", stats=_stats(0.0))
    rows = [ln.split() for ln in to_text(s.analysis()).splitlines() if ln.startswith("r0.")]
    assert rows == [["r0.s0:a#0:out.0", "introduced", "0.5", "(>=)", "0", "0.5", "-", "-", "-",
                     "0.01"],
                    ["r0.s0:e#0:out.0", "ok", "0", "(~)", "-", "0", "1", "0", "-", "0.01"]]


def _curve(points) -> object:
    return dataclasses.replace(_pass().locate(), curve=tuple(
        LayerPoint(req, step, layer, RecordKey.parse(f"r{req}.s{step}:model.layers.{layer}#0:"
                                                     f"out.0"), err, cos, within)
        for req, step, layer, err, cos, within in points))


def test_curve_table_max_over_requests_marks_and_missing_cells():
    L = _curve([(0, 0, 0, 1e-3, 1.0, True), (1, 0, 0, 2e-2, 0.5, False),
                (0, 0, 1, 3e-3, 0.99995, True), (1, 0, 1, 1e-3, 0.9, True),
                (0, 1, 1, 4e-3, None, True)])
    rows = [ln.split() for ln in _curve_table(L, "simple").splitlines()]
    assert rows[0] == ["layer", "step", "0", "step", "1"]
    assert rows[2:] == [["0", "0.02", "/", "0.5", "*", "-"],
                        ["1", "0.003", "/", "1-5.0e-05", "0.004", "/", "-"]]
    assert _curve_table(_curve([]), "simple") == ""


def test_curve_table_thins_steps_and_layers():
    pts = [(0, s, ly, 1e-3 * (ly + 1), 1.0, True) for s in range(6) for ly in range(30)]
    text = _curve_table(_curve(pts), "simple")
    lines = text.splitlines()
    assert lines[0].split() == ["layer", "step", "0", "step", "1", "step", "2", "step", "5"]
    assert lines[-1] == "(steps 3..4 not shown here: --format json has every step)"
    layers = [ln.split()[0] for ln in lines[2:-1]]
    assert layers == [str(x) for x in range(0, 30, 2)] + ["29"]   # ceil(30 / 24) = 2
    five = _curve_table(_curve([(0, s, 0, 1e-3, 1.0, True) for s in range(5)]), "simple")
    assert five.splitlines()[-1] == "(step 3 not shown here: --format json has every step)"
    four = _curve_table(_curve([(0, s, 0, 1e-3, 1.0, True) for s in range(4)]), "simple")
    assert "not shown" not in four and four.splitlines()[0].split()[-1] == "3"
    ly = _curve_table(_curve([(0, 0, x, 1e-3, 1.0, True) for x in range(25)]), "simple")
    assert [ln.split()[0] for ln in ly.splitlines()[2:]] == [str(x) for x in range(0, 25, 2)]
    ly24 = _curve_table(_curve([(0, 0, x, 1e-3, 1.0, True) for x in range(24)]), "simple")
    assert [ln.split()[0] for ln in ly24.splitlines()[2:]] == [str(x) for x in range(24)]


def test_text_has_the_curve_and_logits_sections_only_with_data():
    a = _pass().analysis()
    text = to_text(_with(a, curve=_curve([(0, 0, 0, 1e-3, 1.0, True)]).curve))
    assert "Per-layer error (layer outputs: rel_l2 / cosine, max over requests)" in text
    assert "Per-layer error" not in to_text(a)
    lg = to_text(_with(a, diff=dict(first_flip=_flip(True)))).splitlines()
    i = lg.index("Logits")
    assert lg[i + 1] == ("first token flip: request 0 step 1 position 5 (generated): ref 11 vs "
                         "cand 12, reference margin 0.1 vs logit noise 0.2 (a near-tie up to x8): a near-tie")
    assert "Logits" not in to_text(a).splitlines()
    step = LogitsStep(RecordKey.parse("r0.s0:logits#0:out.0"),
                      (LogitsPosition(0, 0.5, 1, 1, 0.5, 1.0, 0.1),))
    agree = to_text(_with(a, diff=dict(logits=(step,)))).splitlines()   # logits, no flip
    assert agree[agree.index("Logits") + 1].split()[:2] == ["step", "positions"]
    assert agree[-1] == "first token flip: none"


def test_logits_table_per_step_first_eight_steps():
    def step(req, st, kls, agree):
        return LogitsStep(RecordKey.parse(f"r{req}.s{st}:logits#0:out.0"), tuple(
            LogitsPosition(i, kl, 1, 1 if ok else 2, 0.8 - 0.2 * i, 1.0, 0.1)
            for i, (kl, ok) in enumerate(zip(kls, agree))))
    logits = (step(0, 0, [0.5, 2.0], [True, False]), step(1, 0, [7e-4], [True]),
              step(0, 1, [0.0], [True]), step(0, 2, [], []))
    d = dataclasses.replace(_pass().diff(), logits=logits)
    lines = _logits_table(d, "simple").splitlines()
    assert lines[0].split() == ["step", "positions", "max", "KL", "top-1", "agree", "min",
                                "top-5", "overlap"]
    assert [ln.split() for ln in lines[2:5]] == [["0", "3", "2", "2/3", "0.6"],
                                                 ["1", "1", "0", "1/1", "0.8"],
                                                 ["2", "0", "0", "0/0", "1"]]
    assert lines[5] == "first token flip: none"
    many = dataclasses.replace(d, logits=tuple(step(0, s, [0.1], [True]) for s in range(10)),
                               first_flip=_flip(False, generating=False))
    lines = _logits_table(many, "simple").splitlines()
    assert [ln.split()[0] for ln in lines[2:-1]] == [str(s) for s in range(8)]
    assert lines[-1] == ("first token flip: request 0 step 1 position 5: ref 11 vs cand 12, "
                         "reference margin 2 vs logit noise 0.2 (a near-tie up to x8): a real flip")
    only = dataclasses.replace(d, logits=(), first_flip=_flip(None))
    assert _logits_table(only, "simple") == (
        "first token flip: request 0 step 1 position 5 (generated): ref 11 vs cand 12, no "
        "logits stored to tell a near-tie from a real flip (capture with --store full)")


def test_tables_keep_the_report_number_format():
    """The cells are written as accucheck.numbers formats them (tabulate must not re-parse "7.00e-04")."""
    lines = to_text(D().add(E0, 7e-4).analysis()).splitlines()
    assert [ln.split() for ln in lines if ln.startswith("r0.")] == [
        ["r0.s0:e#0:out.0", "ok", "7.00e-04", "-", "7.00e-04", "1", "7.00e-04", "-", "0.01"]]
    d = dataclasses.replace(_pass().diff(), logits=(LogitsStep(
        RecordKey.parse("r0.s0:logits#0:out.0"), (LogitsPosition(0, 7e-4, 1, 1, 0.5, 1.0, 0.1),)),))
    assert _logits_table(d, "simple").splitlines()[2].split() == ["0", "1", "7.00e-04", "1/1",
                                                                  "0.5"]


def test_rest_rows_rank_by_error_over_their_own_tolerance():
    """s#0 introduces the error; x, y, z, q inherit it with their own tolerances: ranked by
    error / tolerance (z 2, x 0.8, y 0.06, q 0 with a zero tolerance), not by error."""
    d = D().add("r0.s0:s#0:out.0", 1.0)
    for name, err, tol in (("x", 4e-3, 5e-3), ("y", 6e-3, 0.1), ("z", 2e-3, 1e-3), ("q", 0.0, 0.0)):
        d.add(f"r0.s0:{name}#0:out.0", err, tol=tol, src={"0": "s#0:out.0"})
    lines = to_text(d.analysis()).splitlines()
    assert [ln.split()[0] for ln in lines if ln.startswith("r0.")] == [
        "r0.s0:s#0:out.0", "r0.s0:z#0:out.0", "r0.s0:x#0:out.0", "r0.s0:y#0:out.0",
        "r0.s0:q#0:out.0"]
