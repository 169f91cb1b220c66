"""Capture less, on purpose (issue 36): `capture --positions last:N | decode`, `--requests`,
`--layers`; what each capture holds, how `diff` compares captures of other selections, and the
inputs that refuse a partial capture (impact, --shadow)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from accucheck.cli import main
from accucheck.store import Selection, open_capture

PROMPTS = ["The quick brown fox jumps over the lazy dog", "Accuracy of large models",
           "one two three four five six seven"]


def run(args, capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in args])
    out, err = capsys.readouterr()
    return e.value.code, out, err


def _capture(tiny, path, fault=None, **kw):
    from accucheck.capture.faults import planted
    from accucheck.capture.runners.hf import capture_model

    model, tok = tiny
    kw = dict(tokenizer=tok, max_new_tokens=2, **kw)
    if fault is None:
        return capture_model(model, PROMPTS, path, **kw)
    with planted(model, *fault):
        return capture_model(model, PROMPTS, path, **kw)


@pytest.fixture(scope="module")
def caps(tiny, tmp_path_factory):
    d = tmp_path_factory.mktemp("sel")
    _capture(tiny, d / "whole.h5", store="full")
    _capture(tiny, d / "last3.h5", store="full", positions="last:3")
    _capture(tiny, d / "part.h5", positions="last:3", requests=(1, 2), layers="0-1")
    _capture(tiny, d / "decode.h5", positions="decode")
    _capture(tiny, d / "whole_stats.h5")
    return d


def _last(a: np.ndarray, n: int) -> np.ndarray:
    """The last n positions of a prefill tensor: axis 1 after a batch axis of 1."""
    return a[:, -n:] if a.ndim >= 2 and a.shape[0] == 1 else a[-n:]


def test_last_positions_are_the_whole_captures_last_positions_exactly(caps):
    with open_capture(caps / "whole.h5") as w, open_capture(caps / "last3.h5") as c:
        assert [str(r.key) for r in c.rows] == [str(r.key) for r in w.rows]
        cut = 0
        for r in c.rows:
            a, b = w.read(r.key), c.read(r.key)
            if r.key.step == 0 and a.shape != b.shape:
                a = _last(a, 3)
                cut += 1
            np.testing.assert_array_equal(a, b, err_msg=str(r.key))
        logits0 = [r for r in c.rows if r.key.is_logits and r.key.step == 0]
        assert {r.shape[1] for r in logits0} == {3}
        assert all(r.shape[1] == 1 for r in c.rows if r.key.step > 0 and r.key.is_logits)
        assert cut > 30 * len(PROMPTS)
        # the prompts and tokens stay whole
        assert [q.prompt_ids.tolist() for q in c.requests] == \
            [q.prompt_ids.tolist() for q in w.requests]
        assert Selection.of(c.meta) == Selection("last:3")


def test_requests_and_layers_record_only_what_they_name(caps):
    with open_capture(caps / "part.h5") as p, open_capture(caps / "whole_stats.h5") as w:
        assert {r.key.req for r in p.rows} == {1, 2}
        assert len(p.requests) == 3  # every request ran; its tokens are kept
        layers = {int(r.key.module.split(".")[2]) for r in p.rows
                  if r.key.module.startswith("model.layers.")}
        assert layers == {0, 1}
        assert any(r.key.module == "model.embed_tokens" for r in p.rows)
        assert any(r.key.is_logits for r in p.rows)
        cov = p.meta["coverage"]
        assert cov["ok"] and cov["requests"] == 2
        # the statistics of a selected record are the whole capture's where nothing is cut
        a = w.row("r1.s1:model.layers.1.mlp.down_proj#0:out.0").stats
        b = p.row("r1.s1:model.layers.1.mlp.down_proj#0:out.0").stats
        assert a == b


def test_decode_only_records_no_prefill(caps):
    with open_capture(caps / "decode.h5") as d:
        assert {r.key.step for r in d.rows} == {1, 2}
        assert d.meta["coverage"]["ok"] and d.meta["coverage"]["steps"] == 2


def test_diff_of_other_positions_compares_the_common_positions_and_says_so(caps, capsys):
    code, out, _ = run(["diff", caps / "whole.h5", caps / "last3.h5", "--format", "json"],
                       capsys)
    doc = json.loads(out)
    assert code == 0 and doc["verdict"] == "pass"
    assert not doc["missing"]
    assert any("recorded: ref everything; cand prefill positions last:3" in n
               for n in doc["notes"])
    # statistics of other positions do not compare: those prefill records are left out
    code, out, _ = run(["diff", caps / "whole_stats.h5", caps / "part.h5"], capsys)
    assert code == 0
    assert "prefill records not compared: the captures record other prefill positions" in out
    assert "records one side did not select are not missing" in out
    code, out, _ = run(["diff", caps / "whole_stats.h5", caps / "decode.h5"], capsys)
    assert code == 0 and "cand decode steps only" in out


def test_a_fault_is_named_from_the_last_positions(tiny, caps, tmp_path, capsys):
    _capture(tiny, tmp_path / "fault.h5", fault=("model.layers.2.mlp.act_fn", "act:slope:0.05"),
             store="full", positions="last:3", tokens_from=str(caps / "whole.h5"))
    code, out, _ = run(["diff", caps / "last3.h5", tmp_path / "fault.h5", "--format", "json"],
                       capsys)
    doc = json.loads(out)
    assert code == 1
    assert doc["culprit"]["module"] == "model.layers.2.mlp.act_fn"
    # and against the whole reference, on the positions both hold
    code, out, _ = run(["diff", caps / "whole.h5", tmp_path / "fault.h5", "--format", "json"],
                       capsys)
    assert code == 1 and json.loads(out)["culprit"]["module"] == "model.layers.2.mlp.act_fn"


def test_a_control_takes_the_references_selection(tiny_dir, caps, tmp_path, capsys):
    code, _, err = run(["capture", tiny_dir, "--control-for", caps / "part.h5", "--dtype",
                        "bfloat16", "-o", tmp_path / "ctl.h5"], capsys)
    assert code == 0, err
    with open_capture(tmp_path / "ctl.h5") as c:
        assert Selection.of(c.meta) == Selection("last:3", (1, 2), "0-1")
    code, out, _ = run(["diff", caps / "part.h5", caps / "part.h5", "--control",
                        tmp_path / "ctl.h5"], capsys)
    assert code == 0, out


@pytest.mark.parametrize("args, code, text", [
    (["--positions", "last:0"], 2, "--positions 'last:0': use all, decode or last:N"),
    (["--positions", "first:2"], 2, "--positions 'first:2'"),
    (["--layers", "3-1"], 2, "--layers '3-1': use layer numbers and ranges"),
    (["--requests", "a"], 2, "--requests 'a': use request numbers and ranges"),
    (["--requests", "4"], 3, "--requests 4: the run has 2 request(s), numbered 0 to 1"),
])
def test_selection_misuse_is_one_line(tiny_dir, tmp_path, capsys, args, code, text):
    got, out, err = run(["capture", tiny_dir, "--prompt", "a b c", "--prompt", "d e", *args,
                         "-o", tmp_path / "x.h5"], capsys)
    assert got == code and text in err
    assert "Traceback" not in err and not (tmp_path / "x.h5").exists()


def test_a_partial_capture_cannot_serve_impact_or_shadow(tiny_dir, caps, tmp_path, capsys):
    code, _, err = run(["impact", caps / "last3.h5", tiny_dir], capsys)
    assert code == 3 and "it records part of the run (prefill positions last:3)" in err
    code, _, err = run(["capture", tiny_dir, "--shadow", caps / "whole.h5", "--positions",
                        "last:2", "-o", tmp_path / "s.h5"], capsys)
    assert code == 2 and "--shadow replays modules on whole inputs" in err


@pytest.mark.slow
def test_a_signoff_of_the_last_positions_names_the_planted_fault(tmp_path):
    """A sign-off at production settings records less: positions / requests in the scenario
    reach every run (the golden's and the reference's diffs compare like with like) and the
    planted fault is still named."""
    from accucheck.signoff.run import signoff

    scn = tmp_path / "sel.toml"
    scn.write_text(
        'model = "@tiny"\nprompts = ["The quick brown fox jumps over the lazy dog", '
        '"Accuracy of large language models"]\nmax_new_tokens = 2\nstore = "full"\n'
        'positions = "last:3"\nrequests = "1"\n[candidate]\n'
        'fault = { module = "model.layers.2.post_attention_layernorm", kind = "bf16" }\n')
    res = signoff(scn, out_dir=tmp_path / "report", progress=lambda _m: None)
    assert res.exit_code == 1 and res.culprit == "model.layers.2.post_attention_layernorm#0"
    doc = json.loads((tmp_path / "report" / "report.json").read_text())
    with open_capture(tmp_path / "report" / doc["runs"]["golden"]["capture"]) as g:
        assert Selection.of(g.meta) == Selection("last:3", (1,))
        assert {r.key.req for r in g.rows} == {1}


def test_op_records_of_other_positions_are_left_out_not_called_fused(tiny, tmp_path, capsys):
    """Ops pair by their output shapes (compare.opmatch): a prefill's ops of other positions
    would all look "fused or absent". They are left out with a note; their modules compare."""
    _capture(tiny, tmp_path / "ops.h5", store="full", level="op")
    _capture(tiny, tmp_path / "ops2.h5", store="full", level="op", positions="last:2")
    code, out, _ = run(["diff", tmp_path / "ops.h5", tmp_path / "ops2.h5", "--format", "json"],
                       capsys)
    doc = json.loads(out)
    assert code == 0 and doc["verdict"] == "pass"
    assert any("op records of the prefill are not compared" in n for n in doc["notes"])
    assert not any("op calls on one side only" in n for n in doc["notes"])
    assert any(r["key"].startswith("r0.s1:") and "/aten." in r["key"]
               for r in doc["records"])
