"""Mixture of experts on the built-in tiny Qwen3-MoE (4 layers, 8 experts, top-2): routing
records, routing agreement, the first routing flip and its label, routing replay and
expert-level blame (accucheck.capture.record.moe, accucheck.compare.routing). The flips and their
margins are re-derived here from the files with numpy, not read back from the tool."""
from __future__ import annotations

import json
from contextlib import nullcontext

import numpy as np
import pytest

from accucheck.capture.runners.hf import capture_model
from accucheck.capture.faults import planted
from accucheck.errors import UserError
from accucheck.compare.routing import AFTER_FLIP, IDS, NEAR_TIE_SIGMAS, REORDERED
from accucheck.report.diff import render, to_json, verdict_line
from accucheck.store import open_capture
from accucheck.verdict.locate import analyze

PROMPTS = ["The quick brown fox jumps over the lazy dog",
           "Accuracy of large language models depends on every layer",
           "Greedy decoding picks the most likely token"]
STEPS = 2
GATE = "model.layers.{}.mlp.gate"


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from accucheck.capture.tiny import write_tiny_model

    d = write_tiny_model(tmp_path_factory.mktemp("moe") / "model", seed=0, arch="qwen3_moe")
    model = AutoModelForCausalLM.from_pretrained(d, local_files_only=True).eval()
    tok = AutoTokenizer.from_pretrained(d, local_files_only=True)
    out = tmp_path_factory.mktemp("moe-runs")
    cache = {}

    def cap(name, *, dtype=None, fault=None, routing_from=None, weights=False, store="full"):
        if name not in cache:
            with (planted(model, *fault) if fault else nullcontext()):
                capture_model(model, PROMPTS, out / f"{name}.h5", tokenizer=tok, store=store,
                              max_new_tokens=STEPS, dtype=dtype,
                              tokens_from=str(cache["ref"]) if "ref" in cache and
                              not routing_from else None,
                              routing_from=routing_from, routing_weights=weights)
            cache[name] = out / f"{name}.h5"
        return cache[name]

    cap("ref")
    return model, cap, d


def _flips(ref, cand):
    """Every (key, token, ref set, cand set) whose expert set differs, in execution order
    (step, request, order), from the files."""
    out = []
    with open_capture(ref) as R, open_capture(cand) as C:
        rows = sorted((r for r in R.rows if r.key.slot == "2" and r.key.module.endswith(".gate")),
                      key=lambda r: (r.key.step, r.key.req, r.order))
        for row in rows:
            a, b = np.sort(R.read(row.key), 1), np.sort(C.read(row.key), 1)
            for t in np.flatnonzero((a != b).any(1)):
                out.append((row.key, int(t), a[t].tolist(), b[t].tolist()))
    return out


def _margin(ref, cand, key, token, ra, ca):
    logits = str(key).replace(":out.2", ":out.0")
    with open_capture(ref) as R, open_capture(cand) as C:
        lr, lc = R.read(logits)[token].astype(float), C.read(logits)[token].astype(float)
    dropped, taken = [e for e in ra if e not in ca], [e for e in ca if e not in ra]
    margin = lr[dropped].min() - lr[taken].max()
    noise = np.std(np.delete(lc - lr, dropped + taken))
    return margin, noise


def test_identical_runs_agree_on_every_token(moe):
    _, cap, _ = moe
    a = analyze(cap("ref"), cap("again"))
    r = a.diff.routing
    assert r is not None and r.agreement == 1.0 and r.flipped == 0 and r.first_flip is None
    assert len(r.routers) == 4 and r.tokens == sum(
        x["tokens"] for x in r.per_router())
    assert a.exit_code == 0 and a.culprit is None
    j = to_json(a)["routing"]
    assert j["agreement"] == 1.0 and j["first_flip"] is None and len(j["per_router"]) == 4
    # the ids records are judged as routing, not as numbers, and nothing is left out
    ids = [x for x in a.diff.records if x.key.slot == "2" and x.key.module.endswith("gate")]
    assert ids and all(x.routing == IDS and x.rows_excluded == 0 for x in ids)
    assert not any(x.routing in (AFTER_FLIP, REORDERED) for x in a.diff.records)


