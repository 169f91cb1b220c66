"""Alignment, token checks, stats-only bounds, golden referee: synthetic files via CaptureWriter,
plus real tiny-model captures where the behaviour depends on real data."""
from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest

import diffcases
from accucheck.compare.diff import diff_captures, stats_delta
from accucheck.errors import UserError
from accucheck.keys import RecordKey
from accucheck.store import CaptureWriter, open_capture, sample_positions


def _stats(x: np.ndarray) -> np.ndarray:
    x64 = x.astype(np.float64)
    f = x64[np.isfinite(x64)]
    return np.array([f.min(), f.max(), f.mean(), f.std(), np.abs(f).max(),
                     np.sqrt(np.dot(f, f)), np.isnan(x64).sum(), np.isinf(x64).sum(),
                     (x64 == 0).sum(), x.size], dtype=np.float64)


def write(path, tensors: dict, *, store="full", prompts=((1, 2, 3),), gen=((4, 5),),
          dtype="float32", meta=None, sample=False):
    """tensors: key -> array (float32) in execution order; kind from the key. `sample`: the
    index holds each record's sample (/index/sample), as a capture in the stats store does."""
    with CaptureWriter(path, meta=dict(meta or {}, dtype=dtype), store=store) as w:
        for k, x in tensors.items():
            key = RecordKey.parse(k)
            x = np.asarray(x, np.float32)
            kind = "logits" if key.is_logits else ("op" if key.is_op else "module")
            row = _stats(x) if not sample else np.concatenate(
                [_stats(x), x.reshape(-1)[sample_positions(x.size)].astype(np.float64)])
            w.add(key, kind, "float32", x.shape, row,
                  int(x.view(np.uint32).astype(np.int64).sum() % 2 ** 52), x)
        for i, (p, g) in enumerate(zip(prompts, gen)):
            w.set_request(i, p, g)
    return path


def base(rng=None, steps=(0,), layers=2, hidden=64):
    rng = rng or np.random.default_rng(0)
    t = {}
    for s in steps:
        n = 3 if s == 0 else 1
        t[f"r0.s{s}:model.embed_tokens#0:out.0"] = rng.standard_normal((1, n, hidden))
        for i in range(layers):
            for sub in ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp"):
                t[f"r0.s{s}:model.layers.{i}.{sub}#0:out.0"] = rng.standard_normal((1, n, hidden))
            t[f"r0.s{s}:model.layers.{i}#0:out.0"] = rng.standard_normal((1, n, hidden))
        t[f"r0.s{s}:model.norm#0:out.0"] = rng.standard_normal((1, n, hidden))
        t[f"r0.s{s}:logits#0:out.0"] = rng.standard_normal((1, n, 32)) * 3
    return t


def test_identical_files_pass(tmp_path):
    t = base()
    d = diff_captures(write(tmp_path / "a.h5", t), write(tmp_path / "b.h5", t))
    assert d.within and d.basis == "tensor" and not d.missing and not d.notes
    assert all(r.metrics.identical for r in d.records)
    assert len(d.records) == len(t)
    assert [str(r.key) for r in d.records] == list(t)  # reference execution order


def test_one_side_keys_listed_and_shape_mismatch_reported(tmp_path):
    t = base()
    c = dict(t)
    del c["r0.s0:model.layers.1.mlp#0:out.0"]
    c["r0.s0:model.layers.1.mlp.act_fn#0:out.0"] = np.ones((1, 3, 8))
    c["r0.s0:model.layers.0.mlp#0:out.0"] = np.ones((1, 3, 65))
    d = diff_captures(write(tmp_path / "a.h5", t), write(tmp_path / "b.h5", c))
    assert {(m.key, m.only_in) for m in d.missing} == {
        ("r0.s0:model.layers.1.mlp#0:out.0", "ref"),
        ("r0.s0:model.layers.1.mlp.act_fn#0:out.0", "cand")}
    r = d.record("r0.s0:model.layers.0.mlp#0:out.0")
    assert r.basis == "shape" and not r.within and r.error == math.inf
    assert r.ref_shape == (1, 3, 64) and r.cand_shape == (1, 3, 65)
    assert not d.within
    assert any("one side only" in n for n in d.notes)
    del c["r0.s0:model.layers.0.self_attn#0:out.0"]  # now 2 only in ref, 1 only in cand
    d = diff_captures(tmp_path / "a.h5", write(tmp_path / "c.h5", c))
    assert "3 keys on one side only (2 only in ref, 1 only in cand): see `missing`" in d.notes


def test_different_prompts_refused_in_one_line(tmp_path):
    t = base()
    a = write(tmp_path / "a.h5", t)
    b = write(tmp_path / "b.h5", t, prompts=((1, 2, 9),))
    with pytest.raises(UserError) as e:
        diff_captures(a, b)
    assert e.value.exit_code == 3 and "different prompts" in str(e.value)
    assert "request 0 differs at token 2" in str(e.value)


def test_different_generated_tokens_compare_common_prefix_loudly(tmp_path):
    t = base(steps=(0, 1, 2))
    a = write(tmp_path / "a.h5", t, gen=((4, 5, 6),))
    b = write(tmp_path / "b.h5", t, gen=((4, 7, 6),))
    d = diff_captures(a, b)
    assert {r.key.step for r in d.records} == {0, 1}
    assert d.skipped == len([k for k in t if ".s2:" in k])
    assert any("--tokens-from" in n and "step 1" in n for n in d.notes)
    # logits are stored and agree at step 1 (same synthetic tensors): the flip is known
    # only from the generated ids here, so it cannot be shown to be a near-tie
    assert d.flips and d.flips[0].step == 1 and d.flips[0].near_tie is None
    assert not d.within and d.real_flip


