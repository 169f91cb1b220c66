"""Sign-off with a [control] run (scenarios/tiny-control.toml): the control, not the dtype
tolerance, decides; the report shows the candidate/control ratio per layer; a clean candidate
passes."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from accucheck.signoff.run import signoff
from accucheck.signoff.scenario import load_scenario, scenario_from_dict

ROOT = Path(__file__).resolve().parents[1]


def test_control_scenario_names_the_fault_and_the_control_decides(tmp_path):
    scn = load_scenario(ROOT / "scenarios" / "tiny-control.toml")
    assert scn.control is not None and scn.control.dtype == "bfloat16"
    assert (scn.control.device, scn.control.mode, scn.control.runner) == ("cpu", "eager", "hf")
    res = signoff(scn, out_dir=tmp_path / "rep")
    a = res.analysis
    assert not res.passed and res.exit_code == 1
    assert a.location.noise.flagged[0].site == "model.layers.2.mlp.down_proj#0:out.0"
    assert not any(c.name == "records" for c in res.checks)  # the control decides, not it
    assert res.culprit == "model.layers.2.mlp.down_proj#0"
    noise_check = next(c for c in res.checks if c.name == "noise")
    assert not noise_check.passed and "model.layers.2.mlp.down_proj" in noise_check.detail
    assert "more than noise from step 0, model.layers.2.mlp.down_proj#0" in res.summary
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "Candidate / control per layer" in md and "MORE THAN NOISE" in md
    assert "control: " in md
    j = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert j["runs"]["control"]["label"] == "cpu bfloat16 eager (hf) + dither seeds 8, 9"
    assert j["runs"]["control"]["captures"] == ["captures/control.h5", "captures/control2.h5"]
    assert [x["layer"] for x in j["control"]["layers"]] == [0, 1, 2, 3]
    assert j["control"]["flagged"][0]["site"] == "model.layers.2.mlp.down_proj#0:out.0"
    html = (tmp_path / "rep" / "report.html").read_text()
    assert "Candidate / control per layer" in html


def test_a_clean_candidate_passes_its_control(tmp_path):
    scn = scenario_from_dict({
        "name": "tiny-control-clean", "model": "@tiny", "max_new_tokens": 2,
        "prompts": ["The quick brown fox jumps over the lazy dog",
                    "Accuracy of large language models"],
        "candidate": {"dtype": "bfloat16", "dither": 7}, "golden": {"enabled": False},
        "control": {"dither": 8}})
    res = signoff(scn, out_dir=tmp_path / "rep")
    assert res.passed, res.summary
    assert res.analysis.location.noise is not None and not res.analysis.location.noise.flagged
    assert "records within the control's noise" in res.summary


def test_a_control_is_trusted_and_refused_a_fault():
    from accucheck.errors import UserError

    with pytest.raises(UserError, match="control.fault"):
        scenario_from_dict({"prompts": ["x"], "control": {
            "fault": {"module": "model.layers.0.mlp", "kind": "bf16"}}})
