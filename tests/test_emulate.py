"""Emulated correct devices (accucheck.capture.emulate) on the tiny model: each computes the
same function as the CPU (only the rounding differs), leaves nothing behind, refuses to emulate
a norm it does not compute; and against each one, a diff without a control raises no alarm in
either store mode (issue 33: two correct devices never raise an alarm). The same on the real
SmolLM2 is tests/test_devices.py (slow)."""
from __future__ import annotations

import copy

import pytest
import torch

from accucheck.capture.runners.hf import capture_model
from accucheck.capture.emulate import DEVICES, emulated
from accucheck.errors import UserError
from accucheck.verdict.locate import analyze

PROMPTS = ["one two three four five", "the quick brown fox"]


def _logits(model, ids, dtype):
    m = copy.deepcopy(model).to(dtype)  # the fixture's model is shared: never cast it
    with torch.no_grad():
        return m(torch.tensor([ids])).logits.float()


@pytest.mark.parametrize("device", DEVICES)
def test_an_emulated_device_computes_the_same_function(tiny, device):
    model, tok = tiny
    ids = tok(PROMPTS[0])["input_ids"]
    ref = _logits(model, ids, torch.float32)
    with emulated(model, device, seed=1):
        got32 = _logits(model, ids, torch.float32)
        got16 = _logits(model, ids, torch.bfloat16)
    cpu16 = _logits(model, ids, torch.bfloat16)
    rel = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
    assert rel(got32, ref) < 1e-5                      # float32: a few ULPs of the CPU's
    assert rel(got16, ref) < 3 * max(rel(cpu16, ref), 1e-3)  # bf16: as close as the CPU's bf16
    if device != "dither":  # it computes otherwise, not the CPU's bits
        assert not torch.equal(got16, cpu16)


def test_emulation_leaves_nothing_behind(tiny):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    import transformers.models.llama.modeling_llama as ml

    model, _ = tiny
    rotary = ml.apply_rotary_pos_emb
    hooks = sum(len(m._forward_hooks) for m in model.modules())
    local = dict(ALL_ATTENTION_FUNCTIONS._local_mapping)
    with pytest.raises(RuntimeError, match="boom"):
        with emulated(model, "mixed"):
            assert ml.apply_rotary_pos_emb is not rotary
            raise RuntimeError("boom")
    assert ml.apply_rotary_pos_emb is rotary
    assert sum(len(m._forward_hooks) for m in model.modules()) == hooks
    assert dict(ALL_ATTENTION_FUNCTIONS._local_mapping) == local


def test_a_norm_of_another_formula_is_refused_not_emulated_wrong():
    class GemmaLikeRMSNorm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.full((8,), 0.5))
            self.eps = 1e-6

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1 + self.weight)

    m = torch.nn.Sequential(GemmaLikeRMSNorm())
    m.config = type("C", (), {"_attn_implementation": "eager"})()
    with emulated(m, "gpu"), pytest.raises(UserError, match="does not compute GemmaLikeRMSNorm"):
        m(torch.randn(2, 8))
    with pytest.raises(UserError, match="unknown emulated device"):
        with emulated(m, "tpu"):
            pass


@pytest.fixture(scope="module")
def tiny_runs(tiny, tmp_path_factory):
    model, tok = tiny
    d = tmp_path_factory.mktemp("emulate")

    def cap(name, store, *, device=None, dtype="bfloat16", ref=None):
        path = d / f"{name}-{store}.h5"
        if not path.exists():
            ctx = emulated(model, device, seed=3) if device else _null()
            with ctx:
                capture_model(model, PROMPTS, path, tokenizer=tok, store=store, dtype=dtype,
                              max_new_tokens=2, tokens_from=str(ref) if ref else None)
        return path
    return cap


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("store", ["stats", "full"])
@pytest.mark.parametrize("device", DEVICES)
def test_no_alarm_between_correct_devices_without_a_control(tiny_runs, store, device):
    ref32 = tiny_runs("ref32", store, dtype="float32")
    ref16 = tiny_runs("ref16", store, ref=ref32)
    cand = tiny_runs(device, store, device=device, ref=ref32)
    for ref in (ref32, ref16):  # fp32 reference against bf16, and bf16 against bf16
        a = analyze(ref, cand)
        assert a.exit_code == 0 and a.culprit is None, (ref.name, a.location.first_divergence)
        assert a.location.suspicious == ()
