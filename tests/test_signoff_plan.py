"""signoff.run's planning part (issue 16: tests that can fail): what `capture_only` and
`signoff` refuse before anything is captured or written, and which tokens a captured run
follows. The capture itself is replaced by a recorder of its arguments: milliseconds per test."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

import accucheck.signoff.run as run
from accucheck.errors import UserError
from accucheck.signoff.run import capture_only, signoff
from accucheck.signoff.scenario import RunSpec, Scenario
from test_diff import base, write

SCN = Scenario(None, "tiny-x", "", "@tiny", ("hi",), 2, RunSpec("reference"),
               RunSpec("candidate"))


class _Calls(list):
    specs: list


@pytest.fixture
def captured(monkeypatch):
    """capture_run replaced: each call's (role, out, tokens_from) is appended, nothing runs."""
    calls = _Calls()

    def fake(scn, role, out, *, tokens_from=None, force=False, progress=None, spec=None):
        calls.append((role, out, tokens_from))
        calls_spec.append(spec)
        return out
    calls_spec = []
    calls.specs = calls_spec
    monkeypatch.setattr(run, "capture_run", fake)
    return calls


def _refused(exit_code, text, fn, *args, **kw):
    with pytest.raises(UserError) as e:
        fn(*args, **kw)
    assert (e.value.exit_code, str(e.value)) == (exit_code, text)


def test_capture_only_refuses_what_it_cannot_capture(tmp_path, captured):
    out = tmp_path / "o"
    _refused(2, "--capture-only everything: use reference, candidate, golden or control",
             capture_only, SCN, "everything", out)
    _refused(3, "scenario tiny-x has no golden run: add a [golden] table to it, or capture "
             "another role", capture_only, SCN, "golden", out)
    given = tmp_path / "nope.h5"   # refused for being given, before it is opened
    _refused(3, f"scenario tiny-x: the candidate is an existing capture ({given}), nothing to "
             f"capture", capture_only, replace(SCN, candidate=RunSpec("candidate", given)),
             "candidate", out)
    _refused(2, "--capture-only reference with --ref: the reference is given, nothing to "
             "capture", capture_only, SCN, "reference", out, ref=given)
    assert captured == [] and not out.exists()


def test_capture_only_does_not_check_the_previous_report(tmp_path, captured):
    # the previous release only matters to a report: a broken one does not stop a capture
    bad = tmp_path / "prev.json"
    bad.write_text("{not json")
    p = capture_only(replace(SCN, previous=bad), "reference", tmp_path / "o")
    assert p == tmp_path / "o" / "captures" / "reference.h5"
    assert captured == [("reference", p, None)]


def test_capture_only_follows_the_given_references_tokens(tmp_path, captured):
    ref = write(tmp_path / "ref.h5", base())
    out = tmp_path / "o"
    p = capture_only(SCN, "candidate", out, ref=ref)
    assert captured[-1] == ("candidate", p, ref)       # teacher-forced on the given reference
    free = replace(SCN, candidate=RunSpec("candidate", teacher_forcing=False))
    capture_only(free, "candidate", out, ref=ref, force=True)
    assert captured[-1] == ("candidate", p, None)      # teacher_forcing = false: its own tokens
    capture_only(SCN, "candidate", out, force=True)
    assert captured[-1] == ("candidate", p, None)      # no reference capture to follow


def test_capture_only_refuses_an_existing_capture_without_force(tmp_path, captured):
    target = tmp_path / "o" / "captures" / "reference.h5"
    target.parent.mkdir(parents=True)
    target.write_bytes(b"keep")
    _refused(3, f"{target} exists: choose another -o or pass --force to overwrite it",
             capture_only, SCN, "reference", tmp_path / "o")
    assert target.read_bytes() == b"keep" and captured == []


def test_previous_inside_the_report_directory_is_refused(tmp_path, monkeypatch):
    def never(*a, **k):
        raise AssertionError("captured")
    monkeypatch.setattr(run, "capture_runs", never)
    out = tmp_path / "o"
    out.mkdir()
    prev = out / "report.json"   # the report this sign-off would replace
    prev.write_text(json.dumps({"schema": "accucheck.signoff", "scenario": {"name": "tiny-x"},
                                "metrics": {}}))
    _refused(2, f"--previous {prev.resolve()} is also an output of this sign-off ({prev}): an "
             f"input is never an output; move it out of the way or choose another output",
             signoff, SCN, previous=prev, out_dir=out, force=True)
    assert json.loads(prev.read_text())["metrics"] == {}


