"""Sign-off rules on constructed numbers (fast, no captures): the regression noise floor and
margin (docs/signoff-json.md "Regression against the last release"), `fail_on_regression`,
and the documented order of the checks."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from accucheck.verdict.locate import analyze
from accucheck.signoff.scenario import Thresholds, load_scenario
from accucheck.signoff.run import Regression, RegressionItem, compare_previous, headline, judge
from test_diff import base, write

ROOT = Path(__file__).resolve().parents[1]
ORDER = ["records", "layer_rel_l2", "layer_cosine", "logits_kl", "top1_agreement",
         "token_agreement", "real_flips", "near_tie_flips", "regression"]
F32 = {"dtype": "float32"}


@pytest.fixture(scope="module")
def scn():
    return load_scenario(ROOT / "scenarios" / "tiny-identical.toml")


@pytest.fixture(scope="module")
def analysis(tmp_path_factory):
    d = tmp_path_factory.mktemp("rules")
    t = base()
    return analyze(write(d / "a.h5", t), write(d / "b.h5", t))


@pytest.fixture(scope="module")
def metrics(analysis):
    return headline(analysis, (2, 2))


def _previous(tmp_path, scn, **values) -> Path:
    p = tmp_path / "report.json"
    p.write_text(json.dumps({"schema": "accucheck.signoff", "scenario": {"name": scn.name},
                             "metrics": values}))
    return p


def _changes(scn, thr, metrics, tmp_path, prev: dict, cur: dict, meta=F32) -> dict:
    s = replace(scn, thresholds=thr)
    reg = compare_previous(s, replace(metrics, **cur), "unused.h5", _previous(tmp_path, s, **prev),
                           meta, meta)
    return {i.metric: i.change for i in reg.items if i.metric in cur}, reg


@pytest.mark.parametrize("prev,cur,change", [
    (1e-6, 4e-6, "same"),       # 4x, but both below the floor (a tenth of 5e-5 = 5e-6)
    (1e-6, 6e-6, "worse"),      # above the floor: 6x is worse
    (6e-6, 1e-6, "better"),
    (1e-5, 1.3e-5, "same"),     # +30 % of the previous is 23 % of the larger: within 25 %
    (1e-5, 1.4e-5, "worse"),    # 29 % of the larger
    (1e-5, 0.7e-5, "better"),
])
def test_layer_rel_l2_floor_is_a_tenth_of_the_runs_tolerance(scn, metrics, tmp_path, prev, cur,
                                                             change):
    got, _ = _changes(scn, Thresholds(), metrics, tmp_path, {"max_layer_rel_l2": prev},
                      {"max_layer_rel_l2": cur})
    assert got == {"max_layer_rel_l2": change}


def test_the_floor_follows_the_runs_dtype_and_the_scenario_tolerance(scn, metrics, tmp_path):
    prev, cur = {"max_layer_rel_l2": 1e-3}, {"max_layer_rel_l2": 4e-3}
    # bfloat16 runs: floor 5e-3, both below it
    got, _ = _changes(scn, Thresholds(), metrics, tmp_path, prev, cur, {"dtype": "bfloat16"})
    assert got == {"max_layer_rel_l2": "same"}
    got, _ = _changes(scn, Thresholds(), metrics, tmp_path, prev, cur, {"dtype": "float32"})
    assert got == {"max_layer_rel_l2": "worse"}
    # a scenario rel_l2 (every record's tolerance) sets the floor; a layer threshold too
    got, _ = _changes(scn, Thresholds(rel_l2=5e-2), metrics, tmp_path, prev, cur)
    assert got == {"max_layer_rel_l2": "same"}
    got, _ = _changes(scn, Thresholds(layer_rel_l2=5e-2), metrics, tmp_path, prev, cur)
    assert got == {"max_layer_rel_l2": "same"}


def test_margin_and_floor_boundaries_are_inclusive(scn, metrics, tmp_path):
    thr = Thresholds(rel_l2=1.0)   # floor 0.1 exactly; margin 25 %
    got, _ = _changes(scn, thr, metrics, tmp_path, {"max_layer_rel_l2": 0.375},
                      {"max_layer_rel_l2": 0.5})   # moved by exactly 25 % of the larger
    assert got == {"max_layer_rel_l2": "same"}
    got, _ = _changes(scn, thr, metrics, tmp_path, {"max_layer_rel_l2": 0.01},
                      {"max_layer_rel_l2": 0.1})   # larger one exactly at the floor
    assert got == {"max_layer_rel_l2": "same"}
    got, _ = _changes(scn, replace(thr, regression_margin=0.5), metrics, tmp_path,
                      {"max_layer_rel_l2": 0.3}, {"max_layer_rel_l2": 0.55})
    assert got == {"max_layer_rel_l2": "same"}     # the scenario's margin, not a constant
    got, _ = _changes(scn, replace(thr, regression_margin=0.1), metrics, tmp_path,
                      {"max_layer_rel_l2": 0.44}, {"max_layer_rel_l2": 0.5})
    assert got == {"max_layer_rel_l2": "worse"}


def test_kl_floor_is_squared_and_cosine_compares_distance_from_one(scn, metrics, tmp_path):
    thr = Thresholds(rel_l2=1.0)   # KL floor (0.1)^2 = 0.01; cosine floor 0.01 / 2 = 0.005
    got, _ = _changes(scn, thr, metrics, tmp_path,
                      {"max_logits_kl": 0.001, "min_layer_cosine": 0.999},
                      {"max_logits_kl": 0.009, "min_layer_cosine": 0.996})
    assert got == {"max_logits_kl": "same", "min_layer_cosine": "same"}
    got, _ = _changes(scn, thr, metrics, tmp_path,
                      {"max_logits_kl": 0.001, "min_layer_cosine": 0.999},
                      {"max_logits_kl": 0.02, "min_layer_cosine": 0.99})
    assert got == {"max_logits_kl": "worse", "min_layer_cosine": "worse"}
    got, _ = _changes(scn, thr, metrics, tmp_path,
                      {"max_logits_kl": 0.02, "min_layer_cosine": 0.99},
                      {"max_logits_kl": 0.001, "min_layer_cosine": 0.999})
    assert got == {"max_logits_kl": "better", "min_layer_cosine": "better"}


def test_counts_and_agreements_compare_exactly(scn, metrics, tmp_path):
    got, reg = _changes(scn, Thresholds(), metrics, tmp_path,
                        {"records_over_tolerance": 0, "top1_agreement": 1.0,
                         "token_agreement": 0.5, "real_flips": 1, "near_tie_flips": 0},
                        {"records_over_tolerance": 1, "top1_agreement": 0.999,
                         "token_agreement": 0.75, "real_flips": 0, "near_tie_flips": 0})
    assert got == {"records_over_tolerance": "worse", "top1_agreement": "worse",
                   "token_agreement": "better", "real_flips": "better", "near_tie_flips": "same"}
    assert reg.verdict == "worse" and reg.sentence == "worse than last release"
    # a metric the previous report does not have is n/a, never same
    items = {i.metric: i for i in reg.items}
    assert items["max_layer_rel_l2"].change == "n/a" and items["max_layer_rel_l2"].previous is None


def test_verdict_worse_beats_better_beats_same(scn, metrics, tmp_path):
    m = metrics.as_dict()
    same = {k: m[k] for k in ("records_over_tolerance", "real_flips", "near_tie_flips")}
    _, reg = _changes(scn, Thresholds(), metrics, tmp_path, same, {})
    assert reg.verdict == "same"
    _, reg = _changes(scn, Thresholds(), metrics, tmp_path, dict(same, real_flips=3), {})
    assert reg.verdict == "better" and reg.sentence == "better than last release"
    _, reg = _changes(scn, Thresholds(), metrics, tmp_path,
                      dict(same, real_flips=3, near_tie_flips=-1), {})
    assert reg.verdict == "worse"


def test_previous_as_a_capture_is_diffed_against_this_reference(scn, metrics, tmp_path):
    t = base()
    bad = dict(t)
    bad["r0.s0:model.layers.1#0:out.0"] = t["r0.s0:model.layers.1#0:out.0"] * 1.1
    ref = write(tmp_path / "ref.h5", t)
    prev = write(tmp_path / "prev.h5", bad)
    reg = compare_previous(scn, metrics, ref, prev, F32, F32)
    ch = {i.metric: i.change for i in reg.items}
    assert ch["max_layer_rel_l2"] == "better" and ch["records_over_tolerance"] == "better"
    assert reg.verdict == "better" and reg.previous == str(prev)


def _reg(verdict: str) -> Regression:
    change = {"worse": "worse", "better": "better", "same": "same"}[verdict]
    return Regression("prev.json", verdict, (RegressionItem("max_layer_rel_l2", 1e-6, 1e-5,
                                                            change),))


def test_checks_in_the_documented_order_and_fail_on_regression(scn, analysis, metrics):
    thr = Thresholds(layer_rel_l2=1e-6, layer_cosine=0.999999, logits_kl=1e-9,
                     top1_agreement=1.0, token_agreement=1.0)
    m = replace(metrics, max_layer_rel_l2=0.0, min_layer_cosine=1.0, max_logits_kl=0.0,
                top1_agreement=1.0, token_agreement=1.0)
    s = replace(scn, thresholds=thr)
    checks = judge(s, analysis, m, _reg("worse"))
    assert [c.name for c in checks] == ORDER
    assert [c.name for c in checks if not c.passed] == ["regression"]
    reg_check = checks[-1]
    assert (reg_check.value, reg_check.limit, reg_check.op) == (1, 0, "<=")
    assert reg_check.detail == "worse than last release (max_layer_rel_l2)"
    # not worse: the check is there and passes
    checks = judge(s, analysis, m, _reg("better"))
    assert checks[-1].name == "regression" and checks[-1].passed
    # fail_on_regression = false: reported (in the Regression), not a check
    s2 = replace(scn, thresholds=replace(thr, fail_on_regression=False))
    checks = judge(s2, analysis, m, _reg("worse"))
    assert [c.name for c in checks] == ORDER[:-1] and all(c.passed for c in checks)
    # no previous release: no regression check either
    assert [c.name for c in judge(s, analysis, m, None)] == ORDER[:-1]
    # thresholds not set are not checks (only records and the flip counts always are)
    assert [c.name for c in judge(replace(scn, thresholds=Thresholds()), analysis, m, None)] == \
        ["records", "real_flips", "near_tie_flips"]


def test_threshold_checks_hold_at_the_limit_and_fail_past_it(scn, analysis, metrics):
    thr = Thresholds(layer_rel_l2=1e-3, layer_cosine=0.99, logits_kl=1e-2, top1_agreement=0.9,
                     token_agreement=0.5, real_flips=1, near_tie_flips=2)
    s = replace(scn, thresholds=thr)
    at = replace(metrics, max_layer_rel_l2=1e-3, min_layer_cosine=0.99, max_logits_kl=1e-2,
                 top1_agreement=0.9, token_agreement=0.5, real_flips=1, near_tie_flips=2)
    assert all(c.passed for c in judge(s, analysis, at, None))
    past = replace(at, max_layer_rel_l2=1.1e-3, min_layer_cosine=0.989, max_logits_kl=1.1e-2,
                   top1_agreement=0.89, token_agreement=0.49, real_flips=2, near_tie_flips=3)
    assert [c.name for c in judge(s, analysis, past, None) if not c.passed] == ORDER[1:-1]
    none = replace(at, max_layer_rel_l2=None, min_layer_cosine=None, max_logits_kl=None,
                   top1_agreement=None, token_agreement=None)
    failed = [c for c in judge(s, analysis, none, None) if not c.passed]
    assert [c.name for c in failed] == ORDER[1:6]  # nothing to measure is not a pass
