"""Graph mode's observer effect (accucheck.capture.record.graph, accucheck.compare.observer): the
default kernel-boundary taps leave the compiled bfloat16 model's logits bitwise unchanged, a
module selection's taps do not and the capture says by how much, the file's logits are the
untapped run's, and `diff` eager vs graph names where graph mode starts to compute otherwise.

The fast tests need no compile; the slow ones compile the tiny Llama with inductor (about a
minute each on 2 cores)."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from accucheck.capture.options import CaptureOptions

from accucheck.capture.runners.hf import capture_dir, capture_model
from accucheck.capture.record.graph import ObserverCheck, Tap, boundary_taps, logits_effect
from accucheck.capture.record.selection import default_modules
from accucheck.cli import cli
from accucheck.compare.observer import (OBSERVER_NOTE_FRACTION, describe, observer_effect,
                                        observer_notes)
from accucheck.store import open_capture

PROMPT = ["The capital of France is a city with a long history"]


# -- taps, without compiling ----------------------------------------------------------------
def _taps(model):
    ids = torch.tensor([[1, 5, 9, 13, 17]])
    return boundary_taps(model, default_modules(model),
                         lambda: model(input_ids=ids, use_cache=False))


def test_boundary_taps_name_each_linear_input_after_its_producer(tiny):
    model, _ = tiny
    taps = {(t.hook, t.where): t for t in _taps(model)}
    L0 = "model.layers.0"
    # q_proj reads input_layernorm's output: recorded under the norm's name; k / v_proj read
    # the same tensor: no second tap
    assert taps[(f"{L0}.self_attn.q_proj", "in")] == \
        Tap(f"{L0}.self_attn.q_proj", "in", f"{L0}.input_layernorm", "out")
    assert (f"{L0}.self_attn.k_proj", "in") not in taps
    assert (f"{L0}.self_attn.v_proj", "in") not in taps
    # the attention output and act(gate) * up come from no module: the Linear's own "in"
    assert taps[(f"{L0}.self_attn.o_proj", "in")] == \
        Tap(f"{L0}.self_attn.o_proj", "in", f"{L0}.self_attn.o_proj", "in")
    assert taps[(f"{L0}.mlp.down_proj", "in")] == \
        Tap(f"{L0}.mlp.down_proj", "in", f"{L0}.mlp.down_proj", "in")
    assert taps[(f"{L0}.mlp.gate_proj", "in")].module == f"{L0}.post_attention_layernorm"
    assert (f"{L0}.mlp.up_proj", "in") not in taps
    # lm_head: its input is the final norm's output; its output is the logits record
    assert taps[("lm_head", "in")] == Tap("lm_head", "in", "model.norm", "out")
    assert ("lm_head", "out") not in taps
    n_linear = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert sum(t.where == "out" for t in taps.values()) == n_linear - 1


def test_boundary_taps_keys_are_keys_of_an_eager_capture(tiny, tmp_path):
    """What a graph capture records under a name is what an eager capture records under it:
    the taps' records, taken in eager mode, equal the eager capture's records bitwise."""
    from accucheck.capture.record.recorder import Recorder
    from accucheck.store import CaptureWriter

    model, tok = tiny
    eager = capture_model(model, PROMPT, tmp_path / "e.h5", tokenizer=tok, store="full")
    taps = _taps(model)
    ids = tok(PROMPT[0])["input_ids"]
    w = CaptureWriter(tmp_path / "t.h5", meta={"mode": "graph"}, store="full")
    rec = Recorder(model, w, [t.module for t in taps], graph=True, taps=taps)
    with rec.hooks(), torch.no_grad():
        rec.begin_step(0, 0)
        model(input_ids=torch.tensor([ids]), use_cache=False)
        n = rec.end_step()
    w.set_request(0, ids, [], PROMPT[0])
    w.close(complete=True)
    with open_capture(eager) as e, open_capture(tmp_path / "t.h5") as t:
        assert n == len(t.rows) == len(taps) > 40
        for row in t.rows:
            assert row.key in e, str(row.key)
            np.testing.assert_array_equal(t.read(row.key), e.read(row.key), str(row.key))


def test_logits_effect_is_kl_of_the_untapped_from_the_tapped():
    ref = torch.tensor([[4.0, 0.0, 0.0]])
    obs = torch.tensor([[0.0, 4.0, 0.0]])
    e = logits_effect(ref, obs)
    p = torch.softmax(ref.double(), -1)
    q = torch.softmax(obs.double(), -1)
    assert e["kl"] == pytest.approx(float((p * (p / q).log()).sum()), rel=1e-12)
    assert e["rel_l2"] == pytest.approx(math.sqrt(32) / 4, rel=1e-12)
    assert e["argmax_changed"] == 1 and not e["bitwise"]
    # asymmetric: the other direction is another number
    ref2 = torch.tensor([[2.0, 0.0, -3.0]])
    obs2 = torch.tensor([[0.0, 1.0, 0.5]])
    assert logits_effect(ref2, obs2)["kl"] != pytest.approx(logits_effect(obs2, ref2)["kl"])
    same = logits_effect(ref, ref.clone())
    assert same == {"rel_l2": 0.0, "kl": 0.0, "argmax_changed": 0, "bitwise": True}


def test_observer_check_records_the_untapped_logits_and_the_worst_step():
    chk = ObserverCheck("selection")
    outs = iter([torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0, 1.0]]),
                 torch.tensor([[1.0, 2.5]]), torch.tensor([[3.0, 1.0]])])
    fwd = chk.watch(lambda **_: type("O", (), {"logits": next(outs)})())
    fwd(); chk.keep(0, 0)   # untapped step 0
    fwd(); chk.keep(0, 1)   # untapped step 1
    fwd(); got0 = chk.compare(0, 0)
    fwd(); got1 = chk.compare(0, 1)
    assert torch.equal(got0, torch.tensor([[1.0, 2.0]])) and torch.equal(got1, torch.tensor([[3.0, 1.0]]))
    m = chk.meta()
    assert [s["bitwise"] for s in m["steps"]] == [False, True] and not m["bitwise"]
    assert m["max_rel_l2"] == pytest.approx(0.5 / math.sqrt(5)) and m["argmax_changed"] == 0
    with pytest.raises(RuntimeError, match="request 0 step 2"):
        chk.compare(0, 2)


def test_observer_notes_say_it_when_it_matters():
    def meta(e, bitwise=False):
        return {"mode": "graph", "observer_effect": {
            "measured": True, "taps": "selection", "bitwise": bitwise, "max_rel_l2": e,
            "max_kl": 1e-5, "argmax_changed": 0}}
    eager = {"mode": "eager"}
    assert observer_notes(eager, eager, 0.02) == []
    loud = observer_notes(eager, meta(0.01), 0.02)
    assert len(loud) == 1 and loud[0].startswith("OBSERVER EFFECT: cand's taps") \
        and "50 % of the logits difference" in loud[0]
    # at most 1 % of the judged difference (the documented OBSERVER_NOTE_FRACTION): said, not
    # loud; just over it: loud
    assert OBSERVER_NOTE_FRACTION == 0.01
    quiet = observer_notes(meta(1.98e-4), eager, 0.02)
    assert len(quiet) == 1 and quiet[0].startswith("observer effect of ref (graph mode): rel L2")
    assert observer_notes(meta(2.02e-4), eager, 0.02)[0].startswith("OBSERVER EFFECT: ref's")
    # without a logits difference to compare with, any effect is loud
    assert observer_notes(eager, meta(1e-9), None)[0].startswith("OBSERVER EFFECT: cand's")
    assert "more than the logits difference" in observer_notes(eager, meta(1e-9), None)[0]
    # exactly at 1 %: not over it
    assert observer_notes(eager, meta(0.01 * 0.02), 0.02)[0].startswith("observer effect of")
    # bitwise: quiet, also with no logits difference to compare with
    for d in (0.02, None):
        assert observer_notes(eager, meta(0.0, bitwise=True), d) == [
            "observer effect of cand (graph mode): none (the tapped logits equal the untapped "
            "ones bitwise; taps: selection)"]
    assert describe({**meta(0.01)["observer_effect"], "argmax_changed": 2}) == \
        "rel L2 1.00e-02, KL 1.00e-05, 2 argmax change(s) (taps: selection)"
    assert describe(meta(0.01)["observer_effect"]) == "rel L2 1.00e-02, KL 1.00e-05 (taps: " \
        "selection)"
    # the meta summary leaves the per-step rows out
    m = meta(0.01)
    m["observer_effect"]["steps"] = [{"request": 0, "step": 0}]
    assert "steps" not in observer_effect(m) and observer_effect(m)["max_rel_l2"] == 0.01
    old = observer_notes(eager, {"mode": "graph"}, 0.02)
    assert old == ["observer effect of cand (graph mode) not measured (captured before "
                   "accucheck measured it): its layer records may come from another program "
                   "than its logits"]
    # both sides in graph mode: one note each, the unmeasured one first
    both = observer_notes({"mode": "graph"}, meta(0.01), 0.02)
    assert len(both) == 2 and both[0].startswith("observer effect of ref (graph mode) not "
                                                 "measured") and "cand's taps" in both[1]
    assert describe(None) == ""


# -- compiled: the tiny Llama in bfloat16 -----------------------------------------------------
@pytest.fixture(scope="module")
def bf16_runs(tiny_dir, tmp_path_factory):
    torch._dynamo.reset()
    d = tmp_path_factory.mktemp("graph")
    base = dict(dtype="bfloat16", store="full", max_new_tokens=1)
    eager = capture_dir(tiny_dir, PROMPT, d / "eager.h5", CaptureOptions(**base))
    graph = capture_dir(tiny_dir, PROMPT, d / "graph.h5",
                        CaptureOptions(mode="graph", tokens_from=str(eager), **base))
    sel = capture_dir(tiny_dir, PROMPT, d / "sel.h5",
                      CaptureOptions(mode="graph", tokens_from=str(eager),
                                     include=("model.layers.*",), **base))
    return eager, graph, sel


@pytest.mark.slow
def test_default_taps_leave_the_compiled_bf16_logits_bitwise_unchanged(bf16_runs):
    _, graph, _ = bf16_runs
    with open_capture(graph) as g:
        oe = g.meta["observer_effect"]
        assert g.meta["graph_taps"] == "boundaries" and oe["taps"] == "boundaries"
        assert oe["measured"] and oe["bitwise"] and oe["max_rel_l2"] == 0.0
        assert [(s["request"], s["step"]) for s in oe["steps"]] == [(0, 0), (0, 1)]
        assert g.meta["compile_stats"]["graph_breaks"] == 0
        assert "model.layers.0.input_layernorm" in g.meta["modules"]
        assert "r0.s0:model.layers.0.self_attn.o_proj#0:in.0" in g


@pytest.mark.slow
def test_selection_taps_move_the_logits_and_the_file_keeps_the_untapped_ones(bf16_runs):
    _, graph, sel = bf16_runs
    with open_capture(sel) as s, open_capture(graph) as g:
        oe = s.meta["observer_effect"]
        assert s.meta["graph_taps"] == "selection" and not oe["bitwise"]
        assert 1e-3 < oe["max_rel_l2"] < 0.1 and oe["max_kl"] > 0
        # both files' logits are the same untapped compiled run's: bitwise equal
        logits = [r.key for r in s.rows if r.kind == "logits"]
        assert len(logits) == 2
        for k in logits:
            np.testing.assert_array_equal(s.read(k), g.read(k))


@pytest.mark.slow
def test_diff_eager_vs_graph_names_where_graph_mode_starts_and_states_the_effect(bf16_runs,
                                                                                 tmp_path):
    eager, graph, sel = bf16_runs
    res = CliRunner().invoke(cli, ["diff", str(eager), str(graph)])
    assert res.exit_code == 0, res.output
    # layer 0's norm and q/k/v_proj agree bitwise; the attention core inside self_attn (the
    # rotary embedding and attention, fused by inductor) is where graph mode starts to differ
    assert ("First difference: step 0, model.layers.0.self_attn.o_proj (in.0): rel_l2 "
            in res.output)
    assert "made by code of model.layers.0.self_attn that no record covers" in res.output
    assert "NOTE: observer effect of cand (graph mode): none (the tapped logits equal the " \
           "untapped ones bitwise; taps: boundaries)" in res.output
    doc = json.loads(CliRunner().invoke(cli, ["diff", str(eager), str(graph), "--format",
                                              "json"]).stdout)
    fd = doc["first_difference"]
    assert (fd["module"], fd["role"], fd["step"]) == ("model.layers.0.self_attn.o_proj", "in", 0)
    loud = CliRunner().invoke(cli, ["diff", str(eager), str(sel)])
    assert "NOTE: OBSERVER EFFECT: cand's taps moved its compiled logits by rel L2 " in loud.output
    ins = CliRunner().invoke(cli, ["inspect", str(sel)])
    assert "observer effect  rel L2 " in ins.output and "(taps: selection)" in ins.output


def test_cli_observer_check_flag_reaches_the_capture(monkeypatch, tmp_path):
    import accucheck.capture.runners.hf as api

    seen = []

    def fake(model_dir, prompts, out, opts, **kw):
        seen.append(opts.observer_check)
        return out
    monkeypatch.setattr(api, "capture_dir", fake)
    base = ["capture", "@tiny", "--mode", "graph", "--prompt", "hi"]
    for extra, n in (([], 0), (["--no-observer-check"], 1), (["--observer-check"], 2)):
        res = CliRunner().invoke(cli, base + extra + ["-o", str(tmp_path / f"{n}.h5")])
        assert res.exit_code == 0, res.output
    assert seen == [True, False, True]
