"""Capture cost: the statistics engine (accucheck.capture.record.stats) gives tensor_stats' numbers
in few kernels, counted here so that it cannot regress silently; one tensor recorded twice is
reduced (and stored) once; in-place changes after a hook do not reach the statistics."""
from __future__ import annotations

import collections
import json

import h5py
import numpy as np
import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

import accucheck.capture.record.stats as stats_mod
from accucheck.capture.record.recorder import Recorder
from accucheck.capture.record.stats import tensor_stats, to_host
from accucheck.capture.record.selection import select_modules
from accucheck.capture.record.stats import RAW_SIZE, StepStats, kernel_status
from accucheck.store import SKETCH_WIDTH
from accucheck.store import CaptureWriter, open_capture

KERNELS = ["c", "torch"] if kernel_status()["cpu"] == "c" else ["torch"]
SKETCH = RAW_SIZE - SKETCH_WIDTH  # the sketch row's first column: its exponent
EXACT = [0, 1, 4, 5, 6, 7] + list(range(8, SKETCH + 1))  # min, max, counts, checksum, sample,
                                                        # the sketch's exponent


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = []
    for dt in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        for shape in ((1,), (3,), (63,), (64,), (1, 16, 256), (5, 7), (1000,), (2049,),
                      (300, 700)):
            out.append((torch.randn(shape, generator=g) * 3).to(dt))
        t = torch.randn(100, 70, generator=g).to(dt)
        t[3, 4], t[5, 5], t[6, 6] = float("nan"), float("inf"), float("-inf")
        t[0, :5], t[1, 1] = 0, -0.0
        out.append(t)
        out.append(torch.randn(40, 30, generator=g).to(dt).t())  # not contiguous
        out.append(torch.zeros(2048, dtype=dt))
    out += [torch.arange(10), torch.zeros(0), torch.ones(3, dtype=torch.bool), torch.tensor(2.5)]
    return out


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("keep", [False, True])
@pytest.mark.parametrize("limits", [{}, {"stage_bytes": 50_000, "stage_numel_cpu": 5000}])
def test_engine_gives_tensor_stats_numbers(kernel, keep, limits):
    """min, max, the NaN / Inf / zero counts, the checksum, the 64 samples and the sketch's
    scale exactly; sum and L2 to float32 rounding, the sketch's buckets to float64 rounding
    (other summation orders). `limits` forces the early reduction of
    staged rows and the at-once reduction of large tensors on the torch path."""
    ts = _tensors()
    ref = np.stack([tensor_stats(t).numpy() for t in ts])
    eng = StepStats(kernel=kernel, keep=keep, **limits)
    for t in ts:
        eng.add(t)
    raw, hosts = eng.compute()
    assert raw.shape == ref.shape
    for i, t in enumerate(ts):
        exact = EXACT[:-1] if keep else EXACT
        np.testing.assert_array_equal(raw[i, exact], ref[i, exact], err_msg=f"{t.dtype} {t.shape}")
        np.testing.assert_allclose(raw[i, 2:4], ref[i, 2:4], rtol=2e-5, atol=1e-3 * t.numel() ** .5,
                                   err_msg=f"{t.dtype} {t.shape}")
        if keep:  # full mode: no sketch (the tensors are stored)
            assert np.isnan(raw[i, SKETCH:]).all()
            continue
        np.testing.assert_allclose(raw[i, SKETCH + 1:], ref[i, SKETCH + 1:], rtol=1e-12,
                                   atol=1e-13 * t.numel() ** .5, err_msg=f"{t.dtype} {t.shape}")
    if keep:
        for h, t in zip(hosts, ts):
            want = to_host(t)[0]
            assert h.dtype == want.dtype and h.shape == want.shape
            np.testing.assert_array_equal(h, want)
    else:
        assert hosts == []
    # the engine is ready for the next step, and a second step gives the same rows
    for t in ts:
        eng.add(t)
    np.testing.assert_array_equal(eng.compute()[0], raw)


def test_the_c_kernel_sums_at_least_as_well_as_torch():
    if "c" not in KERNELS:
        pytest.skip(f"no C compiler here: {kernel_status()}")
    t = torch.randn(300_000, generator=torch.Generator().manual_seed(1)) * 3
    exact = t.double()
    raw = StepStats(kernel="c").now(t)
    assert abs(raw[2] - exact.sum().item()) <= abs(t.sum().item() - exact.sum().item()) + 1e-9
    assert raw[3] == pytest.approx(exact.norm().item(), rel=1e-9)  # float64 lanes


def test_kernel_status_says_what_the_cpu_uses(monkeypatch):
    monkeypatch.setattr(stats_mod, "_kernel_state", {})
    monkeypatch.setenv("ACCUCHECK_STATS_KERNEL", "torch")
    assert kernel_status() == {"cpu": "torch", "why": "ACCUCHECK_STATS_KERNEL=torch"}
    assert StepStats().kernel == "torch"


