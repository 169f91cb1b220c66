"""Shadow replay (`--shadow REF.h5`): local error per module, free of inherited error."""
from __future__ import annotations

import pytest

from accucheck.capture.runners.hf import capture_model
from accucheck.capture.faults import planted
from accucheck.errors import UserError
from accucheck.keys import layer_of
from accucheck.verdict.locate import analyze
from accucheck.store import open_capture

PROMPT = ["The quick brown fox"]


@pytest.fixture(scope="module")
def ref(tiny, tmp_path_factory):
    """float32 reference with inputs, one decode step."""
    model, tok = tiny
    path = tmp_path_factory.mktemp("shadow") / "ref.h5"
    return capture_model(model, PROMPT, path, tokenizer=tok, store="full", record_inputs=True,
                         max_new_tokens=1)


@pytest.fixture(scope="module")
def bf16(tiny, ref):
    model, tok = tiny
    path = ref.parent / "bf16.h5"
    return capture_model(model, PROMPT, path, tokenizer=tok, store="full", dtype="bfloat16",
                         max_new_tokens=1, shadow=str(ref))


def test_shadow_records_and_what_cannot_be_replayed(ref, bf16):
    with open_capture(bf16) as c:
        sh = {str(r.key) for r in c.rows if r.key.role == "shadow"}
        out = {str(r.key.with_role("shadow")) for r in c.rows if r.key.role == "out"
               and r.key.module != "logits"}
        counts = c.meta["shadow_replay"]  # what was replayed and what not, said in the file
    calls = {k.rsplit(":", 1)[0] for k in sh}  # one replay per call (rotary_emb: 2 outputs)
    skipped = {k.rsplit(":", 1)[0] for k in out - sh}
    assert counts["replayed"] == len(calls) and counts["skipped"] == len(skipped) > 0
    assert "r0.s0:model.rotary_emb#0:shadow.1" in sh
    step0 = {k for k in out if k.startswith("r0.s0:")}
    assert step0 <= sh  # every module call of the prefill is replayed
    # decode step: the KV cache of the reference is not recorded -> attention (and the layer
    # blocks that carry the cache) are not replayed; cache-free modules are
    assert "r0.s1:model.layers.0.mlp#0:shadow.0" in sh
    assert "r0.s1:model.layers.0.self_attn#0:shadow.0" not in sh
    assert "r0.s1:model.layers.0#0:shadow.0" not in sh


def test_bf16_candidate_local_errors_at_bf16_noise_no_layer_blamed(ref, bf16):
    a = analyze(ref, bf16)
    per_layer: dict[int, float] = {}
    for r in a.diff.records:
        if r.shadow is not None and r.key.step == 0 and layer_of(r.key.module) is not None:
            i = layer_of(r.key.module)
            per_layer[i] = max(per_layer.get(i, 0.0), r.shadow.rel_l2)
            # local error is bf16 rounding noise: above float32 noise, below bf16 tolerance
            assert r.shadow.rel_l2 < r.tolerance.rel_l2
    assert sorted(per_layer) == [0, 1, 2, 3]
    assert all(1e-4 < e < 2e-2 for e in per_layer.values()), per_layer
    assert max(per_layer.values()) / min(per_layer.values()) < 10  # no layer stands out
    # bf16 noise everywhere, nothing introduced: the diff passes and nobody is blamed
    assert a.verdict == "pass" and a.exit_code == 0
    assert a.culprit is None and a.location.first_divergence is None
    assert not [x for x in a.location.records if x.cause == "introduced"]


def test_planted_fault_blamed_by_local_error_only_in_its_module(tiny, ref, tmp_path):
    model, tok = tiny
    with planted(model, "model.layers.2.mlp", "scale:1.5"):
        capture_model(model, PROMPT, tmp_path / "f.h5", tokenizer=tok, store="full",
                      dtype="bfloat16", max_new_tokens=1, shadow=str(ref))
    a = analyze(ref, tmp_path / "f.h5")
    c = a.culprit
    assert (c.module, c.step) == ("model.layers.2.mlp", 0)
    assert c.module_local > c.tolerance
    later = [r for r in a.diff.records if r.shadow is not None and r.key.step == 0
             and layer_of(r.key.module) == 3]
    # layer 3 inherits a large error but introduces none of it
    assert later and all(not r.within for r in later if r.key.module == "model.layers.3")
    assert all(r.shadow.rel_l2 < r.tolerance.rel_l2 for r in later)


def test_op_level_shadow_names_the_op(tiny, tmp_path):
    model, tok = tiny
    opts = dict(level="op", store="full", record_inputs=True,
                include=("model.layers.1.mlp", "model.layers.2.mlp"))
    capture_model(model, PROMPT, tmp_path / "r.h5", tokenizer=tok, **opts)
    with planted(model, "model.layers.1.mlp", "op:aten.mm:bf16"):
        capture_model(model, PROMPT, tmp_path / "c.h5", tokenizer=tok,
                      shadow=str(tmp_path / "r.h5"), **opts)
    a = analyze(tmp_path / "r.h5", tmp_path / "c.h5")
    c = a.culprit
    # the first matmul of the MLP, named at its Linear (not selected: tracked for ops only)
    assert (c.module, c.op, c.local_basis) == ("model.layers.1.mlp.gate_proj", "aten.mm.default",
                                               "shadow")
    assert c.local_error > c.tolerance
    # layer 2's matmuls get a wrong input but compute it right: local error at float32 noise
    l2 = [r for r in a.diff.records if r.key.module.startswith("model.layers.2.mlp.")
          and r.key.op == "aten.mm.default" and r.key.role == "out"]
    assert len(l2) == 3 and all(not r.within for r in l2)
    assert all(r.shadow is not None and r.shadow.rel_l2 < 1e-5 for r in l2)


def test_shadow_needs_a_full_reference_with_inputs(tiny, tmp_path):
    model, tok = tiny
    capture_model(model, PROMPT, tmp_path / "s.h5", tokenizer=tok)
    with pytest.raises(UserError, match="--store full"):
        capture_model(model, PROMPT, tmp_path / "c.h5", tokenizer=tok,
                      shadow=str(tmp_path / "s.h5"))
    capture_model(model, PROMPT, tmp_path / "f.h5", tokenizer=tok, store="full")
    with pytest.raises(UserError, match="--inputs"):
        capture_model(model, PROMPT, tmp_path / "c2.h5", tokenizer=tok,
                      shadow=str(tmp_path / "f.h5"))


def test_cli_capture_level_op_with_shadow_then_diff(tiny_dir, tmp_path, capsys):
    from accucheck.cli import main

    base = ["capture", str(tiny_dir), "--prompt", PROMPT[0], "--level", "op", "--store",
            "full", "--include", "model.layers.0.mlp"]
    for argv in (base + ["-o", str(tmp_path / "r.h5"), "--inputs"],
                 base + ["-o", str(tmp_path / "c.h5"), "--shadow", str(tmp_path / "r.h5")]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 0
    with open_capture(tmp_path / "c.h5") as c:
        assert "r0.s0:model.layers.0.mlp.act_fn#0/aten.silu.default@0:shadow.0" in c
        assert c.meta["options"]["shadow"] == str(tmp_path / "r.h5")
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["diff", str(tmp_path / "r.h5"), str(tmp_path / "c.h5")])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith("PASS")
