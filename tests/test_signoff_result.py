"""report.signoff_result probed where a plausible wrong rule gives another answer (issue 16:
tests that can fail): pass / fail from the checks, the failed checks, planted faults, the
verdict sentence (PASS and each FAIL form, exact text).
Results are built record by record (test_verdict_mutants.D, no files, no model): milliseconds."""
from __future__ import annotations

import dataclasses

import pytest

from accucheck.report.signoff_result import (Check, EnvRow, Metrics, Regression,
                                             RegressionItem, SignoffResult)
from accucheck.signoff.scenario import RunSpec, Scenario
from test_verdict_mutants import D

SCN = Scenario(None, "tiny-x", "", "@tiny", ("hi",), 2, RunSpec("reference"),
               RunSpec("candidate", dtype="bfloat16"))
WHAT = "tiny-x: cpu bfloat16 eager (hf) vs cpu float32 eager (hf)"


def _metrics(**kw) -> Metrics:
    d = dict(records_compared=12, records_over_tolerance=0, missing_keys=0, basis="tensor",
             max_layer_rel_l2=None, min_layer_cosine=None, max_logits_kl=None,
             top1_agreement=None, logits_positions=0, token_agreement=None, tokens_compared=0,
             near_tie_flips=0, real_flips=0)
    return Metrics(**(d | kw))


def _check(name: str, passed: bool, detail: str = "") -> Check:
    return Check(name, passed, 1.0, 2.0, "<=", detail or f"{name} detail")


def _result(checks=(), *, analysis=None, metrics=None, regression=None, ref_meta=None,
            cand_meta=None) -> SignoffResult:
    if analysis is None:   # (an Analysis is falsy when over tolerance: no `or` here)
        analysis = D().add("r0.s0:e#0:out.0").analysis()
    return SignoffResult(SCN, analysis, "ref.h5",
                         "cand.h5", None, ref_meta or {}, cand_meta or {},
                         metrics or _metrics(), tuple(checks), (), regression, 1.5)


def _divergent():
    """a#0 introduces rel_l2 0.5 (tolerance 1e-2), the golden says the candidate is worse."""
    return D().add("r0.s0:e#0:out.0").add("r0.s0:a#0:out.0", 0.5, src={"0": "e#0:out.0"},
                                           golden="cand worse").analysis()


def _diffuse():
    """e#0 (6e-3, within) feeds a#0 (2e-2, over but less than 4x: inherited)."""
    return D().add("r0.s0:e#0:out.0", 6e-3).add("r0.s0:a#0:out.0", 2e-2,
                                                src={"0": "e#0:out.0"}).analysis()


def test_every_check_must_pass():
    ok, bad = _check("a", True), _check("b", False)
    for checks, passed in (((), True), ((ok,), True), ((ok, ok), True), ((ok, bad, ok), False),
                           ((bad,), False)):
        r = _result(checks)
        assert (r.passed, bool(r), r.verdict, r.exit_code) == (
            (True, True, "pass", 0) if passed else (False, False, "fail", 1)), checks
    r = _result((bad, ok, _check("c", False)))
    assert [c.name for c in r.failed_checks] == ["b", "c"]
    assert _result((ok, ok)).failed_checks == ()


def test_planted_faults_name_the_role_and_skip_runs_without_one():
    assert _result(ref_meta={"seed": 0}, cand_meta={"planted_fault": "bf16 @ m.a"}
                   ).planted_faults == ["candidate: bf16 @ m.a"]
    assert _result(ref_meta={"planted_fault": "nan @ m.b"},
                   cand_meta={"planted_fault": ""}).planted_faults == ["reference: nan @ m.b"]
    assert _result(ref_meta={"planted_fault": "x @ p"}, cand_meta={"planted_fault": "y @ q"}
                   ).planted_faults == ["reference: x @ p", "candidate: y @ q"]
    assert _result().planted_faults == []


def test_culprit_is_the_diffs_culprit_or_none():
    assert _result(analysis=_divergent()).culprit == "a#0"
    assert _result().culprit is None
    assert _result(analysis=_diffuse()).culprit is None


def test_pass_sentence_lists_only_what_was_measured():
    assert _result().summary == f"PASS: {WHAT}: 12 records within tolerance."
    full = _result(metrics=_metrics(max_layer_rel_l2=1.2345e-5, token_agreement=0.98765,
                                    near_tie_flips=2),
                   regression=Regression("prev.json", "better", ()))
    assert full.summary == (f"PASS: {WHAT}: 12 records within tolerance, max layer rel_l2 "
                            f"1.23e-05, token agreement 98.8%, 2 near-tie token flip(s) allowed,"
                            f" better than last release.")
    zero = _result(metrics=_metrics(max_layer_rel_l2=0.0, token_agreement=0.0))
    assert zero.summary == (f"PASS: {WHAT}: 12 records within tolerance, max layer rel_l2 0, "
                            f"token agreement 0.0%.")


