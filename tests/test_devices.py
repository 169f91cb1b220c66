"""Two correct devices never raise an alarm, on the real SmolLM2-135M (30 layers) in bf16:
candidates emulated as structurally different correct devices (accucheck.capture.emulate: a
fused-kernel GPU, an NPU with other rounding choices, a per-layer mix, a dither), against a
float32 and a bfloat16 CPU reference, without a control, in both store modes: exit 0, no
culprit, no SUSPICIOUS record. And the power kept: a down_proj fault planted inside the
fused-kernel candidate at x4 its natural noise is named exactly without a control, and at x2
with one; an attention-core fault at x2 inside its flash-style attention with two. Slow: CI runs it (`-m ""`); bench/bench_devices.py measures the rates."""
from __future__ import annotations

from contextlib import nullcontext

import pytest

from accucheck.capture.runners.hf import capture_model
from accucheck.capture.emulate import DEVICES, emulated
from accucheck.capture.faults import planted
from accucheck.report.diff import verdict_line
from accucheck.verdict.locate import analyze
from planting import fault, natural_noise, size_fault

pytestmark = pytest.mark.slow

PROMPTS = ["def fibonacci(n):", "The capital of France is", "Once upon a time, a small robot",
           "Q: What is 17 times 23?\nA:"]


@pytest.fixture(scope="module")
def cap(smollm2, tmp_path_factory):
    model, tok = smollm2
    d = tmp_path_factory.mktemp("devices")

    def capture(name, store="full", *, device=None, seed=0, dtype="bfloat16", fault_=None,
                include=()):
        path = d / f"{name}-{store}.h5"
        if not path.exists():
            ref = None if name == "ref32" else capture("ref32", store, dtype="float32")
            # sdpa attention, transformers' default (the fixture loads eager: reset it here)
            model.set_attn_implementation("sdpa")
            try:
                with (emulated(model, device, seed) if device else nullcontext()), \
                        (planted(model, *fault_) if fault_ else nullcontext()):
                    capture_model(model, PROMPTS, path, tokenizer=tok, store=store, dtype=dtype,
                                  max_new_tokens=2, include=include,
                                  tokens_from=str(ref) if ref else None)
            finally:
                model.set_attn_implementation("eager")
        return path
    return capture


@pytest.mark.parametrize("store", ["stats", "full"])
@pytest.mark.parametrize("device", DEVICES)
def test_two_correct_devices_raise_no_alarm_without_a_control(cap, device, store):
    cand = cap(device, store, device=device, seed=7)
    for ref in (cap("ref32", store, dtype="float32"), cap("ref16", store)):
        a = analyze(ref, cand)
        assert a.exit_code == 0 and a.culprit is None, (ref.name, a.location.first_divergence)
        assert a.location.suspicious == ()
        assert "--control-for REF" in verdict_line(a)


def _sized(cap, kind: str, layer: int, s: float) -> tuple[float, str, str]:
    """(strength D of `kind` at `layer` sized to s x its record's natural noise in the full
    store against two dithered controls, the site it shows at, the module to name)."""
    ref = cap("ref32", dtype="float32")
    controls = [cap(f"ctl{i}", device="dither", seed=100 + i) for i in range(2)]
    _, site, expect = fault(kind, layer, 0.0)

    def calibration(name, planted_, include):
        return cap(name, dtype="float32", fault_=planted_, include=include)
    return (size_fault(calibration, ref, kind, layer, s, natural_noise(ref, controls, site)),
            site, expect)


def test_a_fault_inside_a_fused_kernel_device_is_named(cap):
    ref = cap("ref32", dtype="float32")
    controls = [cap(f"ctl{i}", device="dither", seed=100 + i) for i in range(2)]
    for s, with_control in ((4.0, False), (2.0, True)):
        d, _, expect = _sized(cap, "linear", 14, s)
        cand = cap(f"gpu-linear-{s}", device="gpu", seed=7, fault_=fault("linear", 14, d)[0])
        a = analyze(ref, cand, controls=controls[:1] if with_control else ())
        assert a.culprit is not None and a.culprit.module == expect, (s, a.location)
        assert a.exit_code == 1


