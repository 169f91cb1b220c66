"""`accucheck replay`: recorded ops re-run from the file here and in float64 (per-op referee)."""
from __future__ import annotations

import json

import pytest

from accucheck.capture.runners.hf import capture_model
from accucheck.capture.faults import planted
from accucheck.cli import main
from accucheck.errors import UserError
from accucheck.replay import replay_ops

PROMPT = ["The quick brown fox"]
SILU = "*s0:model.layers.1.mlp.act_fn#0/aten.silu*"  # ops are named at their leaf module


@pytest.fixture(scope="module")
def faulty(tiny, tmp_path_factory):
    """A capture made on a 'device' whose layer-1 SiLU kernel computes in float16."""
    model, tok = tiny
    path = tmp_path_factory.mktemp("replay") / "npu.h5"
    with planted(model, "model.layers.1.mlp", "op:aten.silu:fp16"):
        capture_model(model, PROMPT, path, tokenizer=tok, level="op", store="full",
                      record_inputs=True,
                      include=("model.layers.1.mlp", "model.layers.1.input_layernorm"))
    return path


def test_referee_says_the_recorded_device_is_worse(faulty):
    r = replay_ops(faulty, [SILU])
    (o,) = r.ops
    assert o.ran and o.label == "ref worse"
    assert o.ref_vs_golden > 1e-4 and o.here_vs_golden < 1e-6
    assert o.here_vs_recorded == pytest.approx(o.ref_vs_golden, rel=0.01)
    assert r  # this device is not worse


def test_healthy_ops_replay_bit_exact_or_within_noise(faulty):
    r = replay_ops(faulty, ["*s0:model.layers.1.input_layernorm#0/*",
                            "*s0:model.layers.1.mlp.*_proj#0/aten.mm*"])
    assert len(r.ops) == 6 + 3
    for o in r.ops:
        assert o.ran and o.label == "both within noise", o
        assert o.here_vs_recorded < 1e-6
    # the elementwise ops are deterministic: bit-identical replay
    assert [o.here_vs_recorded for o in r.ops[:6]] == [0.0] * 6


def test_cli_replay(faulty, capsys):
    with pytest.raises(SystemExit) as e:
        main(["replay", str(faulty), "--op", SILU, "--format", "json"])
    assert e.value.code == 0
    j = json.loads(capsys.readouterr().out)
    assert j["verdict"] == "pass" and j["ops"][0]["label"] == "ref worse"
    with pytest.raises(SystemExit) as e:
        main(["replay", str(faulty), "--op", "*nothing*"])
    assert e.value.code == 3
    assert "matches" in capsys.readouterr().err


def test_replay_needs_op_records(tiny, tmp_path):
    model, tok = tiny
    capture_model(model, PROMPT, tmp_path / "m.h5", tokenizer=tok, store="full")
    with pytest.raises(UserError, match="--level op"):
        replay_ops(tmp_path / "m.h5")


def test_cli_replay_exits_1_when_this_device_is_worse(tiny, tmp_path, capsys):
    """A healthy recording replayed on a 'device' whose SiLU computes in float16 (planted here,
    float32 calls only: the float64 golden stays exact): `here worse`, exit 1, FAIL line."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from accucheck.capture.faults import _op_fault

    model, tok = tiny
    healthy = tmp_path / "gpu.h5"
    capture_model(model, PROMPT, healthy, tokenizer=tok, level="op", store="full",
                  record_inputs=True, include=("model.layers.1.mlp",))
    _, fp16 = _op_fault("op:aten.silu:fp16")

    class HereFp16Silu(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if str(func).startswith("aten.silu") and args[0].dtype == torch.float32:
                return fp16(func, args, kwargs)
            return func(*args, **kwargs)

    with HereFp16Silu(), pytest.raises(SystemExit) as e:
        main(["replay", str(healthy), "--op", SILU, "--format", "json"])
    assert e.value.code == 1
    j = json.loads(capsys.readouterr().out)
    (o,) = j["ops"]
    assert j["verdict"] == "fail" and o["label"] == "here worse"
    assert o["ref_vs_golden"] < 1e-6 < 1e-4 < o["here_vs_golden"]
    with HereFp16Silu(), pytest.raises(SystemExit) as e:
        main(["replay", str(healthy), "--op", SILU])
    out = capsys.readouterr().out
    assert e.value.code == 1 and out.startswith("FAIL: 1 of 1 op(s) compute further from float64")
    # the same recording replayed on a healthy device: exit 0
    with pytest.raises(SystemExit) as e:
        main(["replay", str(healthy), "--op", SILU])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("PASS: 1 op(s) replayed")
