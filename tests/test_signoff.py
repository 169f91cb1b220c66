"""Sign-off on the tiny model: identical runs pass, a planted fault fails with the culprit named,
a near-tie token flip is flagged as a near-tie (not a failure) when the thresholds allow it,
regression against the last release, report files, CLI exit codes.

The scenarios run real captures (a few seconds each, more on a loaded machine): those tests are
marked slow and run in CI (`pytest -m ''`)."""
from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from accucheck.cli import main
from accucheck.errors import EXIT_BAD_INPUT, UserError
from accucheck.signoff.scenario import load_scenario
from accucheck.signoff.run import evaluate, signoff

ROOT = Path(__file__).resolve().parents[1]
SCN = ROOT / "scenarios"
CULPRIT = "model.layers.2.post_attention_layernorm"
TOP_KEYS = ["schema", "schema_version", "verdict", "exit_code", "summary", "scenario", "runs",
            "thresholds", "checks", "failed_checks", "metrics", "culprit", "impact",
            "first_divergence",
            "layers", "control", "suspicious", "routing", "tokens", "regression", "matrix",
            "environment", "planted_faults", "notes", "files",
            "seconds"]


def _run(tmp_path_factory, name: str):
    out = tmp_path_factory.mktemp(name) / "report"
    msgs: list[str] = []
    res = signoff(SCN / f"{name}.toml", out_dir=out, progress=msgs.append)
    return res, out, msgs


@pytest.fixture(scope="module")
def identical(tmp_path_factory):
    return _run(tmp_path_factory, "tiny-identical")


@pytest.fixture(scope="module")
def fault(tmp_path_factory):
    return _run(tmp_path_factory, "tiny-planted-fault")


@pytest.fixture(scope="module")
def near_tie(tmp_path_factory):
    return _run(tmp_path_factory, "tiny-near-tie")


def _json(out: Path) -> dict:
    return json.loads((out / "report.json").read_text())


@pytest.mark.slow
def test_identical_runs_pass(identical):
    res, out, msgs = identical
    assert res and res.passed and res.exit_code == 0 and res.verdict == "pass"
    assert res.summary.startswith("PASS: tiny-identical")
    assert res.culprit is None and res.metrics.max_layer_rel_l2 == 0.0
    assert res.metrics.token_agreement == 1.0 and res.metrics.max_logits_kl == 0.0
    # the documented order (docs/signoff-json.md), not just the set
    assert [c.name for c in res.checks] == ["records", "layer_rel_l2", "layer_cosine",
                                            "logits_kl", "top1_agreement", "token_agreement",
                                            "real_flips", "near_tie_flips"]
    doc = _json(out)
    assert list(doc) == TOP_KEYS
    assert doc["schema"] == "accucheck.signoff" and doc["schema_version"] == 1
    assert doc["verdict"] == "pass" and doc["exit_code"] == 0 and doc["failed_checks"] == []
    assert doc["runs"]["reference"]["capture"] == "captures/reference.h5"
    # no [golden] table: the default float64 CPU referee was captured and judged
    assert doc["runs"]["golden"]["label"] == "cpu float64 eager (hf)"
    assert doc["first_divergence"] is None
    for name in ("report.md", "report.html", "diff.json", "diff.html", "captures/candidate.h5",
                 *doc["files"]["plots"]):
        assert (out / name).is_file(), name
    assert json.loads((out / "diff.json").read_text())["schema"] == "accucheck.diff"
    md = (out / "report.md").read_text()
    assert md.splitlines()[2].startswith("**PASS: tiny-identical")
    assert "No record is over tolerance" in md
    # progress went through the callback (the CLI sends it to stderr)
    assert any("capturing the reference" in m for m in msgs)
    assert any("capturing the candidate" in m and "teacher-forced" in m for m in msgs)