def test_capture_only_never_overwrites_the_previous_release(tmp_path, captured):
    # the last release's candidate capture kept where this run's capture goes: refused, also
    # with --force (capture-only does not read it, but would destroy it)
    target = tmp_path / "o" / "captures" / "candidate.h5"
    target.parent.mkdir(parents=True)
    target.write_bytes(b"last release")
    _refused(2, f"--previous {target} is also an output of this sign-off ({target}): an input "
             f"is never an output; move it out of the way or choose another output",
             capture_only, replace(SCN, previous=target), "candidate", tmp_path / "o",
             force=True)
    assert target.read_bytes() == b"last release" and captured == []


@pytest.fixture
def no_capture(monkeypatch):
    def never(*a, **k):
        raise AssertionError("captured")
    monkeypatch.setattr(run, "capture_runs", never)


def test_signoff_refuses_a_full_report_directory_unless_forced(tmp_path, no_capture):
    out = tmp_path / "o"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    _refused(3, f"report directory {out} is not empty: choose another --out-dir or pass --force "
             f"to replace its report", signoff, SCN, out_dir=out)
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


def test_signoff_refuses_a_scenario_file_inside_what_it_replaces(tmp_path, no_capture):
    import shutil

    from test_signoff_rules import ROOT

    toml = tmp_path / "o" / "plots" / "s.toml"   # plots/ is replaced by the report
    toml.parent.mkdir(parents=True)
    shutil.copy(ROOT / "scenarios" / "tiny-identical.toml", toml)
    with pytest.raises(UserError) as e:
        signoff(toml, out_dir=tmp_path / "o", force=True)
    assert e.value.exit_code == 2 and str(e.value).startswith(
        f"the scenario {toml} is also an output of this sign-off ({tmp_path / 'o' / 'plots'})")
    assert toml.is_file()


def test_signoff_without_prompts_refuses_before_making_the_report_directory(tmp_path):
    out = tmp_path / "o"
    _refused(3, "scenario tiny-x has no prompts: add prompts = [...] or prompts_file = \"...\", "
             "or give existing captures (--ref / --cand)", signoff, replace(SCN, prompts=()),
             out_dir=out)
    assert not out.exists()


def test_signoff_of_given_captures_makes_a_nested_report_directory(tmp_path):
    t = base()
    ref, cand = write(tmp_path / "a.h5", t), write(tmp_path / "b.h5", t)
    out = tmp_path / "reports" / "release" / "x"
    r = signoff(SCN, ref=ref, cand=cand, out_dir=out)
    assert r.out_dir == out and (out / "report.json").is_file()
    empty = tmp_path / "empty"   # an existing empty directory needs no --force
    empty.mkdir()
    assert signoff(SCN, ref=ref, cand=cand, out_dir=empty).passed
    assert json.loads((out / "report.json").read_text())["verdict"] == "pass"


def _old_report(out):
    out.mkdir()
    (out / "report.md").write_text("old md")
    (out / "report.json").write_text("old json")
    (out / "plots").mkdir()
    (out / "plots" / "a.png").write_text("old png")
    (out / "mine.txt").write_text("not a report file")


def _tree(out):
    return {str(p.relative_to(out)): p.read_text() for p in sorted(out.rglob("*")) if p.is_file()}


def test_a_failed_report_write_puts_the_old_report_back(tmp_path, monkeypatch):
    import accucheck.report.signoff as rs

    out = tmp_path / "o"
    _old_report(out)
    before = _tree(out)
    keep = tmp_path / "keep"
    keep.mkdir()
    (keep / "x").write_text("x")

    def half(result, d):   # writes part of the new report, then fails
        (d / "report.md").write_text("new md")
        (d / "report.html").symlink_to(keep, target_is_directory=True)  # a link, not its folder
        (d / "plots").mkdir()
        (d / "diff.json").symlink_to(d / "gone")   # a dangling link is removed too
        raise OSError("disk full")
    monkeypatch.setattr(rs, "write_report", half)
    with pytest.raises(OSError, match="disk full"):
        run.write_report_safely(None, out)
    assert _tree(out) == before and sorted(p.name for p in out.iterdir()) == [  # no diff.json
        "mine.txt", "plots", "report.json", "report.md"]     # nothing left aside
    assert (keep / "x").read_text() == "x"