def test_routing_records_keep_their_values_in_stats_mode(moe):
    _, cap, _ = moe
    with open_capture(cap("stats", store="stats")) as r:
        assert r.store_mode == "stats"
        routed = [x for x in r.rows if x.key.module.endswith(".mlp.gate")]
        assert {x.key.slot for x in routed} == {"0", "1", "2"}
        assert all(x.has_data for x in routed)
        assert not any(x.has_data for x in r.rows  # the top-k logits are kept too
                       if not x.key.module.endswith(".mlp.gate") and not x.key.is_logits)
        assert set(r.meta["moe"]["routers"]) == {GATE.format(i) for i in range(4)}
    a = analyze(cap("ref"), cap("stats"))
    assert a.diff.routing.agreement == 1.0  # routing judged from a stats capture too


def test_a_shifted_router_logit_gives_the_exact_first_flip_labelled_real(moe):
    """One router adds 0.3 to expert 3's logit (a kernel with a wrong bias): the tokens whose
    margin to expert 3 is below 0.3 flip, and the other experts' logits do not move, so each
    flip is real however small its margin; the router is the culprit."""
    _, cap, _ = moe
    ref, cand = cap("ref"), cap("shift", fault=(GATE.format(1), "router:3:0.3"))
    expected = _flips(ref, cand)
    assert expected
    key, token, ra, ca = expected[0]
    a = analyze(ref, cand)
    f = a.diff.routing.first_flip
    assert (str(f.key), f.token, list(f.ref_experts), list(f.cand_experts)) == \
        (str(key), token, ra, ca)
    assert key.module == GATE.format(1) and 3 in ca and 3 not in ra
    margin, noise = _margin(ref, cand, key, token, ra, ca)
    assert f.margin == pytest.approx(margin) and f.noise == pytest.approx(noise, abs=1e-12)
    assert noise < 1e-6 < margin and f.label == "real"
    assert a.exit_code == 1 and a.culprit.module == GATE.format(1)
    assert "MoE routing:" in verdict_line(a) and "(real: margin" in verdict_line(a)


def test_rounding_noise_gives_a_near_tie_flip_and_no_culprit(moe):
    """A bfloat16 candidate whose layer-1 router adds noise of std 0.03 (within the bf16
    tolerance of its logits): one token flips at a margin within the noise: a near-tie.
    The records after it compare other experts' computations: not judged; PASS."""
    _, cap, _ = moe
    ref = cap("ref")
    cand = cap("noisy", dtype="bfloat16", fault=(GATE.format(1), "router:noise:0.03"))
    expected = _flips(ref, cand)
    assert expected
    key, token, ra, ca = expected[0]
    a = analyze(ref, cand)
    f = a.diff.routing.first_flip
    assert (str(f.key), f.token) == (str(key), token)
    margin, noise = _margin(ref, cand, key, token, ra, ca)
    assert margin <= NEAR_TIE_SIGMAS * np.sqrt(2) * noise and f.label == "near-tie"
    after = [x for x in a.diff.records if x.routing == AFTER_FLIP]
    assert after and all((x.key.req, x.key.step) >= (key.req, key.step) for x in after)
    assert all(x.key.req == key.req for x in after)
    # the flip's own MoE block is compared on the tokens routed alike
    block = next(x for x in a.diff.records if str(x.key) == str(key).replace(
        ".gate#0:out.2", "#0:out.0"))
    assert block.routing == "masked" and block.rows_excluded == 1
    assert a.exit_code == 0 and a.culprit is None
    line = verdict_line(a)
    assert line.startswith("PASS: ") and "near-tie" in line and "--routing-from" in line