def test_stats_only_uses_a_lower_bound_and_says_so(tmp_path):
    rng = np.random.default_rng(3)
    t = base(rng)
    c = dict(t)
    k = "r0.s0:model.layers.1.mlp#0:out.0"
    c[k] = t[k] * 1.01  # l2 moves by 1 %: rel_l2 >= 1e-2
    d = diff_captures(write(tmp_path / "a.h5", t, store="stats"),
                      write(tmp_path / "b.h5", c, store="stats"))
    assert d.basis == "stats"
    assert any("statistics only" in n and "weaker" in n for n in d.notes)
    r = d.record(k)
    assert r.basis == "stats" and not r.within
    assert 0.5e-2 < r.error <= 1e-2 * (1 + 1e-6)  # a lower bound of the true 1e-2
    others = [x for x in d.records if str(x.key) != k]
    assert all(x.stats.identical and x.error == 0 for x in others)


def test_stats_bound_is_a_true_lower_bound_and_ignores_relative_min_moves():
    """A moved minimum counts |dmin| against ||ref||, never |dmin|/|min|."""
    from accucheck.store import IndexRow, Stats

    rng = np.random.default_rng(4)
    for trial in range(30):
        a = rng.standard_normal(2000)
        b = a + rng.standard_normal(2000) * 10.0 ** rng.uniform(-8, -1)
        if trial % 3 == 0:
            b[np.argmin(a)] *= 1 + 1e-3  # move only the minimum
        ra = IndexRow(RecordKey.parse("r0.s0:m#0:out.0"), 0, "module", "float64", (2000,),
                      Stats.from_row(_stats(a)), 1, "")
        rb = IndexRow(ra.key, 0, "module", "float64", (2000,), Stats.from_row(_stats(b)), 2, "")
        sd = stats_delta(ra, rb)
        true = np.linalg.norm(a - b) / np.linalg.norm(a)
        assert sd.rel_l2_lower_bound <= true * (1 + 1e-9)
    a = np.linspace(1e-6, 1.0, 1000)
    b = a.copy()
    b[0] = 2e-6  # min moves by 100 % of itself, by 1e-6 absolute
    ra = IndexRow(RecordKey.parse("r0.s0:m#0:out.0"), 0, "module", "float64", (1000,),
                  Stats.from_row(_stats(a)), 1, "")
    rb = IndexRow(ra.key, 0, "module", "float64", (1000,), Stats.from_row(_stats(b)), 2, "")
    assert stats_delta(ra, rb).rel_l2_lower_bound < 1e-7


def test_step_and_include_filters(tmp_path):
    t = base(steps=(0, 1))
    a, b = write(tmp_path / "a.h5", t, gen=((4, 5),)), write(tmp_path / "b.h5", t, gen=((4, 5),))
    d = diff_captures(a, b, steps=[1], include=["*.mlp"])
    assert [str(r.key) for r in d.records] == ["r0.s1:model.layers.0.mlp#0:out.0",
                                                "r0.s1:model.layers.1.mlp#0:out.0"]
    with pytest.raises(UserError):
        diff_captures(a, b, include=["nothing*"])


def test_incomplete_capture_refused(tmp_path):
    t = base()
    a = write(tmp_path / "a.h5", t)
    w = CaptureWriter(tmp_path / "b.h5", meta={}, store="full")
    w.close(complete=False)
    with pytest.raises(UserError) as e:
        diff_captures(a, tmp_path / "b.h5")
    assert e.value.exit_code == 3 and "incomplete" in str(e.value)


def test_golden_referee_labels(tmp_path):
    rng = np.random.default_rng(5)
    g = base(rng)
    ref, cand = {}, {}
    for i, (k, x) in enumerate(g.items()):
        n1 = rng.standard_normal(x.shape) * 1e-6
        n2 = rng.standard_normal(x.shape) * 1e-6
        ref[k] = x + n1
        cand[k] = x + (n2 * 20 if "layers.1.mlp" in k else n2)
    ref["r0.s0:model.norm#0:out.0"] = g["r0.s0:model.norm#0:out.0"] + 3e-5
    d = diff_captures(write(tmp_path / "r.h5", ref), write(tmp_path / "c.h5", cand),
                      write(tmp_path / "g.h5", g, dtype="float64"))
    labels = {str(r.key): r.golden.label for r in d.records}
    assert labels["r0.s0:model.layers.1.mlp#0:out.0"] == "cand worse"
    assert labels["r0.s0:model.norm#0:out.0"] == "ref worse"
    assert labels["r0.s0:model.layers.0.mlp#0:out.0"] == "both within noise"
    r = d.record("r0.s0:model.layers.1.mlp#0:out.0")
    assert r.golden.multiplier == 2.0 and r.golden.cand_rmse > 2 * r.golden.ref_rmse


def test_golden_on_other_prompts_refused(tmp_path):
    t = base()
    with pytest.raises(UserError) as e:
        diff_captures(write(tmp_path / "a.h5", t), write(tmp_path / "b.h5", t),
                      write(tmp_path / "g.h5", t, prompts=((7, 7, 7),)))
    assert "--tokens-from" in str(e.value)


