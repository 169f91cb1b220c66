"""`accucheck diff` flags the README / docs promise, each through the CLI on small synthetic
captures (no torch): --golden, --tol, --rel-l2, --rtol/--atol, --step, --include,
--allow-incomplete, --amplification; and the csv `cause` / json `path` fields."""
from __future__ import annotations

import csv
import io
import json

import h5py
import numpy as np
import pytest

from accucheck.cli import main
from test_diff import base, write

K1 = "r0.s0:model.layers.1.mlp#0:out.0"   # the candidate's planted error (rel_l2 1e-2)
K0 = "r0.s0:model.layers.0.mlp#0:out.0"
DOC_FP32, DOC_AMPLIFICATION = 5e-5, 4.0   # README: float32 tolerance, "more than 4x"


def run(args, capsys):
    with pytest.raises(SystemExit) as e:
        main(["diff", *map(str, args)])
    out, err = capsys.readouterr()
    return e.value.code, out, err


def run_json(args, capsys):
    code, out, err = run([*args, "--format", "json"], capsys)
    assert code in (0, 1), err
    j = json.loads(out)
    assert j["exit_code"] == code
    return code, j


def one_line_error(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith("accucheck: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli_diff")
    t = base(np.random.default_rng(7), steps=(0, 1))
    gen = ((4, 5),)
    cand = dict(t)
    cand[K1] = t[K1] * 1.01
    ref_bad = dict(t)
    ref_bad[K0] = t[K0] * 1.01        # the REFERENCE is wrong here; the candidate is right
    return {
        "t": t,
        "ref": write(d / "ref.h5", t, gen=gen),
        "same": write(d / "same.h5", t, gen=gen),
        "cand": write(d / "cand.h5", cand, gen=gen),
        "ref_bad": write(d / "ref_bad.h5", ref_bad, gen=gen),
        "golden": write(d / "golden.h5", t, gen=gen, dtype="float64"),
        "dir": d,
    }


def _records(j) -> dict:
    return {r["key"]: r for r in j["records"]}


def test_golden_decides_and_reaches_the_json(files, capsys):
    # only the reference is wrong: without a referee that fails, with it the referee clears it
    code, j = run_json([files["ref_bad"], files["same"]], capsys)
    assert code == 1 and j["golden_path"] is None and j["golden"] is None
    assert _records(j)[K0]["within"] is False
    code, j = run_json([files["ref_bad"], files["same"], "--golden", files["golden"]], capsys)
    assert code == 0 and j["verdict"] == "pass"
    assert j["golden_path"] == str(files["golden"])
    r = _records(j)[K0]
    assert r["golden"]["label"] == "ref worse" and r["within"] is True
    assert r["golden"]["multiplier"] == 2.0 and r["golden"]["cand_rmse"] == 0.0
    assert j["golden"]["counts"] == {"both within noise": len(j["records"]) - 1, "ref worse": 1}
    # the candidate is wrong: the referee says so and the diff fails
    code, j = run_json([files["ref"], files["cand"], "--golden", files["golden"]], capsys)
    assert code == 1 and _records(j)[K1]["golden"]["label"] == "cand worse"
    assert _records(j)[K1]["within"] is False
    code, text, _ = run([files["ref"], files["cand"], "--golden", files["golden"]], capsys)
    assert code == 1 and "Golden referee: " in text and "cand worse: 1" in text


def test_tol_overrides_by_pattern_last_match_wins(files, capsys):
    a, b = files["ref"], files["cand"]
    code, j = run_json([a, b], capsys)
    assert code == 1 and _records(j)[K1]["tolerance"]["rel_l2"] == DOC_FP32
    code, j = run_json([a, b, "--tol", "*.mlp=rel_l2:2e-2"], capsys)
    assert code == 0
    recs = _records(j)
    assert recs[K1]["tolerance"] == {"rel_l2": 2e-2, "rtol": None, "atol": None,
                                     "source": "override *.mlp"}
    assert recs["r0.s0:model.norm#0:out.0"]["tolerance"]["source"] == "default float32"
    assert j["tolerances"]["overrides"][0]["pattern"] == "*.mlp"
    code, j = run_json([a, b, "--tol", "*.mlp=2e-2", "--tol", "model.layers.1.*=1e-3"], capsys)
    assert code == 1
    assert _records(j)[K1]["tolerance"]["source"] == "override model.layers.1.*"
    assert _records(j)[K0]["tolerance"]["source"] == "override *.mlp"
    code, _, err = run([a, b, "--tol", "*.mlp=fast"], capsys)
    assert code == 2 and "bad tolerance override" in one_line_error(err)


def test_rel_l2_and_rtol_atol(files, capsys):
    a, b = files["ref"], files["cand"]
    code, j = run_json([a, b, "--rel-l2", "2e-2"], capsys)
    assert code == 0 and {r["tolerance"]["rel_l2"] for r in j["records"]} == {2e-2}
    # the elementwise check on top: 1 % relative error everywhere in K1 is over rtol 1e-3
    code, j = run_json([a, b, "--rel-l2", "2e-2", "--rtol", "1e-3", "--atol", "0"], capsys)
    r = _records(j)[K1]
    assert code == 1 and r["within"] is False
    assert (r["tolerance"]["rtol"], r["tolerance"]["atol"]) == (1e-3, 0.0)
    assert r["metrics"]["mismatched"] == int(np.prod(files["t"][K1].shape))
    code, _, err = run([a, b, "--rtol", "1e-3"], capsys)
    assert code == 2 and "--atol" in one_line_error(err)


def test_step_and_include_select_records(files, capsys):
    a, b = files["ref"], files["cand"]
    step1 = [k for k in files["t"] if k.startswith("r0.s1:")]
    code, j = run_json([a, b, "--step", "1"], capsys)
    assert code == 0 and [r["key"] for r in j["records"]] == step1
    assert j["counts"]["compared"] == len(step1)
    code, j = run_json([a, b, "--step", "0"], capsys)
    assert code == 1 and {r["step"] for r in j["records"]} == {0}
    code, j = run_json([a, b, "--step", "0", "--step", "1"], capsys)
    assert code == 1 and len(j["records"]) == len(files["t"])
    code, j = run_json([a, b, "--include", "*.layers.0.*"], capsys)
    assert code == 0 and j["records"]
    assert all(".layers.0." in r["key"] for r in j["records"])
    code, j = run_json([a, b, "--include", "*.mlp", "--step", "0"], capsys)
    assert code == 1 and [r["key"] for r in j["records"]] == [K0, K1]
    code, _, err = run([a, b, "--include", "nothing*"], capsys)
    assert code == 3 and "--include" in one_line_error(err)


def test_allow_incomplete(files, capsys, tmp_path):
    inc = write(tmp_path / "inc.h5", files["t"], gen=((4, 5),))
    with h5py.File(inc, "r+") as f:
        f.attrs["complete"] = False
    code, _, err = run([files["ref"], inc], capsys)
    assert code == 3 and "incomplete" in one_line_error(err)
    code, j = run_json([files["ref"], inc, "--allow-incomplete"], capsys)
    assert code == 0 and len(j["records"]) == len(files["t"])


def test_amplification_reaches_locate(files, capsys):
    code, j = run_json([files["ref"], files["cand"]], capsys)
    assert j["amplification"] == DOC_AMPLIFICATION
    code, j = run_json([files["ref"], files["cand"], "--amplification", "7.5"], capsys)
    assert j["amplification"] == 7.5
    from accucheck.verdict.locate import analyze

    assert analyze(files["ref"], files["cand"], amplification=7.5).location.amplification == 7.5
    code, _, err = run([files["ref"], files["cand"], "--amplification", "x"], capsys)
    assert code == 2


def test_csv_cause_is_set_exactly_for_failing_records(files, capsys):
    code, out, _ = run([files["ref"], files["cand"], "--format", "csv"], capsys)
    assert code == 1
    rows = list(csv.DictReader(io.StringIO(out)))
    assert len(rows) == len(files["t"])
    failing = [r for r in rows if r["within"] == "0"]
    assert [r["key"] for r in failing] == [K1]
    for r in rows:
        if r["within"] == "0":
            assert r["cause"] in ("introduced", "inherited"), r
        else:
            assert r["cause"] == "", r
    assert float(failing[0]["rel_l2"]) == pytest.approx(1e-2, rel=1e-4)


def test_json_path_lists_the_recorded_enclosing_modules(files, capsys):
    code, j = run_json([files["ref"], files["cand"]], capsys)
    assert code == 1
    fd = j["first_divergence"]
    assert fd is not None
    # whichever record is named, its path is its recorded ancestors, outermost first
    modules = {r["module"] for r in j["records"] if r["req"] == fd["req"]
               and r["step"] == fd["step"] and r["op"] is None}
    ancestors = sorted((m for m in modules if fd["module"].startswith(m + ".")), key=len)
    assert fd["path"] == ancestors
    # the planted error sits in layer 1's MLP: the named record is inside the recorded layer
    assert fd["module"].startswith("model.layers.1") and "model.layers.1" in modules
    if fd["module"] != "model.layers.1":
        assert fd["path"] and fd["path"][0] == "model.layers.1"