def test_a_failure_while_moving_the_old_report_aside_loses_nothing(tmp_path, monkeypatch):
    import accucheck.report.signoff as rs

    out = tmp_path / "o"
    _old_report(out)
    before = _tree(out)
    real, n = run.os.replace, []

    def second_fails(a, b):
        n.append(a)
        if len(n) == 2:   # report.json, after report.md was moved
            raise PermissionError("busy")
        return real(a, b)
    monkeypatch.setattr(run.os, "replace", second_fails)
    monkeypatch.setattr(rs, "write_report", lambda *a: pytest.fail("written"))
    with pytest.raises(PermissionError):
        run.write_report_safely(None, out)
    assert _tree(out) == before        # the files not yet moved stay, the moved one is back


def test_an_old_dangling_link_is_replaced_not_followed(tmp_path, monkeypatch):
    import accucheck.report.signoff as rs

    out, elsewhere = tmp_path / "o", tmp_path / "elsewhere.json"
    out.mkdir()
    (out / "report.json").symlink_to(elsewhere)
    monkeypatch.setattr(rs, "write_report",
                        lambda result, d: (d / "report.json").write_text("new"))
    run.write_report_safely(None, out)
    p = out / "report.json"
    assert not p.is_symlink() and p.read_text() == "new" and not elsewhere.exists()
    assert [q.name for q in out.iterdir()] == ["report.json"]


def test_capture_run_without_a_progress_callback(tmp_path, monkeypatch):
    import accucheck.capture.runners.hf as api

    seen = []
    monkeypatch.setattr(api, "capture_dir", lambda model_dir, prompts, out, opts, **kw:
                        seen.append((list(prompts), out, opts.tokens_from, opts.force,
                                     opts.meta_extra)))
    out = tmp_path / "c.h5"
    assert run.capture_run(SCN, "candidate", out, tokens_from=tmp_path / "ref.h5") == out
    assert seen == [(["hi"], out, str(tmp_path / "ref.h5"), False,   # no --force by default
                     {"signoff": {"scenario": "tiny-x", "role": "candidate"}})]
    # called on its own (not through check_plan), it still refuses a run without prompts
    _refused(3, "scenario tiny-x has no prompts: add prompts = [...] or prompts_file = \"...\", "
             "or give existing captures (--ref / --cand)", run.capture_run,
             replace(SCN, prompts=()), "candidate", out)
    _refused(3, "scenario tiny-x has no golden run", run.capture_run, SCN, "golden", out)
    assert len(seen) == 1


def test_a_control_of_two_runs_is_captured_twice_with_the_next_seed(tmp_path, captured):
    """[control] runs = 2: control.h5 (dither seed s) and control2.h5 (seed s + 1), each
    teacher-forced on the reference; both are the verdict's controls."""
    from accucheck.signoff.run import capture_runs, control_paths

    scn = replace(SCN, control=RunSpec("control", dtype="bfloat16", dither=5, runs=2))
    paths = capture_runs(scn, tmp_path / "c")
    assert [(r, p.name) for r, p, _t in captured] == [
        ("reference", "reference.h5"), ("candidate", "candidate.h5"),
        ("control", "control.h5"), ("control", "control2.h5")]
    assert [(s.dither, s.runs) for s in captured.specs[2:]] == [(5, 1), (6, 1)]
    assert all(t == tmp_path / "c" / "reference.h5" for _r, _p, t in captured[1:])
    assert [p.name for p in control_paths(paths)] == ["control.h5", "control2.h5"]
    ref = write(tmp_path / "ref.h5", base())
    out = capture_only(scn, "control", tmp_path / "o", ref=ref)
    assert out.name == "control.h5" and [p.name for _r, p, _t in captured[-2:]] == \
        ["control.h5", "control2.h5"]