def test_logits_flip_near_tie_vs_real(tmp_path):
    t = base()
    k = "r0.s0:logits#0:out.0"
    ref = np.zeros((1, 3, 32), np.float32)
    ref[0, :, 0] = 5.0
    ref[0, 2, 1] = 5.0 - 1e-4  # last position: top-1/top-2 margin 1e-4
    t[k] = ref
    c = dict(t)
    cand = ref.copy()
    cand[0, 2, 1] += 2e-4  # flips the near tie
    cand[0, :, 5:] += 1e-3 * np.sin(np.arange(27))  # logit noise ~7e-4 > margin
    c[k] = cand
    d = diff_captures(write(tmp_path / "a.h5", t), write(tmp_path / "b.h5", c))
    f = d.first_flip
    assert (f.step, f.position, f.ref_token, f.cand_token) == (0, 2, 0, 1)
    assert f.generating and f.near_tie and f.label == "near-tie"
    ls = d.logits[0]
    assert [p.agree for p in ls.positions] == [True, True, False]
    assert ls.positions[2].kl > 0 and ls.positions[0].agree
    # a real flip: large margin overturned while the rest of the vocabulary stays put
    cand2 = ref.copy()
    cand2[0, 1, 3] = 9.0
    c[k] = cand2
    d2 = diff_captures(write(tmp_path / "a2.h5", t), write(tmp_path / "b2.h5", c))
    assert d2.first_flip.position == 1 and d2.first_flip.near_tie is False
    assert not d2.first_flip.generating and not d2.flips  # prompt position: nothing emitted


def test_shadow_records_pair_with_reference_outputs(tmp_path):
    t = base()
    c = dict(t)
    c["r0.s0:model.layers.1.mlp#0:shadow.0"] = t["r0.s0:model.layers.1.mlp#0:out.0"] * 1.01
    d = diff_captures(write(tmp_path / "a.h5", t), write(tmp_path / "b.h5", c))
    assert not d.missing
    r = d.record("r0.s0:model.layers.1.mlp#0:out.0")
    assert r.shadow is not None and r.shadow.rel_l2 == pytest.approx(0.01, rel=1e-4)


def test_bfloat16_and_float32_pair_uses_bf16_tolerance_on_real_captures(tiny, tmp_path):
    model, tok = tiny
    ref = diffcases.make("ref", model, tok, tmp_path / "ref.h5", steps=1)
    bf = diffcases.make("bf16", model, tok, tmp_path / "bf.h5", ref, steps=1)
    d = diff_captures(ref, bf)
    assert d.within and not d.missing
    assert {r.tolerance.source for r in d.records} == {"default bfloat16"}
    assert {r.cand_dtype for r in d.records if r.kind != "logits"} == {"bfloat16"}
    with open_capture(ref) as r:
        assert len(d.records) == len(r.rows)


