"""Rendering and the `accucheck diff` command: verdict lines, JSON schema, csv/md, exit codes."""
from __future__ import annotations

import csv
import io
import json
import subprocess
import sys

import numpy as np
import pytest

import diffcases
from accucheck.cli import main
from accucheck.verdict.locate import analyze
from accucheck.report.diff import CSV_COLUMNS, render, to_json, verdict_line
from test_diff import base, write

JSON_TOP = {"schema", "schema_version", "verdict", "exit_code", "summary", "ref", "cand", "routing", "mapping",
            "golden_path", "basis", "notes", "tolerances", "amplification", "counts",
            "compared_steps", "io", "first_divergence", "top", "records", "missing", "layers",
            "logits", "golden", "culprit", "ops", "diffuse", "noise_like", "first_over", "worst",
            "suspicious", "precision_findings", "compute_dtypes", "first_difference", "control"}


@pytest.fixture(scope="module")
def caps(tiny, tmp_path_factory):
    model, tok = tiny
    d = tmp_path_factory.mktemp("report")
    ref = diffcases.make("ref", model, tok, d / "ref.h5", steps=1)
    out = {"ref": ref, "dir": d}
    for k in ("same", "norm_bf16", "fp64"):
        out[k] = diffcases.make(k, model, tok, d / f"{k}.h5", ref, steps=1)
    return out


def run_cli(args, capsys):
    with pytest.raises(SystemExit) as e:
        main(["diff", *map(str, args)])
    out, err = capsys.readouterr()
    return e.value.code, out, err


def test_pass_and_fail_verdict_lines(caps):
    ok = analyze(caps["ref"], caps["same"])
    assert verdict_line(ok).startswith("PASS: ")
    bad = analyze(caps["ref"], caps["norm_bf16"])
    line = verdict_line(bad)
    assert line.startswith(f"FAIL: divergence starts at step 0, {diffcases.NORM_FAULT} (out.0): "
                           f"rel_l2 ")
    # its input (residual + attention) is not a recorded output: the capture records it
    assert "input rel_l2 0 (inputs) -> introduced here" in line
    table = render(bad, "table")
    assert table.splitlines()[0] == line
    assert "Per-layer error" in table and "Logits" in table and "Worst records" in table
    assert max(len(x) for x in table.splitlines()) < 200 and len(table.splitlines()) < 60


def test_json_schema(caps):
    a = analyze(caps["ref"], caps["norm_bf16"], caps["fp64"])
    j = json.loads(render(a, "json"))
    assert set(j) == JSON_TOP
    assert (j["schema"], j["schema_version"], j["verdict"], j["exit_code"]) == \
        ("accucheck.diff", 1, "fail", 1)
    fd = j["first_divergence"]
    assert {"key", "module", "step", "cause", "rel_l2", "input_rel_l2", "metrics"} <= set(fd)
    assert (fd["module"], fd["step"], fd["cause"]) == (diffcases.NORM_FAULT, 0, "introduced")
    assert fd["metrics"]["rel_l2"] == fd["rel_l2"] and fd["metrics"]["cosine"] < 1
    # everything before the planted norm is bitwise the reference's: it is the first difference
    first = j["first_difference"]
    assert (first["module"], first["step"], first["role"]) == (diffcases.NORM_FAULT, 0, "out")
    assert len(j["records"]) == j["counts"]["compared"] > 0
    rec = j["records"][0]
    assert {"key", "within", "cause", "rel_l2", "input_rel_l2", "metrics", "tolerance",
            "golden"} <= set(rec)
    assert j["missing"] == []
    steps = j["logits"]["steps"]
    assert {s["step"] for s in steps} == {0, 1}
    assert {"kl", "top1_ref", "top1_cand", "agree", "top5_overlap", "margin", "noise"} <= \
        set(steps[0]["positions"][0])
    assert "first_flip" in j["logits"]
    # golden: the planted-fault candidate is worse than the reference at the fault
    labels = {x["key"]: x["label"] for x in j["golden"]["labels"]}
    assert labels[f"r0.s0:{diffcases.NORM_FAULT}#0:out.0"] == "cand worse"
    assert labels["r0.s0:model.embed_tokens#0:out.0"] == "both within noise"
    assert sum(j["golden"]["counts"].values()) == len(j["records"])


