"""`accucheck capture --control-for REF` and `accucheck diff --control CTL` on the tiny model:
what a control takes from its reference, what diff refuses, and the verdict it decides."""
from __future__ import annotations

import json

import numpy as np
import pytest

from accucheck.cli import main
from accucheck.store import open_capture

PROMPTS = ["The quick brown fox jumps over the lazy dog", "Accuracy of large language models",
           "A control run measures what the precision costs", "one two three four five"]


def run(args, capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in args])
    out, err = capsys.readouterr()
    return e.value.code, out, err


@pytest.fixture(scope="module")
def files(tiny, tiny_dir, tmp_path_factory):
    """ref (fp32, CLI), ctl (capture --control-for --plain-control, CLI: plain bf16 on the
    CPU), dctl (the default control: dithered), a clean bf16 candidate and one with a fault,
    teacher-forced. The candidates round as the plain control does (plain bf16), so it is the
    one they are judged against here; the clean one may even be bitwise the control."""
    from accucheck.capture.runners.hf import capture_model
    from accucheck.capture.faults import planted

    d = tmp_path_factory.mktemp("ctlcli")
    with pytest.raises(SystemExit) as e:
        main(["capture", str(tiny_dir), *sum((["--prompt", p] for p in PROMPTS), []),
              "--max-new-tokens", "2", "--store", "full", "-o", str(d / "ref.h5")])
    assert e.value.code == 0
    for name, extra in (("ctl.h5", ["--plain-control"]), ("dctl.h5", [])):
        with pytest.raises(SystemExit) as e:
            main(["capture", str(tiny_dir), "--control-for", str(d / "ref.h5"), "--dtype",
                  "bfloat16", "-o", str(d / name), *extra])
        assert e.value.code == 0
    import torch
    from accucheck.capture.models import load_model_dir

    # loaded as the CLI loads it (from_pretrained in bfloat16 keeps the rotary inv_freq in
    # float32; .to(bfloat16) of a float32 model would round it: a real precision difference
    # the control shows at model.rotary_emb)
    model, tok = load_model_dir(tiny_dir, torch.bfloat16, torch.device("cpu"))
    kw = dict(tokenizer=tok, store="full", max_new_tokens=2, tokens_from=str(d / "ref.h5"))
    capture_model(model, PROMPTS, d / "clean.h5", **kw)
    # x3.2 the plain control's noise at that site, x1.8 the dithered control's (x1.8 / x1.0 at
    # tile:0.1: the dither doubles the noise unit of a round-to-nearest candidate)
    with planted(model, "model.layers.2.mlp.down_proj", "tile:0.2"):
        capture_model(model, PROMPTS, d / "fault.h5", **kw)
    fp32, _ = tiny
    capture_model(fp32, PROMPTS, d / "fp32.h5", **kw)
    return d


def test_control_for_takes_prompts_tokens_and_selection_from_the_reference(files):
    with open_capture(files / "ref.h5") as r, open_capture(files / "ctl.h5") as c:
        assert c.meta["dtype"] == "bfloat16" and c.meta["mode"] == "eager"
        assert c.meta["control_for"] == str(files / "ref.h5")
        assert c.store_mode == r.store_mode == "full"
        assert [list(q.prompt_ids) for q in c.requests] == [list(q.prompt_ids) for q in r.requests]
        assert [list(q.generated_ids) for q in c.requests] == \
            [list(q.generated_ids) for q in r.requests]
        assert {row.key for row in c.rows} == {row.key for row in r.rows}


def test_the_default_control_is_dithered_and_plain_control_is_not(files, capsys):
    """capture --control-for dithers the control with its seed (a device correct to one ULP:
    capture.runners.control); --plain-control makes the CPU's own round-to-nearest run; the
    flag without --control-for is a usage error."""
    with open_capture(files / "dctl.h5") as d, open_capture(files / "ctl.h5") as p:
        assert d.meta["options"]["dither"] == 0 and "dither" not in p.meta["options"]
        keys = [r.key for r in d.rows if r.has_data and r.key.module == "model.norm"]
        assert keys and any(not np.array_equal(d.read(k), p.read(k)) for k in keys)
    code, _, err = run(["capture", "@tiny", "--plain-control", "-o", files / "x.h5"], capsys)
    assert code == 2 and "--plain-control goes with --control-for" in err
    assert not (files / "x.h5").exists()