def test_replay_makes_a_flipped_run_comparable_again(moe):
    """The near-tie candidate again, with --routing-from the reference: no flip, and the
    records that were after the flip are compared and within the bf16 tolerance."""
    _, cap, _ = moe
    ref = cap("ref")
    noisy = cap("noisy", dtype="bfloat16", fault=(GATE.format(1), "router:noise:0.03"))
    replayed = cap("noisy-replayed", dtype="bfloat16", routing_from=str(ref),
                   fault=(GATE.format(1), "router:noise:0.03"))
    before, after = analyze(ref, noisy), analyze(ref, replayed)
    skipped = {str(x.key): x.error for x in before.diff.records if x.routing == AFTER_FLIP}
    now = {str(x.key): x for x in after.diff.records}
    assert after.diff.routing.flipped == 0 and after.diff.routing.forced["from"] == str(ref)
    assert not any(x.routing in (AFTER_FLIP, REORDERED) for x in after.diff.records)
    assert all(now[k].within for k in skipped)
    worst_before = max(skipped.values())
    worst_after = max(now[k].error for k in skipped)
    # measured here: 0.126 before (the flipped token's own rows), 0.038 after
    assert worst_before > 0.05 > worst_after, (worst_before, worst_after)
    assert after.exit_code == 0
    with open_capture(replayed) as r:
        assert r.meta["routing_forced"]["calls"] == 4 * len(PROMPTS) * (STEPS + 1)


@pytest.mark.parametrize("replay", [False, True])
def test_a_fault_in_one_expert_is_named_at_that_expert(moe, replay):
    """Expert 5 of layer 2 outputs 1.5x what it should, in a bfloat16 candidate against the
    float32 reference: named model.layers.2.mlp.experts[5], with and without replay."""
    _, cap, _ = moe
    ref = cap("ref")
    fault = ("model.layers.2.mlp.experts", "expert:5:scale:1.5")
    cand = cap(f"expert5-{replay}", dtype="bfloat16", fault=fault,
               routing_from=str(ref) if replay else None)
    a = analyze(ref, cand)
    c = a.culprit
    assert c is not None and c.module == "model.layers.2.mlp.experts" and c.expert == 5, \
        verdict_line(a)
    assert c.where.startswith("model.layers.2.mlp.experts[5]#0")
    assert "down_proj" in c.expert_part
    text = render(a)
    assert "CULPRIT: step 0, model.layers.2.mlp.experts[5]#0" in text
    assert to_json(a)["culprit"]["named"] == "model.layers.2.mlp.experts[5]"
    blame = a.diff.routing.blame_for("model.layers.2.mlp.experts", 0)
    ratios = blame.ratios()
    assert ratios[0][1] == 5 and ratios[0][0] > 2 * ratios[1][0]


def test_a_gate_projection_fault_in_one_expert_is_seen_at_act_fns_input(moe):
    """Expert 5's gate rows of gate_up_proj scaled by 1.2 in the candidate (a weight-layout
    bug): the error shows at act_fn's input (rows of expert 5), made by code of the experts
    module; named experts[5] and its gate_up_proj. The weights check says so too."""
    import torch

    model, cap, _ = moe
    w = model.model.layers[2].mlp.experts.gate_up_proj
    half = w.shape[1] // 2
    with torch.no_grad():
        w[5, :half] *= 1.2
    try:
        cand = cap("gate5", routing_from=str(cap("ref")))
    finally:
        with torch.no_grad():
            w[5, :half] /= 1.2
    a = analyze(cap("ref"), cand)
    c = a.culprit
    assert c.module == "model.layers.2.mlp.experts" and c.expert == 5, verdict_line(a)
    assert c.seen_at is not None and c.seen_at.module.endswith("experts.act_fn")
    assert c.expert_part.startswith("gate_up_proj")
    assert any("model.layers.2.mlp.experts.gate_up_proj" in n for n in a.diff.notes)


def test_a_dense_model_has_no_routing(tiny, tmp_path):
    model, tok = tiny
    ref, cand = tmp_path / "r.h5", tmp_path / "c.h5"
    for p in (ref, cand):
        capture_model(model, PROMPTS[:1], p, tokenizer=tok, store="full", max_new_tokens=1)
    a = analyze(ref, cand)
    assert a.diff.routing is None and not any("MoE" in n for n in a.diff.notes)
    assert all(x.routing is None for x in a.diff.records)
    assert to_json(a)["routing"] is None and "MoE routing" not in render(a)
    with open_capture(ref) as r:
        assert r.meta["moe"] is None and "routing_forced" not in r.meta