@pytest.mark.slow
def test_planted_fault_fails_with_culprit_named(fault):
    res, out, _ = fault
    assert not res.passed and res.exit_code == 1 and res.culprit == f"{CULPRIT}#0"
    assert res.summary.startswith("FAIL: tiny-planted-fault")
    assert CULPRIT in res.summary and "introduced" in res.summary
    assert "golden: cand worse" in res.summary
    failed = {c.name for c in res.failed_checks}
    assert {"records", "layer_rel_l2", "logits_kl"} <= failed
    assert "token_agreement" not in failed  # the fault is small: tokens still agree
    doc = _json(out)
    assert doc["verdict"] == "fail" and doc["exit_code"] == 1 and doc["culprit"] == f"{CULPRIT}#0"
    fd = doc["first_divergence"]
    assert fd["module"] == CULPRIT and fd["step"] == 0 and fd["cause"] == "introduced"
    assert fd["golden"] == "cand worse"
    assert doc["planted_faults"] == [f"candidate: bf16 @ {CULPRIT}"]
    assert doc["runs"]["golden"]["capture"] == "captures/golden.h5"
    md = (out / "report.md").read_text()
    assert f"CULPRIT: step 0, {CULPRIT}#0" in md and "Golden referee: cand worse" in md
    assert "WARNING: planted fault" in md
    # layers before the fault are exact, the faulty layer and after are not
    layers = {p["layer"]: p for p in doc["layers"] if p["step"] == 0 and p["req"] == 0}
    assert layers[1]["rel_l2"] == 0 and layers[2]["rel_l2"] > 1e-4
    # [impact]: the culprit's own site (bisected inside its block) recovers the whole gap
    imp = doc["impact"]
    assert imp["site"]["site"] == CULPRIT and imp["site"]["recovered"]["logprob"] > 0.99
    assert imp["line"].startswith(f"impact: {CULPRIT} recovers 100.0% of the logit gap")
    assert imp["line"] in md and doc["files"]["impact"] == "impact.json"
    assert json.loads((out / "impact.json").read_text())["format"] == "accucheck-impact"
    assert imp["line"] in (out / "diff.html").read_text()
    # the environment table shows the difference that matters
    env = {e["field"]: e for e in doc["environment"]}
    assert env["planted fault"]["differs"] and not env["torch"]["differs"]
    assert {"device", "driver", "CANN", "torch", "torch_npu", "vllm", "vllm-ascend",
            "transformers", "dtype", "mode", "determinism", "seed"} <= set(env)


@pytest.mark.slow
def test_near_tie_flip_is_flagged_not_failed(near_tie):
    res, out, _ = near_tie
    assert res, res.summary
    assert res.metrics.near_tie_flips == 1 and res.metrics.real_flips == 0
    assert res.metrics.token_agreement < 1.0
    assert "1 near-tie token flip(s) allowed" in res.summary
    doc = _json(out)
    flips = doc["tokens"]["flips"]
    assert len(flips) == 1 and flips[0]["label"] == "near-tie" and flips[0]["near_tie"] is True
    assert flips[0]["margin"] < flips[0]["noise"]
    md = (out / "report.md").read_text()
    assert re.search(r"\| near-tie +\|", md)
    # the same captures judged with no near-tie flip allowed: FAIL, and it says why
    scn = load_scenario(SCN / "tiny-near-tie.toml")
    strict = replace(scn, thresholds=replace(scn.thresholds, near_tie_flips=0))
    res2 = evaluate(strict, res.ref_path, res.cand_path)
    assert not res2 and [c.name for c in res2.failed_checks] == ["near_tie_flips"]
    assert "1 near-tie generated-token flip(s) (allowed 0)" in res2.summary


@pytest.mark.slow
def test_regression_against_last_release(identical, fault, tmp_path):
    ires, iout, _ = identical
    fres, fout, _ = fault
    scn = load_scenario(SCN / "tiny-identical.toml")
    # same release again: same as last release
    same = evaluate(replace(scn, previous=iout / "report.json"), ires.ref_path, ires.cand_path)
    assert same and same.regression.verdict == "same"
    assert same.regression.sentence == "same as last release"
    # the faulty candidate against the clean last release: worse, and that fails
    worse = evaluate(replace(scn, previous=iout / "report.json"), ires.ref_path, fres.cand_path)
    assert worse.regression.verdict == "worse" and "regression" in {
        c.name for c in worse.failed_checks}
    changes = {i.metric: i.change for i in worse.regression.items}
    assert changes["max_layer_rel_l2"] == "worse" and changes["token_agreement"] == "same"
    # a previous release given as a capture of its candidate: the clean one is better
    better = evaluate(replace(scn, previous=Path(fres.cand_path)), ires.ref_path, ires.cand_path)
    assert better and better.regression.verdict == "better"
    # a report.json that is not a sign-off is refused
    bad = tmp_path / "x.json"
    bad.write_text('{"schema": "accucheck.diff"}')
    with pytest.raises(UserError, match="not an accucheck sign-off"):
        evaluate(replace(scn, previous=bad), ires.ref_path, ires.cand_path)


@pytest.mark.slow
def test_plots_are_images_of_the_data(identical, fault):
    from accucheck.report.plots import PLOTS, make_plots

    a, _ = make_plots(identical[0])
    b, _ = make_plots(fault[0])
    assert set(a) == set(b) == {n for n, _ in PLOTS}
    for name in a:
        assert a[name][:8] == b"\x89PNG\r\n\x1a\n" and len(a[name]) > 5000
    assert a["layers"] != b["layers"] and a["logits_kl"] != b["logits_kl"]
    assert a["worst"] != b["worst"]


