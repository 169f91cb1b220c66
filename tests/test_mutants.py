"""scripts/mutants.py (the mutation-testing dev tool) on a toy module: generation, a killed and a
survived mutant, --only / --changed, and the repository itself is never modified."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "mutants.py"
TOY = "def over(x, limit):\n    return x > limit\n\n\nSCALE = 2.5\n"
# kills `>` -> `<` and `return None`, but never probes x == limit: `>` -> `>=` survives
TOY_TEST = ("from toy import over\n\n\ndef test_over():\n"
            "    assert over(2, 1) is True and over(0, 1) is False\n")


@pytest.fixture(scope="module")
def mutants():
    spec = importlib.util.spec_from_file_location("mutants_tool", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["mutants_tool"] = mod  # dataclasses look their module up
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop("mutants_tool", None)


@pytest.fixture
def toy(tmp_path):
    (tmp_path / "toy.py").write_text(TOY)
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_toy.py").write_text(TOY_TEST)
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run(git + ["init", "-q"], cwd=tmp_path, check=True)
    subprocess.run(git + ["add", "toy.py", "tests"], cwd=tmp_path, check=True)
    subprocess.run(git + ["commit", "-q", "-m", "toy"], cwd=tmp_path, check=True)
    return tmp_path


def test_generation_is_deterministic_and_one_line(mutants, toy):
    ms = mutants.generate("toy.py", toy)
    assert [(m.line, m.what) for m in ms] == [
        (2, "return X -> return None"), (2, "compare: > -> >="), (2, "compare: > -> <"),
        (5, "constant: 2.5 -> 5.0"), (5, "constant: 2.5 -> 1.25")]
    assert [(m.old, m.new) for m in ms[1:3]] == [
        ("    return x > limit", "    return (x >= limit)"),
        ("    return x > limit", "    return (x < limit)")]
    assert ms[3].source == TOY.replace("2.5", "5.0")
    assert [(m.line, m.what) for m in mutants.generate("toy.py", toy)] == \
        [(m.line, m.what) for m in ms]


def test_one_killed_one_survived_repo_untouched(mutants, toy, capsys):
    out = toy / "result.json"
    rc = mutants.main(["--repo", str(toy), "--modules", "toy.py", "--tests", "tests/test_toy.py",
                       "--package", "toy", "--only", "toy.py:2", "--json", str(out)])
    assert rc == 0
    got = {r["what"]: r["status"] for r in json.loads(out.read_text())}
    assert got == {"return X -> return None": "killed", "compare: > -> >=": "survived",
                   "compare: > -> <": "killed"}
    text = capsys.readouterr().out
    assert "toy.py:2  compare: > -> >=" in text and "+     return (x >= limit)" in text
    assert "killed 2, timeout 0, survived 1" in text and "kill rate 66.7%" in text
    assert (toy / "toy.py").read_text() == TOY  # mutants ran on a copy
    # --resume: the killed ones are carried over, the survivor runs again
    rc = mutants.main(["--repo", str(toy), "--modules", "toy.py", "--tests", "tests/test_toy.py",
                       "--package", "toy", "--only", "toy.py:2", "--resume", str(out)])
    text = capsys.readouterr().out
    assert rc == 0 and text.count("(carried)") == 2 and "survived   toy.py:2" in text
    assert "killed 2, timeout 0, survived 1" in text
    assert "2 killed / timeout results carried" in text


def test_changed_selects_only_lines_changed_since_a_ref(mutants, toy, capsys):
    (toy / "toy.py").write_text(TOY + "LIMIT = 3\n")  # uncommitted: the working tree counts
    assert mutants.main(["--repo", str(toy), "--modules", "toy.py", "--changed", "HEAD",
                         "--list"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.lstrip()[:1].isdigit()]
    assert [ln.split()[1:] for ln in lines[:-1]] == [["toy.py:6", "constant:", "3", "->", "4"]]
    assert lines[-1] == "1 mutants"


def test_sample_is_a_reproducible_subset_in_source_order(mutants, toy, capsys):
    def listed(*extra):
        assert mutants.main(["--repo", str(toy), "--modules", "toy.py", "--list", *extra]) == 0
        return [" ".join(ln.split()[1:]) for ln in capsys.readouterr().out.splitlines()
                if ln.lstrip()[:1].isdigit() and "mutants" not in ln]

    every = listed()
    assert len(every) == 5
    a, b, c = listed("--sample", "3", "--seed", "7"), listed("--sample", "3", "--seed", "7"), \
        [listed("--sample", "3", "--seed", str(s)) for s in range(8)]
    assert a == b and len(a) == 3 and set(a) <= set(every)
    assert a == [m for m in every if m in a]  # source order kept
    assert len({tuple(x) for x in c}) > 1  # the seed picks which
    assert listed("--sample", "9") == every  # a sample larger than the list is the list
