"""The README's commands and Python API example, run as written (on the tiny model)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from accucheck.cli import main

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_setup_commands_are_what_ci_runs():
    text = README.read_text()
    assert "pip install torch==2.13.0 -e '.[capture,plots]' && accucheck demo" in text
    assert "bash .ci/run" in text
    ci = (README.parent / ".ci" / "run").read_text()
    assert "python -m pytest" in ci and "scripts/install-test.sh" in ci


def test_demo_names_the_planted_module(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("ACCUCHECK_CACHE", str(tmp_path / "cache"))
    with pytest.raises(SystemExit) as e:
        main(["demo", "--out-dir", str(tmp_path / "demo")])
    out, err = capsys.readouterr()
    assert e.value.code == 0, err
    assert out.startswith("FAIL: divergence starts at step 0, "
                          "model.layers.2.post_attention_layernorm (out.0)")
    assert "introduced here" in out
    assert "PASS demo" in err
    page = tmp_path / "demo" / "diff.html"
    assert f"the same diff as a page (heatmap, curves, logits): {page}" in err
    assert page.read_text().count('id="verdict" class="fail">FAIL: divergence starts') == 1
    # a second run refuses to overwrite the demo's files
    with pytest.raises(SystemExit) as e:
        main(["demo", "--out-dir", str(tmp_path / "demo")])
    assert e.value.code == 3


def test_python_api_example_runs(tiny, tmp_path, monkeypatch):
    block = re.search(r"## Python API.*?```python\n(.*?)```", README.read_text(), re.S).group(1)
    model, tok = tiny
    monkeypatch.chdir(tmp_path)
    printed = []
    scope = {"model": model, "tok": tok, "print": printed.append}
    exec(compile(block, "README.md", "exec"), scope)
    # float32 vs bfloat16 of the same weights, teacher-forced: bf16 noise within the bf16
    # tolerance, no culprit invented (README: "an fp32 vs bf16 whole-model diff ...")
    text = str(printed[0])
    assert text.startswith("PASS: ") and "records within tolerance" in text.splitlines()[0]
    assert "Culprit" not in text
    assert (tmp_path / "ref.h5").is_file() and (tmp_path / "cand.h5").is_file()