def test_diff_does_not_import_torch():
    code = ("import sys, accucheck.compare.diff, accucheck.verdict.locate, accucheck.report.diff, "
            "accucheck.cli; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "False"


def _row(x: np.ndarray, dtype: str = "float64", checksum: int = 1):
    from accucheck.store import IndexRow, Stats

    return IndexRow(RecordKey.parse("r0.s0:m#0:out.0"), 0, "module", dtype, x.shape,
                    Stats.from_row(_stats(x)), checksum, "")


def test_stats_bound_is_exactly_the_largest_statistic_gap():
    """Each of |dl2|, sqrt(n)|dmean|, sqrt(n-1)|dstd|, |dmin|, |dmax|, |dabsmax| bounds
    ||ref - cand||; the result is the largest, over ||ref||, named by `bound_from`."""
    n = 1000
    alt = np.where(np.arange(n) % 2 == 0, 1.0, -1.0)             # mean 0, std 1, l2 sqrt(n)
    # a constant shift: sqrt(n) |dmean| IS ||a - b||, so the bound is the true rel_l2
    sd = stats_delta(_row(alt), _row(alt + 0.01, checksum=2))
    assert (sd.bound_from, sd.identical, sd.nan_inf_mismatch) == ("mean", False, 0)
    assert sd.rel_l2_lower_bound == pytest.approx(0.01, rel=1e-9)
    assert sd.rel_l2_lower_bound == pytest.approx(np.linalg.norm(0.01 * np.ones(n))
                                                  / np.linalg.norm(alt), rel=1e-9)
    # a scale: |dl2| = 0.5 ||a|| is exact too
    a = np.linspace(1.0, 3.0, n)
    sd = stats_delta(_row(a), _row(1.5 * a, checksum=2))
    assert sd.bound_from == "l2" and sd.rel_l2_lower_bound == pytest.approx(0.5, rel=1e-12)
    # the spread grows while the norm stays put (the mean drops to compensate): the std gap
    # sqrt(n-1) |dstd| is the largest (the index holds the population std)
    a = alt + 2.0                                                 # mean 2, std 1
    b = 1.2 * alt + math.sqrt(5.0 - 1.44)                         # std 1.2, same l2
    sd = stats_delta(_row(a), _row(b, checksum=2))
    assert sd.bound_from == "std"
    assert sd.rel_l2_lower_bound == pytest.approx(math.sqrt(n - 1) * 0.2 / np.linalg.norm(a),
                                                  rel=1e-9)
    assert sd.rel_l2_lower_bound <= np.linalg.norm(a - b) / np.linalg.norm(a)
    # the same statistics (a permutation): no bound at all, nothing named
    sd = stats_delta(_row(alt), _row(alt[::-1].copy(), checksum=2))
    assert (sd.identical, sd.rel_l2_lower_bound, sd.bound_from) == (False, 0.0, None)
    # only the minimum moves, by 0.2 absolute: |dmin| / ||a||, whatever the minimum's size
    a = np.linspace(1.0, 2.0, n)
    b = a.copy()
    b[0] = 0.8
    sd = stats_delta(_row(a), _row(b, checksum=2))
    assert sd.bound_from == "min"
    assert sd.rel_l2_lower_bound == pytest.approx(0.2 / np.linalg.norm(a), rel=1e-9)
    # only the maximum (and absmax, the same element) moves: |dmax| / ||a||
    b = a.copy()
    b[-1] = 2.3
    sd = stats_delta(_row(a), _row(b, checksum=2))
    assert sd.bound_from in ("max", "absmax")
    assert sd.rel_l2_lower_bound == pytest.approx(0.3 / np.linalg.norm(a), rel=1e-9)
    # absmax alone: a negative extreme grows, min moves by as much: the bound is 0.3 / ||a||
    a2 = np.linspace(-2.0, 1.0, n)
    b = a2.copy()
    b[0] = -2.3
    sd = stats_delta(_row(a2), _row(b, checksum=2))
    assert sd.rel_l2_lower_bound == pytest.approx(0.3 / np.linalg.norm(a2), rel=1e-9)


def test_stats_bound_with_nan_uses_l2_only_and_counts_positions():
    a = np.linspace(1.0, 2.0, 100)
    b = a * 1.1
    b[3] = np.nan
    b[4] = np.inf
    sd = stats_delta(_row(a), _row(b, checksum=2))
    assert sd.nan_inf_mismatch == 2 and sd.bound_from == "l2"
    fb = b[np.isfinite(b)]
    assert sd.rel_l2_lower_bound == pytest.approx(
        abs(np.linalg.norm(a) - np.linalg.norm(fb)) / np.linalg.norm(a), rel=1e-9)
    # identical rows: identical, zero, nothing named
    sd = stats_delta(_row(a), _row(a))
    assert (sd.identical, sd.rel_l2_lower_bound, sd.bound_from, sd.nan_inf_mismatch) == \
        (True, 0.0, None, 0)
    sd = stats_delta(_row(b, checksum=2), _row(b, checksum=2))  # NaN / Inf at the same places
    assert (sd.identical, sd.nan_inf_mismatch) == (True, 0)
    # a zero reference: any difference is an infinite relative error
    z = np.zeros(10)
    assert stats_delta(_row(z), _row(z + 1.0, checksum=2)).rel_l2_lower_bound == math.inf


def test_stats_capture_reports_the_bound_as_the_error(tmp_path):
    """The diff's error for a statistics-only record is the bound (never 0 for a real gap)."""
    t = base(np.random.default_rng(6))
    c = dict(t)
    k = "r0.s0:model.layers.0.mlp#0:out.0"
    c[k] = t[k] + 0.5
    d = diff_captures(write(tmp_path / "a.h5", t, store="stats"),
                      write(tmp_path / "b.h5", c, store="stats"))
    r = d.record(k)
    x = np.asarray(t[k], np.float32).astype(np.float64)
    y = np.asarray(c[k], np.float32).astype(np.float64)
    expect = stats_delta(_row(x), _row(y, checksum=2))
    assert r.basis in ("stats", "sample") and r.stats.bound_from == expect.bound_from == "mean"
    assert r.stats.rel_l2_lower_bound == pytest.approx(expect.rel_l2_lower_bound, rel=1e-6)
    assert r.error >= r.stats.rel_l2_lower_bound > 0.1 and not r.within


def test_near_tie_is_margin_at_most_eight_times_the_noise():
    from accucheck.compare.results import LogitsPosition, TokenFlip

    def pos(margin, noise):
        return LogitsPosition(0, 0.0, 0, 1, 1.0, margin, noise)

    def flip(margin, noise):
        return TokenFlip(0, 0, 2, 0, 1, margin, noise, True, "logits")

    noise = 1e-3
    # documented rule (docs/diff-json.md): near-tie when margin <= NEAR_TIE_FACTOR (8) x noise
    for margin, expect in ((0.5e-3, True), (1e-3, True), (3.1e-3, True), (7.9e-3, True),
                           (8.1e-3, False), (12e-3, False)):
        assert pos(margin, noise).near_tie is expect, margin
        assert flip(margin, noise).near_tie is expect, margin
        assert flip(margin, noise).label == ("near-tie" if expect else "real")
    assert flip(None, None).near_tie is None
    assert flip(None, None).label == "unknown (no logits stored)"


@pytest.mark.parametrize("spread, real", [(6e-4, False), (2.5e-4, False), (1e-4, True)])
def test_a_flip_is_real_only_with_a_margin_over_eight_times_the_noise(tmp_path, spread, real):
    """A margin between the logit noise and 8x it (x1.8 and x4.2 here) is a near-tie: two
    correct bf16 devices flip there (measured up to x6.05, compare.tolerances NEAR_TIE_FACTOR),
    the diff passes; over 8x (x10.5) the flip is real and the diff fails. The noise leaves out
    the two tokens that trade places."""
    from accucheck.compare.metrics import logit_noise, top2_margin

    t = base()
    k = "r0.s0:logits#0:out.0"
    ref = np.zeros((1, 3, 32), np.float32)
    ref[0, :, 0] = 5.0
    ref[0, 2, 1] = 5.0 - 1e-3                    # last (generating) position: margin 1e-3
    t[k] = ref
    cand = ref.copy()
    cand[0, 2, 0] -= 6e-4                        # flips the top token
    cand[0, 2, 1] += 6e-4
    cand[0, 2, 5:] += spread * np.where(np.arange(27) % 2 == 0, 1.0, -1.0)
    c = dict(t)
    c[k] = cand
    margin = float(top2_margin(ref[0, 2].astype(np.float64))[0])
    noise = float(logit_noise(ref[0, 2], cand[0, 2])[0])
    assert (margin > 8 * noise) is real and margin > noise  # the cases the rule must get right
    assert real or spread > 5e-4 or margin > 3 * noise      # x4.2: "real" at the old x3
    d = diff_captures(write(tmp_path / "a.h5", t), write(tmp_path / "b.h5", c))
    f = d.first_flip
    assert (f.step, f.position, f.generating, f.near_tie, f.label) == (
        0, 2, True, not real, "real" if real else "near-tie")
    assert f.margin == pytest.approx(margin, rel=1e-5) and f.noise == pytest.approx(noise, rel=1e-5)
    assert d.real_flip is real


def test_observer_note_compares_with_the_largest_logits_difference(tmp_path):
    """A graph-mode candidate whose taps moved its logits by 0.01: the note relates that to
    the largest logits rel_l2 between the runs (0.04 at step 1), not to other records."""
    t = base(steps=(0, 1))
    c = dict(t)
    c["r0.s0:logits#0:out.0"] = t["r0.s0:logits#0:out.0"] * 1.02
    c["r0.s1:logits#0:out.0"] = t["r0.s1:logits#0:out.0"] * 1.04
    c["r0.s1:model.norm#0:out.0"] = t["r0.s1:model.norm#0:out.0"] * 1.08
    graph = {"mode": "graph", "observer_effect": {
        "measured": True, "taps": "selection", "bitwise": False, "max_rel_l2": 0.01,
        "max_kl": 1e-5, "argmax_changed": 0}}
    d = diff_captures(write(tmp_path / "a.h5", t, meta={"mode": "eager"}),
                      write(tmp_path / "b.h5", c, meta=graph))
    [note] = [n for n in d.notes if "OBSERVER" in n]
    assert note.startswith("OBSERVER EFFECT: cand's taps moved its compiled logits by rel L2 "
                           "1.00e-02, KL 1.00e-05 (taps: selection): 25 % of the logits "
                           "difference judged here"), note


@pytest.mark.parametrize("store", ["stats", "full"])
def test_first_difference_after_identical_records(tmp_path, store):
    from accucheck.report.diff import render
    from accucheck.verdict.locate import analyze

    t = base()
    c = dict(t)
    key = "r0.s0:model.layers.1.self_attn#0:out.0"
    c[key] = t[key] * 1.00001
    a = analyze(write(tmp_path / "a.h5", t, store=store), write(tmp_path / "b.h5", c, store=store))
    fd = a.location.first_difference
    assert str(fd.key) == key and fd.error < fd.tolerance
    text = render(a, "table")
    assert ("First difference: step 0, model.layers.1.self_attn (out.0): rel_l2 "
            in text), text


def test_prompts_and_generations_of_other_lengths(tmp_path):
    """A prompt that is a prefix of the other side's differs at the shorter one's end (one
    line, no traceback); generated ids of other lengths agree on their common prefix (nothing
    skipped, no flip); the same for a golden that generated more than the reference."""
    t = base()
    a = write(tmp_path / "a.h5", t, gen=((4, 5, 6),))
    with pytest.raises(UserError) as e:
        diff_captures(a, write(tmp_path / "p.h5", t, prompts=((1, 2),)))
    assert "request 0 differs at token 2" in str(e.value)
    with pytest.raises(UserError) as e:
        diff_captures(write(tmp_path / "q.h5", t, prompts=((1, 2),)), a)
    assert "request 0 differs at token 2" in str(e.value)
    for gen in (((4, 5),), ((4, 5, 6, 7),)):
        d = diff_captures(a, write(tmp_path / f"g{len(gen[0])}.h5", t, gen=gen))
        assert d.within and not d.flips and not d.notes and d.skipped == 0
    g = write(tmp_path / "golden.h5", t, gen=((4, 5, 6, 7, 8),))
    d = diff_captures(write(tmp_path / "r.h5", t, gen=((4, 5),)), a, g)
    assert not [n for n in d.notes if "golden tokens differ" in n]


def test_golden_prompts_checked_for_every_request(tmp_path):
    t = base()
    two = dict(prompts=((1, 2, 3), (4, 5, 6)), gen=((4, 5), (6, 7)))
    a, b = write(tmp_path / "a.h5", t, **two), write(tmp_path / "b.h5", t, **two)
    g = write(tmp_path / "g.h5", t, prompts=((1, 2, 3), (4, 5, 9)), gen=two["gen"])
    with pytest.raises(UserError) as e:
        diff_captures(a, b, g)
    assert "golden" in str(e.value) and "other prompts" in str(e.value)
    assert diff_captures(a, b, write(tmp_path / "g2.h5", t, **two)).within


def test_include_keeps_a_key_any_one_pattern_matches(tmp_path):
    t = base()
    a, b = write(tmp_path / "a.h5", t), write(tmp_path / "b.h5", t)
    d = diff_captures(a, b, include=["*.mlp", "model.norm"])
    assert [str(r.key) for r in d.records] == ["r0.s0:model.layers.0.mlp#0:out.0",
                                                "r0.s0:model.layers.1.mlp#0:out.0",
                                                "r0.s0:model.norm#0:out.0"]


def test_only_shadow_records_pair_as_shadows(tmp_path):
    """A candidate-only "in" record of a module whose output both sides hold is a key on one
    side, not a shadow replay of that output."""
    t = base()
    c = dict(t)
    c["r0.s0:model.layers.0.mlp#0:in.0"] = np.ones((1, 3, 64))
    d = diff_captures(write(tmp_path / "a.h5", t), write(tmp_path / "b.h5", c))
    assert d.record("r0.s0:model.layers.0.mlp#0:out.0").shadow is None
    assert [(m.key, m.only_in) for m in d.missing] == [
        ("r0.s0:model.layers.0.mlp#0:in.0", "cand")]


def test_ops_on_one_side_are_noted_not_missing_and_shadows_without_output_are(tmp_path):
    """An op only the reference ran (fused away in the candidate) is a note with its count,
    never a missing key; a candidate shadow record with no output to pair with is a key on one
    side."""
    rng = np.random.default_rng(3)
    x, y, z = (rng.standard_normal((1, 3, 64)) for _ in range(3))
    mod = "r0.s0:model.layers.0.mlp#0"
    ref = {f"{mod}/aten.mul.Tensor@0:out.0": y, f"{mod}/aten.add.Tensor@1:out.0": z,
           f"{mod}:out.0": z}
    cand = {f"{mod}/aten.add.Tensor@0:out.0": z, f"{mod}:out.0": z,
            "r0.s0:model.layers.1.mlp#0:shadow.0": x}
    d = diff_captures(write(tmp_path / "a.h5", ref), write(tmp_path / "b.h5", cand))
    assert [(m.key, m.only_in) for m in d.missing] == [
        ("r0.s0:model.layers.1.mlp#0:shadow.0", "cand")]
    assert [n for n in d.notes if "op calls on one side only" in n] == [
        "1 op calls on one side only (1 only in ref, 0 only in cand): fused or absent there, "
        "not errors; 0 fused regions compared by their final output"]
    same = diff_captures(tmp_path / "a.h5", write(tmp_path / "c.h5", ref))
    assert not [n for n in same.notes if "op calls" in n] and same.within


def test_nothing_to_compare_says_which_in_one_line(tmp_path):
    t = base()
    a, b = write(tmp_path / "a.h5", t), write(tmp_path / "b.h5", t)
    with pytest.raises(UserError) as e:
        diff_captures(a, b, include=["nothing*"])
    assert str(e.value).startswith(f"no records to compare between {a} and {b}")
    other = {k.replace("model.", "net."): v for k, v in t.items() if "model." in k}
    with pytest.raises(UserError) as e:
        diff_captures(a, write(tmp_path / "c.h5", other))
    assert "have no record key in common" in str(e.value)


def test_progress_at_the_start_then_by_time_not_by_records(tmp_path, monkeypatch):
    import accucheck.compare.diff as diff_mod

    t = {f"r0.s0:model.layers.{i}#0:out.0": np.full((1, 2), float(i + 1)) for i in range(401)}
    a, b = write(tmp_path / "a.h5", t), write(tmp_path / "b.h5", t)
    clock = [0.0]
    monkeypatch.setattr(diff_mod.time, "monotonic", lambda: clock[0])
    said: list[str] = []
    diff_captures(a, b, progress=said.append)   # a fast diff: the clock stands still
    assert said == ["diff: 0/401 records"]

    def slow() -> float:   # a slow one: every record takes a second
        clock[0] += 1.0
        return clock[0]
    monkeypatch.setattr(diff_mod.time, "monotonic", slow)
    said.clear()
    diff_captures(a, b, progress=said.append)
    assert said[:3] == ["diff: 0/401 records", "diff: 2/401 records", "diff: 4/401 records"]
    assert len(said) == 201 and diff_mod.PROGRESS_EVERY_S == 2.0


def _mixed(path, recs, store, golden_shape=None):
    """recs: (key, values, with a sample, /index/extra) in order; values stored in full mode."""
    with CaptureWriter(path, meta={"dtype": "float32"}, store=store) as w:
        for key, x, sample, extra in recs:
            x = np.asarray(x, np.float32)
            st = _stats(x)
            if sample:
                st = np.concatenate([st, x.ravel()[(np.arange(64) * (x.size - 1)) // 63]])
            w.add(key, "module", "float32", x.shape, st,
                  int(x.view(np.uint32).astype(np.int64).sum() % 2 ** 52),
                  x if store == "full" else None, extra)
        w.set_request(0, (1, 2, 3), (4, 5))
    return path


def test_full_against_statistics_and_samples_on_one_side_only(tmp_path):
    """A full capture against a stats-only one (either way round) is compared on the samples;
    a side without samples leaves the statistics bound alone (basis "stats")."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((1, 3, 64))
    y = x * (1 + 1e-2)
    k = "r0.s0:model.layers.0.mlp#0:out.0"
    full = _mixed(tmp_path / "full.h5", [(k, x, True, "")], "full")
    stats = _mixed(tmp_path / "stats.h5", [(k, y, True, "")], "stats")
    bare = _mixed(tmp_path / "bare.h5", [(k, y, False, "")], "stats")
    for a, b, basis in ((full, stats, "sample"), (stats, full, "sample"), (stats, bare, "stats"),
                        (bare, stats, "stats"), (full, bare, "stats")):
        r = diff_captures(a, b).record(k)
        assert r.basis == basis, (a.name, b.name)
        if basis == "sample":  # 1e-2 relative to the reference's norm, either way round
            assert r.error == pytest.approx(1e-2, rel=2e-2)


def test_links_come_from_whichever_side_stored_them(tmp_path):
    rng = np.random.default_rng(6)
    x = rng.standard_normal((1, 3, 64))
    p, k = "r0.s0:model.layers.0.input_layernorm#0:out.0", "r0.s0:model.layers.0.mlp#0:out.0"
    src = '{"src":{"0":"model.layers.0.input_layernorm#0:out.0"}}'
    linked = _mixed(tmp_path / "l.h5", [(p, x, True, ""), (k, x, True, src)], "full")
    plain = _mixed(tmp_path / "p.h5", [(p, x, True, ""), (k, x, True, "")], "full")
    want = (("0", p),)
    assert diff_captures(linked, plain).record(k).src == want
    assert diff_captures(plain, linked).record(k).src == want
    assert diff_captures(plain, plain).record(k).src == ()


def test_golden_of_another_shape_is_no_referee(tmp_path):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((1, 3, 64))
    k = "r0.s0:model.layers.0.mlp#0:out.0"
    a = _mixed(tmp_path / "a.h5", [(k, x, True, "")], "full")
    b = _mixed(tmp_path / "b.h5", [(k, x * 1.5, True, "")], "full")
    g = _mixed(tmp_path / "g.h5", [(k, rng.standard_normal((1, 3, 32)), True, "")], "full")
    r = diff_captures(a, b, g).record(k)
    assert not r.refereed and not r.within and (r.golden is None or r.golden.label == "n/a")


def test_golden_errors_leave_out_positions_not_finite_on_any_side(tmp_path):
    """A NaN both runs hold at the same position (no NaN mismatch) is left out of the golden
    RMS errors, which stay finite and exact over the other positions."""
    rng = np.random.default_rng(8)
    x = rng.standard_normal((1, 3, 64))
    ref = x.copy()
    ref[0, 0, 0] = np.nan
    cand = ref * (1 + 1e-3)
    gold = x.copy()
    gold[0, 0, 0] = 0.0
    k = "r0.s0:model.layers.0.mlp#0:out.0"
    a = _mixed(tmp_path / "a.h5", [(k, ref, True, "")], "full")
    b = _mixed(tmp_path / "b.h5", [(k, cand, True, "")], "full")
    g = _mixed(tmp_path / "g.h5", [(k, gold, True, "")], "full")
    r = diff_captures(a, b, g).record(k)
    m = np.isfinite(ref.ravel())
    c32, g32 = cand.astype(np.float32).ravel()[m], gold.astype(np.float32).ravel()[m]
    want = np.sqrt(np.sum((c32.astype(np.float64) - g32) ** 2) / r.metrics.numel)
    assert r.golden.ref_rmse == 0.0 and r.golden.cand_rmse == pytest.approx(want, rel=1e-9)
    cand[0, 0, 0] = 1.0  # now a NaN in the reference only: still left out
    b = _mixed(tmp_path / "b2.h5", [(k, cand, True, "")], "full")
    r = diff_captures(a, b, g).record(k)
    assert r.golden.ref_rmse == 0.0 and r.golden.cand_rmse == pytest.approx(want, rel=1e-9)


def test_record_tolerance_from_the_run_dtypes_integers_exact(tmp_path):
    """A float32 record of a bfloat16 run is judged at bfloat16's tolerance, also when only
    one capture says its compute dtype; integer records are exact in any run."""
    def cap(path, meta_dtype):
        meta = {"dtype": meta_dtype} if meta_dtype else {}
        with CaptureWriter(path, meta=meta, store="full") as w:
            x = np.linspace(-1, 1, 12, dtype=np.float32).reshape(1, 12)
            w.add("r0.s0:m.f#0:out.0", "module", "float32", x.shape, _stats(x), 1, x)
            i = np.arange(12, dtype=np.int64).reshape(1, 12)
            w.add("r0.s0:m.i#0:out.0", "module", "int64", i.shape, _stats(i), 2, i)
            w.set_request(0, (1, 2, 3), (4, 5))
        return path

    bf, none = cap(tmp_path / "bf.h5", "bfloat16"), cap(tmp_path / "none.h5", None)
    with CaptureWriter(tmp_path / "int.h5", meta={"dtype": "bfloat16"}, store="full") as w:
        i = np.arange(12, dtype=np.int64).reshape(1, 12)
        w.add("r0.s0:m.f#0:out.0", "module", "int64", i.shape, _stats(i), 3, i)
        w.add("r0.s0:m.i#0:out.0", "module", "int64", i.shape, _stats(i), 2, i)
        w.set_request(0, (1, 2, 3), (4, 5))
    for a, b in ((bf, tmp_path / "int.h5"), (tmp_path / "int.h5", bf)):  # float vs integer
        assert diff_captures(a, b).record("r0.s0:m.f#0:out.0").tolerance.rel_l2 == 5e-2
    f32 = cap(tmp_path / "f32.h5", "float32")
    for a, b in ((bf, none), (none, bf), (bf, bf)):
        d = diff_captures(a, b)
        assert d.record("r0.s0:m.f#0:out.0").tolerance.rel_l2 == 5e-2, (a.name, b.name)
        assert d.record("r0.s0:m.i#0:out.0").tolerance.rel_l2 == 0.0, (a.name, b.name)
    d = diff_captures(f32, none)
    assert d.record("r0.s0:m.f#0:out.0").tolerance.rel_l2 == 5e-5
    assert d.record("r0.s0:m.i#0:out.0").tolerance.rel_l2 == 0.0


def test_nan_inf_mismatch_counts_only_the_difference():
    a = np.linspace(1.0, 2.0, 20)
    a[0], a[1], a[2] = np.nan, np.inf, -np.inf
    b = a * 1.5
    assert stats_delta(_row(a), _row(b, checksum=2)).nan_inf_mismatch == 0  # same positions
    b[5] = np.nan
    b[6] = np.inf
    assert stats_delta(_row(a), _row(b, checksum=2)).nan_inf_mismatch == 2
    assert stats_delta(_row(b, checksum=2), _row(a)).nan_inf_mismatch == 2


def test_links_and_meta_dtype_read_defensively():
    from accucheck.compare.diff import _links, _meta_dtype
    from accucheck.store import IndexRow, Stats

    def row(extra):
        return IndexRow(RecordKey.parse("r1.s2:m#0:out.0"), 0, "module", "float32", (1,),
                        Stats.from_row(_stats(np.ones(1))), 1, "", extra)

    assert _links(row('{"src":{"0":"p#0:out.0","1":5}}')) == (("0", "r1.s2:p#0:out.0"),)
    for bad in ('{"src": ', '["src"]', '{"src": null}', '{"site": "x"}', ""):
        assert _links(row(bad)) == (), bad
    assert [_meta_dtype(m) for m in ({"dtype": "torch.bfloat16"}, {"dtype": "float16"},
                                     {"dtype": ""}, {"dtype": 5}, {})] == \
        ["bfloat16", "float16", None, None, None]


def test_one_dimensional_logits_are_logits(tmp_path):
    x = np.linspace(-2, 2, 32)
    y = x.copy()
    y[[3, 30]] = y[[30, 3]]  # the top-1 token moves
    a = write(tmp_path / "a.h5", {"r0.s0:logits#0:out.0": x})
    b = write(tmp_path / "b.h5", {"r0.s0:logits#0:out.0": y})
    d = diff_captures(a, b)
    assert len(d.logits) == 1 and len(d.logits[0].positions) == 1
    assert d.logits[0].positions[0].top1_ref == 31 and d.logits[0].positions[0].top1_cand == 31
    z = y.copy()
    z[[0, 31]] = z[[31, 0]]
    d = diff_captures(a, write(tmp_path / "c.h5", {"r0.s0:logits#0:out.0": z}))
    assert (d.logits[0].positions[0].top1_ref, d.logits[0].positions[0].top1_cand) == (31, 0)


def test_same_checksum_different_statistics_is_not_identical():
    """Checksums can collide (a sum of bit patterns); the statistics must agree too."""
    a = np.linspace(1.0, 2.0, 50)
    sd = stats_delta(_row(a, checksum=7), _row(a * 1.01, checksum=7))
    assert not sd.identical and sd.rel_l2_lower_bound == pytest.approx(0.01, rel=1e-6)


@pytest.mark.filterwarnings("ignore:overflow:RuntimeWarning")
def test_rows_with_nothing_finite_to_bound_are_not_identical():
    """Two rows whose only comparable statistic is not finite (a NaN on both sides leaves the
    L2 norm; both norms overflow): no bound, but never "identical"."""
    a = np.array([np.nan, 1e200, 1e200])
    b = np.array([np.nan, 1e200, 2e200])
    sd = stats_delta(_row(a, checksum=1), _row(b, checksum=2))
    assert (sd.identical, sd.rel_l2_lower_bound, sd.bound_from, sd.nan_inf_mismatch) == \
        (False, 0.0, None, 0)


def test_the_control_rule_compares_logits_up_to_a_shift_a_softmax_ignores(tmp_path):
    """Two correct bf16 devices shift a decode row's logits by 0.04-0.5 (the final norm's
    error along lm_head's mean row): invisible to the softmax, yet it moved a single-token
    row's mean elementwise error x1-x4.7 between two runs of one device. The error the
    control rule reads (`elem_error`) takes each row's mean difference out, in full records
    and in samples; a change of the logits' shape between rows still counts."""
    rng = np.random.default_rng(3)
    ref = rng.standard_normal((1, 4, 512)) * 3
    noise = rng.standard_normal(ref.shape) * 0.01
    shifted = ref + noise + np.array([0.5, -0.3, 0.2, 0.4])[None, :, None]
    k = "r0.s0:logits#0:out.0"
    for store in ("full", "stats"):
        r = write(tmp_path / f"r-{store}.h5", {k: ref}, store=store, sample=True)
        errs = {}
        for name, cand in (("noise", ref + noise), ("shift", shifted),
                           ("shape", ref + noise * 8)):
            c = write(tmp_path / f"{name}-{store}.h5", {k: cand}, store=store, sample=True)
            rec = diff_captures(r, c).records[0]
            assert rec.basis == ("tensor" if store == "full" else "sample")
            errs[name] = rec.elem_error
        assert errs["shift"] == pytest.approx(errs["noise"], rel=0.05 if store == "full" else 0.5)
        assert errs["shape"] > 4 * errs["noise"]