def test_diff_with_a_control_names_the_fault_and_passes_the_clean_one(files, capsys):
    code, out, _ = run(["diff", files / "ref.h5", files / "fault.h5", "--control",
                        files / "ctl.h5"], capsys)
    assert code == 1
    assert out.startswith("FAIL: more than noise from step 0, model.layers.2.mlp.down_proj "
                          "(out.0)")
    assert "CULPRIT: step 0, model.layers.2.mlp.down_proj#0" in out
    assert "Control (more than noise?)" in out
    code, out, _ = run(["diff", files / "ref.h5", files / "fault.h5", "--control",
                        files / "ctl.h5", "--format", "json"], capsys)
    j = json.loads(out)
    assert j["culprit"]["module"] == "model.layers.2.mlp.down_proj"
    assert j["control"]["paths"] == [str(files / "ctl.h5")]
    assert j["control"]["flagged"][0]["site"] == "model.layers.2.mlp.down_proj#0:out.0"
    code, out, _ = run(["diff", files / "ref.h5", files / "clean.h5", "--control",
                        files / "ctl.h5"], capsys)
    assert code == 0 and out.startswith("PASS: ") and "within the noise of 1 control run" in out


def test_diff_refuses_a_control_that_does_not_follow_the_reference(files, tiny_dir, capsys):
    # a capture of other prompts
    code, _, _ = run(["capture", tiny_dir, "--prompt", "something else", "-o",
                      files / "other.h5"], capsys)
    assert code == 0
    code, _, err = run(["diff", files / "ref.h5", files / "clean.h5", "--control",
                        files / "other.h5"], capsys)
    assert code == 3 and "--control-for" in err and len(err.strip().splitlines()) == 1
    # -o must not be a control
    code, _, err = run(["diff", files / "ref.h5", files / "clean.h5", "--control",
                        files / "ctl.h5", "-o", files / "ctl.h5", "--force"], capsys)
    assert code == 2 and "--control #1" in err


def test_a_control_at_another_dtype_than_the_candidate_is_said(files, capsys):
    code, out, _ = run(["diff", files / "ref.h5", files / "fp32.h5", "--control",
                        files / "ctl.h5"], capsys)
    assert "control " in out and "computes in bfloat16, the candidate in float32" in out


def test_control_for_refuses_prompts_and_modes(files, tiny_dir, capsys):
    for extra in (["--prompt", "x"], ["--tokens-from", files / "ref.h5"],
                  ["--mode", "graph"]):
        code, _, err = run(["capture", tiny_dir, "--control-for", files / "ref.h5", "-o",
                            files / "nope.h5", *extra], capsys)
        assert code == 2 and "--control-for takes the prompts" in err
    assert not (files / "nope.h5").exists()


def test_rotary_tables_rounded_to_bf16_are_named_at_rotary_emb(files, tiny, capsys):
    """A candidate made by `.to(bfloat16)` of a float32 model rounds the rotary inv_freq
    buffer to bf16 (from_pretrained in bfloat16 keeps it float32, as the control did): every
    rotary table is about twice as wrong. Within the bf16 tolerance; the control names it."""
    from accucheck.capture.runners.hf import capture_model

    model, tok = tiny
    capture_model(model, PROMPTS, files / "cast.h5", tokenizer=tok, store="full",
                  max_new_tokens=2, dtype="bfloat16", tokens_from=str(files / "ref.h5"))
    code, out, _ = run(["diff", files / "ref.h5", files / "cast.h5", "--control",
                        files / "ctl.h5"], capsys)
    assert code == 1 and "model.rotary_emb (out." in out.splitlines()[0]
    assert "\nCULPRIT: step 0, " in out and "model.rotary_emb#0\n" in out
    code, out, _ = run(["diff", files / "ref.h5", files / "cast.h5"], capsys)
    assert "model.rotary_emb#0\n" not in out  # the tolerance alone does not see it


def test_control_auto_1_makes_one_control_beside_the_candidate_and_reuses_it(files, capsys,
                                                                             tmp_path):
    """`diff --control auto:1`: REF's meta names the model directory (here it exists), the
    candidate's dtype sets the control's; the control is written beside CAND, judged with, and
    reused on the next diff. A clash is refused in one line, nothing overwritten."""
    import shutil

    cand = tmp_path / "fault.h5"
    shutil.copy(files / "fault.h5", cand)
    code, out, err = run(["diff", files / "ref.h5", cand, "--control", "auto:1"], capsys)
    made = tmp_path / "fault.control.h5"
    assert code == 1 and made.is_file() and "control: capturing" in err
    assert not (tmp_path / "fault.control2.h5").exists()
    assert "more than noise" in out.splitlines()[0] and "model.layers.2.mlp.down_proj" in out
    with open_capture(made) as c:
        assert c.meta["dtype"] == "bfloat16" and c.meta["control_for"] == str(files / "ref.h5")
        assert c.meta["options"]["dither"] == 0  # the default control: dithered
    stamp = made.stat().st_mtime_ns
    code2, out2, err2 = run(["diff", files / "ref.h5", cand, "--control", "auto:1"], capsys)
    assert code2 == 1 and "control: using" in err2 and made.stat().st_mtime_ns == stamp
    assert out2.splitlines()[0] == out.splitlines()[0]
    # a file there that is not this reference's control: refused, untouched
    other = tmp_path / "clean.h5"
    shutil.copy(files / "clean.h5", other)
    shutil.copy(files / "fp32.h5", tmp_path / "clean.control.h5")
    code3, _, err3 = run(["diff", files / "ref.h5", other, "--control", "auto:1"], capsys)
    assert code3 == 3 and "is not a complete control of" in err3 and len(err3.splitlines()) == 1
    code4, _, err4 = run(["diff", files / "ref.h5", other, "--control", "auto", "--control",
                          files / "ctl.h5"], capsys)
    assert code4 == 2 and "give it alone" in err4