# -- kernels per record ----------------------------------------------------------------------
# aten ops that launch no kernel: views and metadata, allocations
_NO_KERNEL = {"aten::view", "aten::as_strided", "aten::unsqueeze", "aten::squeeze",
              "aten::select", "aten::slice", "aten::detach", "aten::alias", "aten::lift_fresh",
              "aten::resolve_conj", "aten::resolve_neg", "aten::empty", "aten::empty_strided",
              "aten::new_empty", "aten::expand", "aten::t", "aten::transpose", "aten::reshape",
              "aten::_unsafe_view", "aten::permute", "aten::unbind", "aten::to",
              "aten::contiguous"}


def _is_kernel(e) -> bool:
    return e.name.startswith("aten::") and e.name not in _NO_KERNEL


def _kernels(fn) -> collections.Counter:
    """The kernels `fn` launches: aten ops that do work (no view / metadata / allocation op),
    counted where they run (an op whose work is done by nested aten ops, aten::to ->
    aten::copy_, counts as those)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return collections.Counter(e.name for e in prof.events()
                               if _is_kernel(e) and not any(map(_is_kernel, e.cpu_children)))


def _recorder_ops(model, tmp_path, kernel: str, store: str = "stats", steps: int = 3):
    """(kernels the recorder adds to one forward (hooks + end_step), records per forward):
    the profile of a captured forward minus that of the same forward with the hooks paused."""
    ids = torch.randint(0, model.config.vocab_size, (1, 16),
                        generator=torch.Generator().manual_seed(0))
    w = CaptureWriter(tmp_path / f"{kernel}-{store}.h5", meta={}, store=store)
    rec = Recorder(model, w, select_modules(model), stats_kernel=kernel)
    n = [0]

    def plain():
        rec._pause += 1
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
        rec._pause -= 1

    def captured():
        rec.begin_step(n[0], 0)
        with torch.no_grad():
            out = model(input_ids=ids, use_cache=False)
        rec.end_step(out.logits)
        n[0] += 1

    with rec.hooks():
        for _ in range(steps):  # staging buffers reach their steady size
            captured()
        before = w.n_records
        extra = _kernels(captured) - _kernels(plain)
    w.close()
    return extra, w.n_records - before


def test_c_kernel_statistics_launch_no_torch_kernel(tiny, tmp_path):
    """CPU, C kernel: one C call per distinct tensor, no torch kernel per record."""
    if "c" not in KERNELS:
        pytest.skip(f"no C compiler here: {kernel_status()}")
    model, _ = tiny
    extra, records = _recorder_ops(model, tmp_path, "c")
    assert records == 69
    assert sum(extra.values()) == 0, extra
    eng = StepStats(kernel="c")
    calls = []
    fn = eng._c[torch.float32]

    def counted(*args):
        calls.append(args[1])
        return fn(*args)
    eng._c = {torch.float32: counted}
    for t in (torch.randn(4, 5), torch.randn(3)):
        eng.add(t)
    assert calls == [20, 3] and len(eng.compute()[0]) == 2


def test_torch_path_statistics_cost_a_copy_per_record(tiny, tmp_path, monkeypatch):
    """Accelerators (and CPUs without a C compiler): per record one staging copy; the
    reductions run once per staging buffer (one per dtype and size: 5 here), whatever the
    number of records in it (about 20 kernels for the statistics and the sample, 25 for the
    sketch); one transfer per step."""
    model, _ = tiny
    transfers = []
    real = stats_mod._transfer
    monkeypatch.setattr(stats_mod, "_transfer", lambda x: transfers.append(x.shape) or real(x))
    extra, records = _recorder_ops(model, tmp_path, "torch")
    groups = 5  # float32 tensors of 512, 2048, 4096, 8192 and 16384 (logits) elements
    staged = records - 8  # self_attn / mlp outputs reuse o_proj / down_proj's row
    total = sum(extra.values())
    assert total <= staged + 50 * groups, extra
    # 3 warm-up steps + the profiled one (the paused forward stages nothing): one transfer
    # per step, none per record
    assert len(transfers) == 4, transfers


def test_full_mode_costs_one_copy_per_record(tiny, tmp_path):
    if "c" not in KERNELS:
        pytest.skip(f"no C compiler here: {kernel_status()}")
    model, _ = tiny
    extra, records = _recorder_ops(model, tmp_path, "c", store="full")
    # self_attn / mlp outputs are o_proj / down_proj's tensors: not copied again
    assert extra == {"aten::copy_": records - 8}, extra


# -- one tensor, one reduction, one dataset -----------------------------------------------
def test_a_tensor_recorded_twice_is_stored_once(tiny, tmp_path):
    """o_proj's output IS self_attn's, down_proj's IS mlp's: one dataset each, and the file
    is smaller than the activations its records hold (seq 64)."""
    model, _ = tiny
    ids = torch.randint(0, 1024, (1, 64), generator=torch.Generator().manual_seed(0))
    path = tmp_path / "a.h5"
    w = CaptureWriter(path, meta={}, store="full")
    rec = Recorder(model, w, select_modules(model))
    with rec.hooks():
        rec.begin_step(0, 0)
        with torch.no_grad():
            out = model(input_ids=ids, use_cache=False)
        rec.end_step(out.logits)
    w.close()
    with open_capture(path) as r:
        inner = r.row("r0.s0:model.layers.1.self_attn.o_proj#0:out.0")
        outer = r.row("r0.s0:model.layers.1.self_attn#0:out.0")
        assert inner.data == outer.data and inner.stats == outer.stats
        np.testing.assert_array_equal(r.read(inner.key), r.read(outer.key))
        names = [row.data for row in r.rows]
        assert len(set(names)) == len(names) - 8  # self_attn and mlp in each of 4 layers
        held = sum(int(np.prod(row.shape)) * 4 for row in r.rows)
    with h5py.File(path) as f:
        assert len(f["tensors"]) == len(set(names))
    assert path.stat().st_size < held


class _Bump(nn.Module):
    """A child whose output the parent changes in place after the child returned."""

    def __init__(self):
        super().__init__()
        self.child = nn.Linear(4, 4)

    def forward(self, x):
        y = self.child(x)
        y.mul_(2)  # after the child's hooks ran: the child's record must not see it
        return y


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("store", ["stats", "full"])
def test_statistics_are_taken_before_later_in_place_changes(tmp_path, kernel, store):
    torch.manual_seed(0)
    m = _Bump().eval()
    x = torch.randn(3, 4)
    with torch.no_grad():
        before = m.child(x)
    path = tmp_path / "a.h5"
    w = CaptureWriter(path, meta={}, store=store)
    rec = Recorder(m, w, ["child"], stats_kernel=kernel)
    with rec.hooks():
        rec.begin_step(0, 0)
        with torch.no_grad():
            m(x)
        rec.end_step()
    w.close()
    with open_capture(path) as r:
        row = r.row("r0.s0:child#0:out.0")
        assert row.stats.max == pytest.approx(before.max().item())
        assert row.stats.l2 == pytest.approx(before.norm().item(), rel=1e-6)
        if store == "full":
            np.testing.assert_array_equal(r.read(row.key), before.numpy())


# -- weights once per capture ------------------------------------------------------------
def test_op_inputs_store_each_weight_once(tiny, tmp_path):
    """--level op --inputs: a weight is an op input at every call (mm's transposed weight, the
    embedding table, norm weights); its records name it and share one dataset, so the file is
    the activations plus one copy of the touched weights (plus the index)."""
    from accucheck.capture.runners.hf import capture_model

    model, tok = tiny
    path = tmp_path / "op.h5"
    capture_model(model, ["The quick brown fox jumps"], path, tokenizer=tok, store="full",
                  level="op", record_inputs=True, max_new_tokens=2)
    params = dict(model.named_parameters())
    with open_capture(path) as r:
        rows = r.rows
    by_weight = collections.defaultdict(set)
    for row in rows:
        name = json.loads(row.extra).get("weight") if row.extra else None
        if name:
            assert row.key.role == "in" and row.has_data
            by_weight[name].add(row.data)
    calls = collections.Counter(json.loads(row.extra)["weight"] for row in rows
                                if row.extra and '"weight"' in row.extra)
    assert calls["model.layers.0.self_attn.q_proj.weight"] == 3  # one mm per step
    assert set(by_weight) >= {n for n in params if "layers.0" in n}
    assert all(len(v) == 1 for v in by_weight.values()), by_weight
    weight_data = set().union(*by_weight.values())
    weights = sum(t.numel() * 4 for n, t in params.items() if n in by_weight)
    activations = sum(int(np.prod(row.shape)) * 4 for row in rows
                      if row.has_data and row.data not in weight_data)
    assert path.stat().st_size <= activations + weights + 1024 * len(rows), (
        path.stat().st_size, activations, weights, len(rows))
    with h5py.File(path) as f:  # no dataset stored twice
        assert len(f["tensors"]) == len({row.data for row in rows if row.has_data})


@pytest.mark.slow
def test_bench_capture_prints_the_table(tmp_path):
    """bench/bench_capture.py runs (one repeat, a short sequence) and prints the table."""
    import subprocess
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "bench" / "bench_capture.py"
    p = subprocess.run([sys.executable, str(bench), "--repeats", "1", "--seqs", "8",
                        "--no-msprobe"], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "| seq | accucheck stats, coarse selection (" in p.stdout
    assert "accucheck stats, every module (69) | msprobe statistics L0 |" in p.stdout
    assert "load average before:" in p.stdout and "msprobe: not measured" in p.stdout