@pytest.mark.parametrize("arch", ["qwen2_moe", "mixtral", "deepseek_v2"])
def test_other_moe_architectures_are_recorded_and_replayed(arch, tmp_path):
    """Qwen2-MoE (a shared expert), Mixtral, DeepSeek-V2 (MLA, a dense first layer): routers
    found, routing recorded, and a replay of a noisy router gives the reference's ids."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from accucheck.capture.record.moe import find_routers
    from accucheck.capture.tiny import write_tiny_model

    d = write_tiny_model(tmp_path / "m", seed=1, arch=arch)
    model = AutoModelForCausalLM.from_pretrained(d, local_files_only=True).eval()
    tok = AutoTokenizer.from_pretrained(d, local_files_only=True)
    routers = find_routers(model)
    first = 1 if arch == "deepseek_v2" else 0
    assert [r.gate for r in routers] == [GATE.format(i) for i in range(first, 4)]
    ref, cand = tmp_path / "r.h5", tmp_path / "c.h5"
    capture_model(model, PROMPTS[:2], ref, tokenizer=tok, store="stats", max_new_tokens=1)
    with planted(model, routers[0].gate, "router:noise:0.5"):
        capture_model(model, PROMPTS[:2], cand, tokenizer=tok, store="stats", max_new_tokens=1,
                      routing_from=str(ref))
    with open_capture(ref) as R, open_capture(cand) as C:
        for row in R.rows:
            if row.key.slot == "2" and row.key.module.endswith(".gate"):
                assert np.array_equal(R.read(row.key), C.read(row.key)), row.key
    assert analyze(ref, cand).diff.routing.agreement == 1.0


def test_routing_replay_refusals(moe, tiny, tmp_path, capsys):
    from accucheck.cli import main

    _, cap, d = moe
    ref = str(cap("ref"))
    def run(*args) -> int:
        with pytest.raises(SystemExit) as e:
            main([str(a) for a in args])
        return e.value.code

    base = ["capture", d, "--prompt", "hello there", "-o", tmp_path / "x.h5"]
    assert run(*base, "--routing-weights") == 2
    assert run(*base, "--routing-from", ref, "--mode", "graph") == 2
    assert run(*base, "--routing-from", ref, "--runner", "vllm") == 2
    err = capsys.readouterr().err
    assert "--routing-weights goes with --routing-from" in err and "Traceback" not in err
    # a dense model has no router to replay (exit 3, nothing written)
    dense = tmp_path / "dense.h5"
    model, tok = tiny
    capture_model(model, ["hello there"], dense, tokenizer=tok)
    with pytest.raises(UserError) as e:
        capture_model(model, ["hello there"], tmp_path / "y.h5", tokenizer=tok,
                      routing_from=str(dense))
    assert "no MoE router" in str(e.value) and not (tmp_path / "y.h5").exists()
    # a reference of the MoE model without routing records (its routers not selected): exit 3
    moe_model, _, _ = moe
    bare = tmp_path / "bare.h5"
    from transformers import AutoTokenizer

    capture_model(moe_model, ["hello there"], bare, include=("*self_attn",),
                  tokenizer=AutoTokenizer.from_pretrained(d, local_files_only=True))
    assert run("capture", d, "--prompt", "hello there", "--routing-from", bare,
               "-o", tmp_path / "z.h5") == 3
    err = capsys.readouterr().err
    assert "has no routing record" in err and not (tmp_path / "z.h5").exists()


@pytest.mark.slow
def test_moe_signoff_names_the_expert_and_shows_routing(tmp_path):
    """scenarios/tiny-moe.toml: bf16 candidate, routing replayed, expert 5 of layer 2 faulty:
    FAIL naming model.layers.2.mlp.experts[5]; routing checks and table in the report."""
    from pathlib import Path

    from accucheck.signoff.run import signoff
    from accucheck.signoff.scenario import load_scenario

    scn = load_scenario(Path(__file__).resolve().parents[1] / "scenarios" / "tiny-moe.toml")
    res = signoff(scn, out_dir=tmp_path / "report")
    assert not res.passed and res.culprit.startswith("model.layers.2.mlp.experts[5]")
    names = {c.name: c for c in res.checks}
    assert names["routing_agreement"].passed and names["routing_agreement"].value == 1.0
    assert names["real_routing_flips"].passed
    doc = json.loads((tmp_path / "report" / "report.json").read_text())
    assert doc["routing"]["agreement"] == 1.0 and doc["routing"]["forced"]["weights"] is False
    assert len(doc["routing"]["per_router"]) == 4
    md = (tmp_path / "report" / "report.md").read_text()
    assert "## MoE routing" in md and "model.layers.3.mlp.gate" in md


def test_routing_thresholds_gate_a_signoff(moe):
    """routing_agreement fails below its limit; real_routing_flips counts only flips that are
    not near-ties (the shifted router's, not the noisy one's)."""
    from accucheck.signoff.run import headline, judge
    from accucheck.signoff.scenario import scenario_from_dict

    _, cap, _ = moe
    ref = cap("ref")
    scn = scenario_from_dict({"name": "moe", "prompts": PROMPTS,
                              "thresholds": {"routing_agreement": 0.999}})
    noisy = analyze(ref, cap("noisy", dtype="bfloat16",
                             fault=(GATE.format(1), "router:noise:0.03")))
    m = headline(noisy, (0, 0))
    checks = {c.name: c for c in judge(scn, noisy, m, None)}
    assert m.routing_agreement == noisy.diff.routing.agreement < 0.999
    assert not checks["routing_agreement"].passed and checks["real_routing_flips"].passed
    shifted = analyze(ref, cap("shift", fault=(GATE.format(1), "router:3:0.3")))
    m = headline(shifted, (0, 0))
    checks = {c.name: c for c in judge(scn, shifted, m, None)}
    assert m.real_routing_flips >= 1 and not checks["real_routing_flips"].passed
    assert "(real: margin" in checks["real_routing_flips"].detail


def test_scenario_routing_replay_is_checked():
    from accucheck.signoff.scenario import scenario_from_dict

    s = scenario_from_dict({"name": "m", "model": "@tiny-moe", "prompts": ["a"],
                            "candidate": {"routing_replay": True}})
    assert s.candidate.routing_replay and not s.reference.routing_replay
    assert s.model == "@tiny-moe"
    for bad, msg in (({"reference": {"routing_replay": True}}, "is for the candidate"),
                     ({"candidate": {"routing_replay": True, "runner": "vllm"}},
                      "needs runner = \"hf\""),
                     ({"candidate": {"routing_replay": True, "teacher_forcing": False}},
                      "teacher_forcing")):
        with pytest.raises(UserError) as e:
            scenario_from_dict({"name": "m", "prompts": ["a"], **bad})
        assert msg in str(e.value), str(e.value)


def test_a_control_past_its_own_routing_flip_gives_those_records_no_noise(moe):
    """A control run whose own routing flipped (the noisy-router bf16 run) measures other
    experts' computations after its flip: those records get no control value (the control
    rule does not judge them), the others do."""
    from accucheck.compare.diff import diff_captures

    _, cap, _ = moe
    ref = cap("ref")
    ctl = cap("noisy", dtype="bfloat16", fault=(GATE.format(1), "router:noise:0.03"))
    cand = cap("bf16", dtype="bfloat16")
    after = {str(r.key) for r in diff_captures(ref, ctl).records if r.routing == AFTER_FLIP}
    d = diff_captures(ref, cand, controls=[ctl])
    assert after and all(r.control is None for r in d.records if str(r.key) in after)
    assert sum(r.control is not None for r in d.records) > len(d.records) // 2