def test_control_auto_makes_two_dithered_controls_and_judges_with_both(files, capsys,
                                                                      tmp_path):
    """`--control auto` (as `auto:2`): CAND.control.h5 (seed 0) and CAND.control2.h5 (seed 1),
    both judged with (the rule takes the mean of their errors), reused on the next diff; a
    file in the second's place that is another seed's control is refused before anything is
    made."""
    import shutil

    cand = tmp_path / "fault.h5"
    shutil.copy(files / "fault.h5", cand)
    code, out, err = run(["diff", files / "ref.h5", cand, "--control", "auto"], capsys)
    one, two = tmp_path / "fault.control.h5", tmp_path / "fault.control2.h5"
    assert code == 1 and one.is_file() and two.is_file(), err
    assert "model.layers.2.mlp.down_proj" in out and f"(control {one}, {two})" in err
    with open_capture(one) as a, open_capture(two) as b:
        assert (a.meta["options"]["dither"], b.meta["options"]["dither"]) == (0, 1)
    code2, out2, err2 = run(["diff", files / "ref.h5", cand, "--control", "auto:2"], capsys)
    assert code2 == 1 and err2.count("control: using") == 2 and out2 == out
    other = tmp_path / "other.h5"
    shutil.copy(files / "fault.h5", other)
    shutil.copy(one, tmp_path / "other.control2.h5")  # seed 0's control where seed 1's goes
    code3, _, err3 = run(["diff", files / "ref.h5", other, "--control", "auto:2"], capsys)
    assert code3 == 3 and "(seed 1)" in err3 and not (tmp_path / "other.control.h5").exists()
    for bad in ("auto:0", "auto:x", "auto:4"):
        code4, _, err4 = run(["diff", files / "ref.h5", cand, "--control", bad], capsys)
        assert code4 == 2 and "use auto (two runs), auto:1, auto:2 or auto:3" in err4


def test_control_auto_without_the_model_here_says_where_to_make_it(files, capsys, tmp_path):
    import shutil

    cand = tmp_path / "cand.h5"
    shutil.copy(files / "fault.h5", cand)
    # clean.h5 was captured through the Python API: its meta names no model directory
    code, out, err = run(["diff", files / "clean.h5", cand, "--control", "auto"], capsys)
    assert code == 3 and out == "" and len(err.strip().splitlines()) == 1
    assert "names no model directory that exists here" in err and "--control-for" in err
    assert not (tmp_path / "cand.control.h5").exists()


def test_control_auto_of_a_reference_made_as_the_control_would_be_measures_noise(files, capsys,
                                                                                tmp_path):
    """A bf16 CPU eager reference: a plain control would compute exactly what it does (no
    noise measured, every difference 'more than noise'; it was refused). The dithered control
    differs from it by a device's rounding, and a candidate equal to the reference passes."""
    import shutil

    ref16 = tmp_path / "ref16.h5"
    code, _, _ = run(["capture", _tiny(files), "--prompt",
                      "one two three", "--dtype", "bfloat16", "-o", ref16], capsys)
    assert code == 0
    cand = tmp_path / "c.h5"
    shutil.copy(ref16, cand)
    code, out, err = run(["diff", ref16, cand, "--control", "auto"], capsys)
    assert code == 0 and out.startswith("PASS: "), out + err
    made = tmp_path / "c.control.h5"
    with open_capture(made) as c, open_capture(ref16) as r:
        theirs = {row.key: row.stats for row in r.rows}
        assert c.meta["options"]["dither"] == 0
        # the control is not the reference again (statistics store: its records' statistics)
        assert sum(row.stats != theirs[row.key] for row in c.rows) > len(c.rows) // 2


def _tiny(files):
    from accucheck.store import open_capture

    with open_capture(files / "ref.h5") as r:
        return r.meta["model_path"]
