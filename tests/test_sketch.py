"""The stats store's sketch (accucheck.store.sketch): every kernel computes the reference
definition, the estimate is as good as the theory says on the tensors where a sample is not,
and the control rule measures both sides with one measure."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from accucheck.capture.record.stats import StepStats, kernel_status
from accucheck.store import SAMPLE_SIZE, SKETCH_FLOOR, sample_positions, sketch_rel, sketch_row

KERNELS = ["c", "torch"] if kernel_status()["cpu"] == "c" else ["torch"]
SK = 8 + SAMPLE_SIZE  # the sketch row's place in a raw statistics row


def _rms_rel(a: np.ndarray, b: np.ndarray) -> float:
    """What the sketch estimates: the RMS of the log-scale differences (~ elementwise relative
    errors with |a| floored at c)."""
    e = math.floor(math.log2(SKETCH_FLOOR * math.sqrt(np.mean(a * a))))
    z = lambda x: np.copysign(np.log1p(np.abs(x) * 2.0 ** -e), x)  # noqa: E731
    return float(np.sqrt(np.mean((z(a) - z(b)) ** 2)))


def _heavy(n_tok: int, hidden: int, seed: int) -> np.ndarray:
    """Activations with a few massive channels, as a residual stream or a down_proj input."""
    g = np.random.default_rng(seed)
    x = g.standard_normal((n_tok, hidden))
    x[:, [7, 300]] *= 200.0
    return x


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("shape", [(1,), (100,), (128,), (3, 577), (70_000,), (2, 131_073)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_every_kernel_computes_the_reference_sketch(kernel, shape, dtype):
    """C and torch kernels, staged and large tensors, positions past 2**16 and 2**17."""
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 3).to(dtype)
    eng = StepStats(kernel=kernel, stage_numel_cpu=50_000)
    eng.add(x)
    eng.add(x * 2)
    raw = eng.compute()[0]
    for row, t in zip(raw, (x, x * 2)):
        want = sketch_row(t.double().numpy())
        assert row[SK] == want[0]
        np.testing.assert_allclose(row[SK + 1:], want[1:], rtol=1e-12, atol=1e-13 * t.numel() ** .5)


@pytest.mark.parametrize("kernel", KERNELS)
def test_no_sketch_with_a_nan_or_in_full_mode(kernel):
    x = torch.randn(1000)
    x[3] = float("inf")
    eng = StepStats(kernel=kernel)
    eng.add(x)
    assert np.isnan(eng.compute()[0][0, SK + 1:]).all()
    full = StepStats(kernel=kernel, keep=True)
    full.add(torch.randn(1000))
    assert np.isnan(full.compute()[0][0, SK:]).all()
    assert sketch_rel(np.full(129, np.nan), sketch_row(np.ones(4)), 4) is None


def test_a_tensor_of_up_to_128_elements_is_measured_exactly():
    a = np.random.default_rng(0).standard_normal(128)
    b = a * (1 + 1e-3 * np.random.default_rng(1).standard_normal(128))
    assert sketch_rel(sketch_row(a), sketch_row(b), 128) == pytest.approx(_rms_rel(a, b), rel=1e-9)


def test_the_sketch_measures_heavy_tailed_tensors_where_a_sample_does_not():
    """Over 200 pairs of heavy-tailed tensors with bf16-like relative noise: the sketch's
    estimate stays within 40 % of the exact measure (relative sd ~ 1 / sqrt(2 x 128)); the
    64-value sample's rel_l2 is off several-fold on some (it sees a massive channel or not)."""
    sk, smp = [], []
    for seed in range(200):
        a = _heavy(4, 576, seed)
        g = np.random.default_rng(1000 + seed)
        b = a * (1 + 4e-3 * g.standard_normal(a.shape))
        b[g.integers(0, 4), 7] *= 1.02  # one massive element moved: dominates rel_l2
        exact = _rms_rel(a, b)
        sk.append(sketch_rel(sketch_row(a), sketch_row(b), a.size) / exact)
        pos = sample_positions(a.size)
        fa, fb = a.ravel()[pos], b.ravel()[pos]
        true_l2 = np.linalg.norm(a - b) / np.linalg.norm(a)
        smp.append(np.linalg.norm(fa - fb) / np.linalg.norm(fa) / true_l2)
    sk, smp = np.log(sk), np.log(smp)
    assert np.abs(sk).max() < math.log(1.4) and abs(sk.mean()) < 0.02
    assert 0.04 < sk.std() < 0.09  # the theory's 1 / sqrt(2 x 128) = 0.0625
    assert np.abs(smp).max() > math.log(3)


