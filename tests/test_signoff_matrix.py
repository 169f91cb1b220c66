"""A scenario's [matrix] in the sign-off (accucheck.signoff.matrix): read and checked with the
scenario, run on the reference's settings, shown in every report format, and gating: a knob of
`expect_invariant` that moves a request fails the sign-off with its own check."""
from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from accucheck.errors import UserError
from accucheck.signoff.run import signoff
from accucheck.signoff.scenario import load_scenario, scenario_from_dict

SCN = Path(__file__).resolve().parents[1] / "scenarios" / "tiny-matrix.toml"


def scenario(**matrix):
    data = tomllib.loads(SCN.read_text())
    data["matrix"] = {**data["matrix"], **matrix}
    return scenario_from_dict(data, base=SCN.parent, src="tiny-matrix")


def test_matrix_section_is_checked_with_the_scenario():
    s = load_scenario(SCN)
    assert s.matrix.runner == "hf" and s.matrix.max_new_tokens == 2
    assert s.matrix.expect_invariant == ("env:ACCUCHECK_DEMO",)
    for bad, says in ((dict(knobs=["batch_szie=2"]), "unknown knob"),
                      (dict(knobs=[]), "needs at least one knob"),
                      (dict(expect_invariant=["mode"]), "mode is not one of the knobs"),
                      (dict(knobs=["enforce_eager=false"]), "is for --runner vllm"),
                      (dict(colour="red"), "colour")):
        with pytest.raises(UserError) as e:
            scenario(**bad)
        assert says in str(e.value) and e.value.exit_code == 3, str(e.value)


@pytest.mark.slow
@pytest.mark.parametrize("invariant, passes", [(["env:ACCUCHECK_DEMO"], True),
                                               (["attn_implementation"], False)])
def test_signoff_runs_the_matrix_and_gates_on_it(invariant, passes, tmp_path):
    s = scenario(expect_invariant=invariant,
                 knobs=["attn_implementation=eager", "env:ACCUCHECK_DEMO=1"])
    res = signoff(s, out_dir=tmp_path / "r")
    check = next(c for c in res.checks if c.name == "matrix invariance")
    assert check.passed is passes and res.passed is passes, check
    doc = json.loads((tmp_path / "r" / "report.json").read_text())
    assert doc["matrix"]["expect_invariant"] == invariant
    labels = [r["label"] for r in json.loads(
        (tmp_path / "r" / "matrix" / "matrix.json").read_text())["rows"]]
    assert labels == ["attn_implementation=eager", "env:ACCUCHECK_DEMO=1"]
    md = (tmp_path / "r" / "report.md").read_text()
    page = (tmp_path / "r" / "report.html").read_text()
    assert "Configuration matrix" in md and "Configuration matrix" in page
    # the attention kernel moved the numbers from the attention core; the env run moved nothing
    assert "model.layers.0.self_attn.o_proj (in.0)" in md and "none (bitwise equal)" in md
    if not passes:
        assert "attn_implementation=eager moves" in check.detail and res.exit_code == 1