def test_json_pass_has_null_first_divergence(caps):
    j = to_json(analyze(caps["ref"], caps["same"]))
    assert j["verdict"] == "pass" and j["first_divergence"] is None and j["golden"] is None


def test_json_writes_non_finite_numbers_as_strings(tmp_path):
    t = base()
    c = dict(t)
    c["r0.s0:model.layers.0.mlp#0:out.0"] = np.ones((1, 3, 65))
    text = render(analyze(write(tmp_path / "a.h5", t), write(tmp_path / "b.h5", c)), "json")
    j = json.loads(text)  # strict JSON: no bare Infinity / NaN
    assert "Infinity" not in text and "NaN" not in text
    r = next(x for x in j["records"] if x["key"] == "r0.s0:model.layers.0.mlp#0:out.0")
    assert r["rel_l2"] == "inf" and r["basis"] == "shape"
    assert j["first_divergence"]["key"] == "r0.s0:model.layers.0.mlp#0:out.0"
    assert verdict_line(analyze(tmp_path / "a.h5", tmp_path / "b.h5")).endswith(
        "shape [1, 3, 64] vs [1, 3, 65]")


def test_csv_and_md(caps):
    a = analyze(caps["ref"], caps["norm_bf16"])
    rows = list(csv.reader(io.StringIO(render(a, "csv"))))
    assert tuple(rows[0]) == CSV_COLUMNS and len(rows) == len(a.diff.records) + 1
    md = render(a, "md")
    assert md.startswith("**FAIL: divergence starts") and "| record" in md


def test_cli_exit_codes_and_output(caps, capsys, tmp_path):
    code, out, err = run_cli([caps["ref"], caps["same"]], capsys)
    assert code == 0 and out.startswith("PASS") and "diff" in err
    code, out, _ = run_cli([caps["ref"], caps["norm_bf16"], "--format", "json"], capsys)
    assert code == 1 and json.loads(out)["verdict"] == "fail"
    # a looser per-key override turns the fault into a pass
    code, out, _ = run_cli([caps["ref"], caps["norm_bf16"], "--rel-l2", "1e-2"], capsys)
    assert code == 0
    code, _, err = run_cli([caps["ref"], caps["same"], "--rtol", "1e-3"], capsys)
    assert code == 2 and "--rtol and --atol" in err and len(err.strip().splitlines()) == 1
    code, _, err = run_cli([caps["ref"], tmp_path / "nope.h5"], capsys)
    last = err.strip().splitlines()[-1]
    assert code == 3 and last.startswith("accucheck: error:") and "Traceback" not in err
    assert "no such capture file" in last
    o = tmp_path / "r.json"
    code, out, err = run_cli([caps["ref"], caps["norm_bf16"], "--format", "json", "-o", o],
                             capsys)
    assert code == 1 and out == "" and json.loads(o.read_text())["verdict"] == "fail"
    assert "FAIL" in err
    code, _, err = run_cli([caps["ref"], caps["same"], "-o", o], capsys)
    assert code == 3 and "exists" in err  # nothing overwritten: bad input, like capture
    code, _, _ = run_cli([caps["ref"], caps["same"], "-o", o, "--force"], capsys)
    assert code == 0 and o.read_text().startswith("PASS")
    code, _, err = run_cli([caps["ref"], caps["same"], "--tol", "bad"], capsys)
    assert code == 2


def test_cli_subprocess_without_torch(caps):
    """`python -m accucheck diff` runs end to end and never imports torch."""
    code = ("import sys, runpy; sys.argv = ['accucheck', 'diff', sys.argv[1], sys.argv[2]]\n"
            "try:\n    runpy.run_module('accucheck', run_name='__main__')\n"
            "except SystemExit as e:\n    print('EXIT', e.code, 'torch' in sys.modules)\n")
    p = subprocess.run([sys.executable, "-c", code, str(caps["ref"]), str(caps["norm_bf16"])],
                       capture_output=True, text=True)
    assert p.stdout.strip().splitlines()[-1] == "EXIT 1 False", p.stderr