def test_scales_that_differ_are_not_compared():
    a = np.full(256, 0.999)
    b = np.full(256, 1.001)  # its RMS crosses a power of two
    ra, rb = sketch_row(a), sketch_row(b)
    assert ra[0] != rb[0] and sketch_rel(ra, rb, 256) is None


def test_the_control_rule_measures_both_sides_from_their_sketches_or_both_from_samples(
        tiny, tmp_path):
    """Stats captures: each record's error and its controls' come from the sketches; with a
    control that holds no sketch (a full capture) every record falls back to the samples, never
    a sketch's RMS against a sample's mean (they differ several-fold)."""
    from accucheck.capture.faults import dithered
    from accucheck.capture.runners.hf import capture_model
    from accucheck.compare.diff import diff_captures

    model, tok = tiny
    paths = {}
    for name, store, dtype, seed in (("ref", "stats", "float32", None),
                                     ("cand", "stats", "bfloat16", 1),
                                     ("ctl", "stats", "bfloat16", 2),
                                     ("ctl-full", "full", "bfloat16", 2)):
        paths[name] = tmp_path / f"{name}.h5"
        with dithered(seed) if seed else _nothing():
            capture_model(model, ["hello world", "a b c d"], paths[name], tokenizer=tok,
                          store=store, dtype=dtype, max_new_tokens=2,
                          tokens_from=str(paths["ref"]) if name != "ref" else None)
    sk = diff_captures(paths["ref"], paths["cand"], controls=[paths["ctl"]])
    ctl = {str(r.key): r for r in diff_captures(paths["ref"], paths["ctl"]).records}
    judged = [r for r in sk.records if r.control is not None and r.kind == "module"]
    sketched = [r for r in judged if r.sketch is not None]
    # a random model's norms have unit weights: their outputs' RMS is ~1, where c's power of
    # two changes (those records are measured from their samples)
    assert len(sketched) > len(judged) / 2
    for r in judged:
        c = ctl[str(r.key)]
        want = c.sketch if r.sketch is not None and c.sketch is not None else c.metrics.mean_rel
        assert r.control == (want,)
        assert r.elem_error == (r.sketch if r.sketch is not None else r.metrics.mean_rel)
    mixed = diff_captures(paths["ref"], paths["cand"], controls=[paths["ctl-full"]])
    judged = [r for r in mixed.records if r.control is not None and r.kind == "module"]
    assert judged and all(r.sketch is None and r.elem_error == r.metrics.mean_rel
                          for r in judged)


def _nothing():
    from contextlib import nullcontext
    return nullcontext()


def test_a_device_without_float64_kernels_sketches_on_the_host(monkeypatch):
    """An accelerator whose float64 ops fail (some NPU kernels) gets its rows sketched on the
    CPU, from the first failure on, and the result moved back; the capture does not fail.
    "meta" stands for the accelerator: its tensors copy to the CPU (here: the values) and
    results move back to it."""
    import accucheck.capture.record.stats as st

    real, calls = st._sketch_device, []
    x = torch.randn(3, 500, dtype=torch.float64)

    def fake(t):
        calls.append(t.device.type)
        if t.device.type == "meta":
            raise RuntimeError("float64 not supported")
        return real(t)

    class OnAccelerator:
        shape, device = x.shape, torch.device("meta")

        def cpu(self):
            return x
    monkeypatch.setattr(st, "_sketch_device", fake)
    monkeypatch.setattr(st, "_sketch_on_host", set())
    for _ in range(2):
        out = st._sketch_rows(OnAccelerator())
        assert out.device.type == "meta" and tuple(out.shape) == (3, 1 + 128)
    assert calls == ["meta", "cpu", "cpu"] and st._sketch_on_host == {"meta"}
    want = np.stack([sketch_row(r) for r in x.numpy()])
    np.testing.assert_allclose(real(x).numpy(), want, atol=1e-12)