def test_fail_sentence_names_the_divergence_and_other_failed_checks_not_records():
    checks = (_check("tokens", False, "token agreement 50% < 99%"), _check("records", False),
              _check("kl", True), _check("flips", False, "2 real token flips (allowed 0)"))
    r = _result(checks, analysis=_divergent())
    assert r.summary == (f"FAIL: {WHAT}: divergence starts at step 0, a#0 (introduced, rel_l2 "
                         f"0.5 > tolerance 0.01, golden: cand worse); token agreement 50% < 99%;"
                         f" 2 real token flips (allowed 0).")
    plain = D().add("r0.s0:e#0:out.0").add("r0.s0:a#0:out.0", 0.5, src={"0": "e#0:out.0"})
    r = _result((_check("records", False),), analysis=plain.analysis())
    assert r.summary == (f"FAIL: {WHAT}: divergence starts at step 0, a#0 (introduced, rel_l2 "
                         f"0.5 > tolerance 0.01).")


def test_fail_sentence_when_diffuse_names_where_it_shows_first():
    r = _result((_check("records", False), _check("kl", False, "max KL 1 > 0.1")),
                analysis=_diffuse())
    assert r.summary == (f"FAIL: {WHAT}: error over tolerance but introduced by no record "
                         f"(diffuse / inherited), first at step 0 a; no culprit named; "
                         f"max KL 1 > 0.1.")


def test_fail_sentence_without_a_divergence_keeps_the_records_check():
    r = _result((_check("records", False, "3 records over tolerance"),
                 _check("tokens", False, "token agreement 50% < 99%")))
    assert r.summary == (f"FAIL: {WHAT}: 3 records over tolerance; token agreement 50% < 99%.")


def test_small_records():
    m = _metrics(max_logits_kl=0.5, real_flips=1)
    assert m.as_dict() == {
        "records_compared": 12, "records_over_tolerance": 0, "missing_keys": 0,
        "basis": "tensor", "max_layer_rel_l2": None, "min_layer_cosine": None,
        "max_logits_kl": 0.5, "top1_agreement": None, "logits_positions": 0,
        "token_agreement": None, "tokens_compared": 0, "near_tie_flips": 0, "real_flips": 1,
        "routing_agreement": None, "routing_flips": 0, "real_routing_flips": 0}
    assert [EnvRow("torch", "2.1", "2.1").differs, EnvRow("device", "cpu", "npu").differs] == \
        [False, True]
    assert [Regression("p", v, ()).sentence for v in ("same", "better", "worse")] == \
        ["same as last release", "better than last release", "worse than last release"]
    rec = [_check("a", True), m, EnvRow("f", "a", "b"), RegressionItem("kl", 1.0, 2.0, "worse"),
           Regression("p", "same", ()), _result()]
    for x in rec:
        name = dataclasses.fields(x)[0].name
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(x, name, None)


def test_a_diffuse_fail_with_a_suspicious_record_upstream_says_so():
    """Layer 5's down_proj amplifies x20 within tolerance (SUSPICIOUS); layer 6 carries the
    error over tolerance, inherited: the sign-off's verdict sentence names the lead."""
    d = D().add("r0.s0:model.embed_tokens#0:out.0", 1e-3, tol=0.05)
    for i in range(8):
        prev = f"model.layers.{i - 1}#0:out.0" if i else "model.embed_tokens#0:out.0"
        e_in, e_out = (2e-2, 6e-2) if i == 6 else (1e-3, 2e-2 if i == 5 else 1e-3)
        d.add(f"r0.s0:model.layers.{i}.mlp.down_proj#0:in.0", e_in, tol=0.05)
        d.add(f"r0.s0:model.layers.{i}.mlp.down_proj#0:out.0", e_out, tol=0.05)
        d.add(f"r0.s0:model.layers.{i}#0:out.0", 6e-2 if i == 6 else 1e-3, tol=0.05,
              src={"0": prev})
    a = d.analysis()
    assert a.location.diffuse and a.location.suspicious
    r = _result((_check("records", False),), analysis=a)
    assert "diffuse / inherited" in r.summary
    assert "SUSPICIOUS upstream: model.layers.5.mlp.down_proj (r0.s0:model.layers.5.mlp." \
           "down_proj#0:out.0" in r.summary, r.summary


def test_a_pass_with_near_tie_routing_flips_says_so():
    r = _result((_check("routing_agreement", True),),
                metrics=_metrics(routing_agreement=0.995, routing_flips=2))
    assert r.passed and "MoE routing agreement 99.50% (2 near-tie routing flip(s);" in r.summary
    assert "MoE" not in _result().summary