def test_an_attention_core_fault_inside_the_flash_style_device_is_named(cap):
    """The attention core (between q/k/v_proj and o_proj, code no record covers) with its
    softmax scale off (attn:scale), sized to x2 its natural noise against the sdpa float32
    reference, planted inside the gpu device's flash-style attention, default store, two
    controls (what `diff --control auto` makes): named as self_attn, seen at o_proj's input.
    The fault reaches sdpa's fused kernel (op:aten._softmax:inscale did not: sized to NaN)."""
    d, site, expect = _sized(cap, "core", 14, 2.0)
    assert 0 < d < 1, d
    cand = cap("gpu-core-2", "stats", device="gpu", seed=7, fault_=fault("core", 14, d)[0])
    ctl_s = [cap(f"ctl{i}", "stats", device="dither", seed=100 + i) for i in range(2)]
    a = analyze(cap("ref32", "stats", dtype="float32"), cand, controls=tuple(ctl_s))
    assert a.culprit is not None and a.culprit.module == expect, a.location.noise.flagged
    assert str(a.culprit.seen_at).endswith(site) and a.exit_code == 1


def test_in_the_stats_store_a_silu_fault_is_named_at_the_silu_not_at_what_it_feeds(cap):
    """The default store with one control: the control rule measures both sides from their
    sketches (accucheck.store.sketch). A SiLU fault at x2 its natural noise inside the npu-like
    device: from the 64-value sample it was missed (x1.21 against x1.30 needed); from a sketch
    flooring |x| at a tenth of the RMS it was blamed on the down_proj it feeds. The same
    device without the fault stays clean against the same control."""
    d, _, expect = _sized(cap, "act", 4, 2.0)
    ref_s, ctl_s = cap("ref32", "stats", dtype="float32"), cap("ctl0", "stats", device="dither",
                                                               seed=100)
    cand = cap("npu-act-2", "stats", device="npu", seed=7, fault_=fault("act", 4, d)[0])
    a = analyze(ref_s, cand, controls=(ctl_s,))
    assert a.culprit is not None and a.culprit.module == expect, a.location.noise.flagged
    clean = analyze(ref_s, cap("npu", "stats", device="npu", seed=7), controls=(ctl_s,))
    assert clean.culprit is None and clean.location.noise.flagged == (), \
        clean.location.noise.flagged


def test_the_default_control_is_dithered_so_a_one_ulp_device_stays_quiet(cap, smollm2):
    """The control `capture --control-for` makes is dithered (CaptureOptions.dither): against
    it the dithered device (correct to one ULP, not round-to-nearest) raises nothing. Against
    the CPU's plain bf16 run, the control made until now, it is flagged where its rounding shows
    bare: layer 0's input_layernorm, whose input (the embedding) is exact on every side; so in
    all 100 clean pairs of bench/bench_devices.py (column "plain control")."""
    model, tok = smollm2
    ref, cand = cap("ref32", "stats", dtype="float32"), cap("dither", "stats", device="dither",
                                                            seed=7)
    ctl = ref.with_name("product-control-stats.h5")
    model.set_attn_implementation("sdpa")
    try:
        capture_model(model, PROMPTS, ctl, tokenizer=tok, store="stats", dtype="bfloat16",
                      max_new_tokens=2, tokens_from=str(ref), dither=3)
    finally:
        model.set_attn_implementation("eager")
    quiet = analyze(ref, cand, controls=(ctl,))
    assert quiet.exit_code == 0 and quiet.location.noise.flagged == (), \
        quiet.location.noise.flagged
    plain = analyze(ref, cand, controls=(cap("ref16", "stats"),))
    assert plain.culprit is not None, plain.location.noise
    assert plain.culprit.module == "model.layers.0.input_layernorm"