@pytest.mark.slow
def test_cli_reuses_given_captures_and_refuses_a_full_report_dir(fault, tmp_path, capsys):
    res, _, _ = fault
    out = tmp_path / "rep"
    scn = str(SCN / "tiny-planted-fault.toml")
    args = ["signoff", scn, "--ref", res.ref_path, "--cand", res.cand_path,
            "--golden", res.golden_path, "-o", str(out)]
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 1
    cap = capsys.readouterr()
    assert cap.out.startswith("FAIL: tiny-planted-fault") and CULPRIT in cap.out
    assert "signoff: diff" in cap.err and "report:" in cap.err
    assert not (out / "captures").exists()  # nothing was captured: the given files were used
    assert _json(out)["culprit"] == f"{CULPRIT}#0"
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == EXIT_BAD_INPUT
    assert "not empty" in capsys.readouterr().err
    (out / "mine.txt").write_text("kept")
    with pytest.raises(SystemExit) as e:
        main(args + ["--force", "-q"])
    assert e.value.code == 1 and (out / "mine.txt").read_text() == "kept"
    assert capsys.readouterr().err.strip().startswith("report:")


@pytest.mark.slow
def test_cli_identical_exits_0(identical, tmp_path, capsys):
    res, _, _ = identical
    with pytest.raises(SystemExit) as e:
        main(["signoff", str(SCN / "tiny-identical.toml"), "--ref", res.ref_path, "--cand",
              res.cand_path, "-o", str(tmp_path / "r"), "-q"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("PASS:")


def test_missing_capture_is_bad_input(tmp_path):
    with pytest.raises(UserError) as e:
        signoff(SCN / "tiny-identical.toml", ref=tmp_path / "nope.h5", out_dir=tmp_path / "o")
    assert e.value.exit_code == 3 and "--ref" in str(e.value)


@pytest.mark.slow
def test_capture_only_writes_one_run(tmp_path, capsys):
    out = tmp_path / "o"
    with pytest.raises(SystemExit) as e:
        main(["signoff", str(SCN / "tiny-identical.toml"), "--capture-only", "reference", "-o",
              str(out), "-q"])
    assert e.value.code == 0
    p = Path(capsys.readouterr().out.strip())
    assert p == out / "captures" / "reference.h5" and p.is_file()
    assert not (out / "report.json").exists() and not (out / "captures/candidate.h5").exists()


@pytest.mark.slow
def test_judging_given_captures_needs_no_torch(identical, tmp_path):
    import subprocess
    import sys

    res, _, _ = identical
    code = (f"import sys\nfrom accucheck.signoff.run import signoff\n"
            f"r = signoff({str(SCN / 'tiny-identical.toml')!r}, ref={res.ref_path!r}, "
            f"cand={res.cand_path!r}, golden={res.golden_path!r}, "
            f"out_dir={str(tmp_path / 'o')!r})\n"
            f"assert r.passed\n"
            f"bad = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
            f"assert not bad, bad\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


def test_impact_refuses_a_statistics_only_reference_before_writing(tiny, tmp_path):
    from accucheck.capture.runners.hf import capture_model
    from accucheck.signoff.scenario import scenario_from_dict

    model, tok = tiny
    ref = tmp_path / "ref.h5"
    capture_model(model, ["a b"], ref, tokenizer=tok, store="stats", max_new_tokens=1)
    scn = scenario_from_dict({"prompts": ["a b"], "impact": {}})
    out = tmp_path / "report"
    with pytest.raises(UserError) as e:
        signoff(scn, ref=ref, cand=ref, out_dir=out)
    assert "[impact]: the reference" in str(e.value) and "--store full" in str(e.value)
    assert not out.exists()


@pytest.mark.slow
def test_impact_noising_patches_the_candidates_tensors_into_a_reference_run(tmp_path):
    """`[impact] noising = true`: the model runs as the reference (no fault planted in it) and
    each block gets the candidate's captured tensor; the planted fault's block brings in the
    candidate's whole gap, and the line beside the culprit says "introduces"."""
    text = (SCN / "tiny-planted-fault.toml").read_text()
    text = text.replace("[golden]                              # high-precision",
                        "[golden]\nenabled = false\n# high-precision")
    text = text.replace('dtype = "float64"\n', "")
    text = text.replace("[impact]  ", "[impact]\nnoising = true\n#")
    scn = tmp_path / "noising.toml"
    scn.write_text(text)
    assert load_scenario(scn).impact.noising
    out = tmp_path / "report"
    msgs: list[str] = []
    res = signoff(scn, out_dir=out, progress=msgs.append)
    assert res.exit_code == 1 and res.culprit == f"{CULPRIT}#0"
    imp = _json(out)["impact"]
    assert imp["line"].startswith(f"impact: {CULPRIT} introduces 100.0% of the logit gap"), imp
    result = json.loads((out / "impact.json").read_text())
    assert result["method"] == "noising" and result["noising"].endswith("candidate.h5")
    assert any("into a reference-device run" in m for m in msgs)
