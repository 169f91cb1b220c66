"""Metric functions: known values, chunked == whole, ULP in the coarser dtype, logits."""
from __future__ import annotations

import math

import numpy as np
import pytest

from accucheck.compare import metrics as M
from accucheck.store import bf16_bits_to_float32


def bf16(x: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 (nearest even), returned as float32."""
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return bf16_bits_to_float32(u)


def test_known_values():
    a = np.array([1.0, 2.0, -2.0, 4.0])
    b = np.array([1.0, 2.5, -2.0, 3.0])
    assert M.max_abs(a, b) == 1.0
    assert M.mean_abs(a, b) == pytest.approx(0.375)
    assert M.max_rel(a, b) == pytest.approx(0.25)
    assert M.rel_l2(a, b) == pytest.approx(math.sqrt(1.25) / 5.0)
    assert M.cosine(a, b) == pytest.approx(np.dot(a, b) / np.linalg.norm(a) / np.linalg.norm(b))
    assert M.sqnr_db(a, b) == pytest.approx(10 * math.log10(25 / 1.25))
    assert M.rmse(a, b) == pytest.approx(math.sqrt(1.25 / 4))
    assert M.frac_rel_below(a, b, 1e-3) == 0.5
    assert M.rel_l2(a, a) == 0.0 and M.cosine(a, a) == 1.0 and M.sqnr_db(a, a) == math.inf


def test_relative_error_edge_cases():
    z = np.zeros(3)
    assert M.max_rel(z, z) == 0.0 and M.rel_l2(z, z) == 0.0 and M.cosine(z, z) == 1.0
    assert M.max_rel(z, np.array([0, 0, 1e-30])) == math.inf
    assert M.rel_l2(z, np.ones(3)) == math.inf
    # one side all zero: orthogonal (cosine 0), all noise (SQNR -inf)
    assert M.cosine(z, np.ones(3)) == 0.0 and M.cosine(np.ones(3), z) == 0.0
    assert M.sqnr_db(z, np.ones(3)) == -math.inf and M.sqnr_db(np.ones(3), z) == 0.0
    # small norms are ordinary numbers (||a||^2 < 1)
    a, b = np.array([0.5, 0.0]), np.array([0.25, 0.0])
    assert M.rel_l2(a, b) == 0.5 and M.cosine(a, b) == 1.0
    assert M.sqnr_db(a, b) == pytest.approx(10 * math.log10(4.0))
    assert M.cosine(np.array([1.0, 0.0]), np.array([0.0, 1.0])) == pytest.approx(0.0, abs=1e-15)
    assert M.cosine(np.array([1.0, 2.0]), np.array([-1.0, -2.0])) == -1.0


def test_nothing_finite_to_compare():
    """Empty tensors, or no position finite on both sides: no error, everything agrees."""
    for a, b in ((np.array([]), np.array([])), (np.array([np.nan, np.inf]),
                                                np.array([np.nan, np.inf]))):
        assert (M.max_abs(a, b), M.mean_abs(a, b), M.max_rel(a, b), M.rmse(a, b)) == \
            (0.0, 0.0, 0.0, 0.0)
        assert M.frac_rel_below(a, b, 1e-3) == 1.0
        assert (M.rel_l2(a, b), M.cosine(a, b), M.sqnr_db(a, b)) == (0.0, 1.0, math.inf)
        assert M.max_ulp(a, b, "float32") == 0 and M.max_ulp(a, b, "float64") == 0
    with pytest.raises(ValueError, match="shapes differ"):
        M.rel_l2(np.ones(3), np.ones(2))
    with pytest.raises(ValueError, match="shapes differ"):
        M.max_abs(np.ones(3), np.ones(1))  # never broadcast


def test_frac_rel_below_is_strict_and_mask_finite():
    a = np.array([4.0, 4.0, 4.0, 4.0, np.nan])
    b = np.array([5.0, 4.0, 4.5, 3.0, 1.0])    # rel 0.25, 0, 0.125, 0.25; NaN pair dropped
    assert M.frac_rel_below(a, b, 0.25) == 0.5   # exactly 0.25 is not below 0.25
    assert M.frac_rel_below(a, b, 0.125) == 0.25
    assert M.frac_rel_below(a, b, 0.2500001) == 1.0
    assert M.max_rel(a, b) == 0.25 and M.max_abs(a, b) == 1.0
    assert M.mean_abs(a, b) == pytest.approx((1.0 + 0.0 + 0.5 + 1.0) / 4)
    assert M.rmse(a, b) == pytest.approx(math.sqrt((1.0 + 0.25 + 1.0) / 4))


def test_nan_inf_mismatch_counts_signed_infinities_only_where_both_are_inf():
    inf = np.inf
    assert M.nan_inf_mismatch(np.array([inf, inf, -inf]), np.array([inf, -inf, -inf])) == 1
    assert M.nan_inf_mismatch(np.array([2.0, -3.0]), np.array([-2.0, 3.0])) == 0  # finite
    assert M.nan_inf_mismatch(np.array([inf, 1.0, np.nan]), np.array([1.0, inf, np.nan])) == 2
    assert M.nan_inf_mismatch(np.array([np.nan, 1.0]), np.array([inf, np.nan])) == 2


def test_float16_and_bfloat16_ulp_signs_zero_and_rounding():
    f32 = np.float32
    one = np.array([1.0], f32)
    for dtype, ulp, tiny in (("float16", 2.0 ** -10, 2.0 ** -24),
                             ("bfloat16", 2.0 ** -7, 2.0 ** -133)):
        assert M.max_ulp(one, one + f32(ulp), dtype) == 1, dtype
        assert M.max_ulp(-one, -one - f32(ulp), dtype) == 1, dtype
        assert M.max_ulp(-one, -one - f32(3 * ulp), dtype) == 3, dtype
        assert M.max_ulp(np.array([tiny], f32), np.array([-tiny], f32), dtype) == 2, dtype
        assert M.max_ulp(np.array([0.0], f32), np.array([-0.0], f32), dtype) == 0, dtype
        assert M.max_ulp(np.array([-2.0], f32), np.array([2.0], f32), dtype) == \
            2 * M.max_ulp(np.array([0.0], f32), np.array([2.0], f32), dtype), dtype
    # values are rounded to nearest EVEN into bfloat16 first
    h = 2.0 ** -8                                       # half a bf16 ULP at 1.0
    assert M.max_ulp(one, one + f32(h), "bfloat16") == 0            # tie -> even (1.0)
    assert M.max_ulp(one, one + f32(3 * h), "bfloat16") == 2        # tie -> even (1 + 2^-6)
    assert M.max_ulp(one, one + f32(h + 2.0 ** -20), "bfloat16") == 1   # above the tie
    assert M.max_ulp(-one, -one - f32(3 * h), "bfloat16") == 2
    # float16: the same rule (numpy's float16 rounding)
    assert M.max_ulp(one, one + f32(2.0 ** -11), "float16") == 0
    assert M.max_ulp(one, one + f32(3 * 2.0 ** -11), "float16") == 2


def test_float64_ulp():
    one = np.array([1.0])
    assert M.max_ulp(one, np.nextafter(one, 2.0), "float64") == 1
    assert M.max_ulp(-one, np.nextafter(-one, -2.0), "float64") == 1
    assert M.max_ulp(one, one + 2 ** -50, "float64") == 4
    assert M.max_ulp(np.array([0.0]), np.array([-0.0]), "float64") == 0
    assert M.max_ulp(np.array([5e-324]), np.array([-5e-324]), "float64") == 2
    # the float32 ULP of 1 + 2^-23 is 2^29 float64 ULPs
    assert M.max_ulp(one, one + 2 ** -23, "float64") == 2 ** 29
    assert M.max_ulp(np.array([1.0, 2.0]), np.array([1.0, 2.0 + 2 ** -51]), "float64") == 1


def test_one_near_zero_element_does_not_move_rel_l2():
    """The tensor-level error ignores what a single near-zero element does to max_rel."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal(10_000)
    a[17] = 1e-9
    b = a.copy()
    b[17] = -1e-9  # 200% relative error on one element
    assert M.max_rel(a, b) == pytest.approx(2.0)
    assert M.rel_l2(a, b) < 1e-10


def test_cosine_is_clamped_to_minus_one_one():
    """1 - cos from the norms can round past +-1 for nearly (anti-)parallel vectors: clamped."""
    a = np.array([0.35867194917034445, 1.3224574697668332])
    b = np.array([0.3586719491703442, 1.3224574697668552])       # unclamped: 1 + 2.2e-16
    assert M.cosine(a, b) == 1.0 and M.tensor_metrics(a, b).cosine == 1.0
    a = np.array([0.357380410658956, -1.2083186322821715])
    b = np.array([-0.3573804106589559, 1.2083186322821646])      # unclamped: -1 - 4.4e-16
    assert M.cosine(a, b) == -1.0 and M.tensor_metrics(a, b).cosine == -1.0


def test_tensor_metrics_record_is_frozen_and_identical_means_no_difference():
    import dataclasses

    a = np.linspace(1.0, 2.0, 10)
    m = M.tensor_metrics(a, a * 1.1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.rel_l2 = 0.0
    assert not m.identical and M.tensor_metrics(a, a).identical
    assert m.as_dict()["rel_l2"] == m.rel_l2 and set(m.as_dict()) == {
        f.name for f in dataclasses.fields(m)}


def test_nan_inf_positions():
    a = np.array([1.0, np.nan, np.inf, 3.0, -np.inf])
    b = np.array([1.0, np.nan, -np.inf, np.nan, -np.inf])
    assert M.nan_inf_mismatch(a, b) == 2
    # elementwise metrics only look at positions finite on both sides
    assert M.max_abs(a, b) == 0.0
    m = M.tensor_metrics(a, b)
    assert m.nan_inf_mismatch == 2 and m.max_abs == 0.0 and not m.identical


@pytest.mark.parametrize("ref_dtype,cand_dtype", [("float32", "float32"),
                                                  ("float32", "bfloat16"),
                                                  ("float64", "float16")])
def test_chunked_accumulator_equals_whole_array(ref_dtype, cand_dtype):
    rng = np.random.default_rng(1)
    a = rng.standard_normal(5003).astype(np.float64 if ref_dtype == "float64" else np.float32)
    b = (a * (1 + 1e-3 * rng.standard_normal(a.size))).astype(a.dtype)
    a[10], b[20] = np.nan, np.inf
    if cand_dtype == "bfloat16":
        b = bf16(b)
    elif cand_dtype == "float16":
        b = b.astype(np.float16)
    acc = M.MetricAccumulator(ref_dtype, cand_dtype, rtol=1e-3, atol=1e-5)
    for i in range(0, a.size, 997):
        acc.add(a[i:i + 997], b[i:i + 997])
    got = acc.result()
    whole = M.tensor_metrics(a, b, ref_dtype, cand_dtype, rtol=1e-3, atol=1e-5)
    fin = np.isfinite(a.astype(np.float64)) & np.isfinite(b.astype(np.float64))
    for name in ("max_abs", "max_rel", "max_ulp", "nan_inf_mismatch", "worst_index",
                 "mismatched", "numel"):
        assert getattr(got, name) == getattr(whole, name), name
    for name in ("mean_abs", "rel_l2", "cosine", "sqnr_db", "rmse", "frac_rel_lt_1e3",
                 "frac_rel_lt_5e3"):
        assert getattr(got, name) == pytest.approx(getattr(whole, name), rel=1e-12), name
    # and the accumulator agrees with the pure functions
    assert got.rel_l2 == pytest.approx(M.rel_l2(a, b), rel=1e-12)
    assert got.max_rel == M.max_rel(a, b)
    assert got.frac_rel_lt_1e3 == pytest.approx(M.frac_rel_below(a, b, 1e-3))
    assert got.max_ulp == M.max_ulp(a, b, M.coarser_dtype(ref_dtype, cand_dtype))
    assert got.nan_inf_mismatch == 2
    assert got.worst_index is not None and fin[got.worst_index]
    assert abs(got.worst_ref - got.worst_cand) == got.max_abs
    d = np.abs(a.astype(np.float64) - b.astype(np.float64))[fin]
    assert got.mismatched == int(np.count_nonzero(d > 1e-5 + 1e-3 * np.abs(a[fin])))


def test_accumulator_equals_the_pure_functions_across_blocks():
    """Against the pure functions (not itself), on a tensor spanning several internal blocks
    and chunks: the worst element's flat index counts the blocks before it."""
    rng = np.random.default_rng(8)
    n = 3 * (1 << 16) + 123
    a = rng.standard_normal(n)
    b = a * (1 + 1e-4 * rng.standard_normal(n))
    b[:70_000] = a[:70_000]                # the first block is identical
    a[150_001], b[150_001] = 1.0, 6.0      # in the third block of the second chunk
    a[190_000], b[190_000] = 2.0, -3.0     # exactly as large: the first one stays the worst
    acc = M.MetricAccumulator("float64", "float64")
    acc.add(np.array([np.nan, np.inf]), np.array([np.nan, np.inf]))   # nothing finite here
    for i in range(0, n, 150_000):          # chunk 1 holds blocks at 0, 65536 and 131072
        acc.add(a[i:i + 150_000], b[i:i + 150_000])
    m = acc.result()
    a, b = np.concatenate([[np.nan, np.inf], a]), np.concatenate([[np.nan, np.inf], b])
    assert m.numel == n + 2 and m.worst_index == 150_003 and m.nan_inf_mismatch == 0
    assert (m.worst_ref, m.worst_cand) == (a[150_003], b[150_003])
    # the worst element in a later block of a chunk: the block's offset inside the chunk counts
    a2, b2 = a[2:].copy(), b[2:].copy()
    a2[140_000], b2[140_000] = 0.0, 9.0
    acc = M.MetricAccumulator("float64", "float64")
    acc.add(a2[:150_000], b2[:150_000])
    acc.add(a2[150_000:], b2[150_000:])
    assert acc.result().worst_index == 140_000
    assert m.max_abs == M.max_abs(a, b) and m.max_rel == M.max_rel(a, b)
    for name, fn in (("mean_abs", M.mean_abs), ("rel_l2", M.rel_l2), ("cosine", M.cosine),
                     ("sqnr_db", M.sqnr_db), ("rmse", M.rmse)):
        assert getattr(m, name) == pytest.approx(fn(a, b), rel=1e-9), name
    assert m.frac_rel_lt_1e3 == pytest.approx(M.frac_rel_below(a, b, 1e-3), abs=1e-12)
    assert m.frac_rel_lt_5e3 == pytest.approx(M.frac_rel_below(a, b, 5e-3), abs=1e-12)
    assert m.max_ulp == M.max_ulp(a, b, "float64")


def test_accumulator_thresholds_are_strict_and_zero_over_zero_counts_as_agreeing():
    # relative error exactly 1e-3 / 5e-3 is not below it (as frac_rel_below)
    a = np.array([1000.0, 1000.0, 1.0, 1000.0, 1000.0])
    b = np.array([1001.0, 1005.0, 1.0, 1003.0, 1000.5])    # rel 1e-3, 5e-3, 0, 3e-3, 5e-4
    m = M.tensor_metrics(a, b, "float64", "float64")
    assert (m.frac_rel_lt_1e3, m.frac_rel_lt_5e3) == (pytest.approx(2 / 5), pytest.approx(4 / 5))
    assert m.frac_rel_lt_1e3 == pytest.approx(M.frac_rel_below(a, b, 1e-3))
    # 0 vs 0 is no error (rel 0), whatever else the chunk holds; x vs 0 is an infinite one
    a, b = np.array([0.0, 0.0, 1.0, 0.0]), np.array([0.0, 0.0, 2.0, 1e-3])
    m = M.tensor_metrics(a, b, "float64", "float64")
    assert (m.frac_rel_lt_1e3, m.frac_rel_lt_5e3) == (0.5, 0.5)
    assert m.max_rel == math.inf and M.max_rel(a, b) == math.inf
    assert M.frac_rel_below(a, b, 1e-3) == 0.5
    # the elementwise check: |ref - cand| <= atol + rtol * |ref| is within (at the limit too)
    a, b = np.array([1.0, 2.0, 4.0, 4.0]), np.array([1.5, 2.75, 4.0, 6.5])
    m = M.tensor_metrics(a, b, "float64", "float64", rtol=0.25, atol=0.25)
    assert m.mismatched == 1                   # 0.5 <= 0.5, 0.75 <= 0.75, 0 ok, 2.5 > 1.25
    assert M.tensor_metrics(a, b, "float64", "float64", rtol=0.0, atol=0.5).mismatched == 2


def test_accumulator_contract():
    with pytest.raises(ValueError, match="together"):
        M.MetricAccumulator("float32", "float32", rtol=1e-3)
    with pytest.raises(ValueError, match="together"):
        M.MetricAccumulator("float32", "float32", atol=1e-3)
    with pytest.raises(ValueError, match="chunk sizes differ"):
        M.MetricAccumulator("float32", "float32").add(np.ones(3), np.ones(1))
    # the ULP dtype: the coarser float dtype of the pair, none when either side is not float
    for ref, cand, want in (("float32", "bfloat16", "bfloat16"), ("float64", "float16", "float16"),
                            ("float32", "int64", None), ("int64", "float32", None),
                            ("int64", "int64", None), ("float8_e4m3fn", "float32", None)):
        acc = M.MetricAccumulator(ref, cand)
        assert acc.ulp_dtype == want, (ref, cand)
        acc.add(np.arange(4.0), np.arange(4.0) + 1)
        assert (acc.result().max_ulp is None) == (want is None), (ref, cand)
    # nothing added: zero elements, nothing differs
    m = M.MetricAccumulator("float32", "float32").result()
    assert (m.numel, m.max_abs, m.mean_abs, m.rmse, m.rel_l2, m.cosine) == (0, 0.0, 0.0, 0.0,
                                                                            0.0, 1.0)
    assert (m.worst_index, m.frac_rel_lt_1e3, m.frac_rel_lt_5e3, m.max_ulp) == (None, 1.0, 1.0, 0)
    # identical: no worst element; without rtol/atol, no mismatch count
    m = M.tensor_metrics(np.ones(5), np.ones(5))
    assert (m.numel, m.worst_index, m.mismatched, m.frac_rel_lt_5e3) == (5, None, None, 1.0)


def test_ulp_in_the_coarser_dtype():
    x = np.float32(1.0) + np.float32(2 ** -23) * np.arange(0, 300, 7, dtype=np.float32)
    # a float32 reference and its own bfloat16 rounding are 0 bf16 ULPs apart ...
    assert M.max_ulp(x, bf16(x), "bfloat16") == 0
    # ... but many float32 ULPs
    assert M.max_ulp(x, bf16(x), "float32") > 100
    one = np.array([1.0], np.float32)
    assert M.max_ulp(one, np.nextafter(one, np.float32(2)), "float32") == 1
    assert M.max_ulp(one, one + np.float32(2 ** -7), "bfloat16") == 1
    assert M.max_ulp(np.array([1.0]), np.array([1.0 + 2 ** -10]), "float16") == 1
    assert M.max_ulp(np.array([0.0]), np.array([-0.0]), "float32") == 0
    # across zero: the smallest subnormals on either side are 2 ULPs apart
    assert M.max_ulp(np.array([1e-45], np.float32), np.array([-1e-45], np.float32),
                     "float32") == 2
    acc = M.MetricAccumulator("float32", "bfloat16")
    acc.add(x, bf16(x))
    assert acc.result().max_ulp == 0 and acc.result().ulp_dtype == "bfloat16"
    assert M.max_ulp(np.arange(3), np.arange(3), "int64") is None
    assert M.coarser_dtype("float16", "bfloat16") == "bfloat16"
    assert M.coarser_dtype("float32", "int64") == "float32"


def test_dtype_order_fine_to_coarse():
    """coarser_dtype (and the tolerance's loosest_dtype) rank every pair, both argument orders;
    non-float dtypes count as exact (finest)."""
    from accucheck.compare.tolerances import loosest_dtype

    order = ["int64", "float64", "float32", "float16", "bfloat16", "float8_e4m3fn",
             "float8_e5m2"]
    for i, fine in enumerate(order):
        for coarse in order[i + 1:]:
            assert M.coarser_dtype(fine, coarse) == coarse, (fine, coarse)
            assert M.coarser_dtype(coarse, fine) == coarse, (coarse, fine)
            assert loosest_dtype([fine, coarse]) == loosest_dtype([coarse, fine]) == coarse
    assert M.coarser_dtype("int64", "bool") == "int64"   # both exact: the first one
    assert [M.is_float_dtype(d) for d in order] == [False] + [True] * 6


def test_bf16_rounding_of_an_fp32_tensor_has_the_expected_rel_l2():
    """Calibration anchor: bf16 rounding is a uniform half-ULP error, rel_l2 ~ 1.5e-3."""
    rng = np.random.default_rng(2)
    a = rng.standard_normal(100_000).astype(np.float32)
    r = M.rel_l2(a, bf16(a))
    assert 1.0e-3 < r < 2.5e-3


def test_kl_is_ref_to_cand_on_an_asymmetric_pair():
    """KL(p_ref || p_cand), not the reverse: a peaked reference against a uniform candidate
    (a permuted pair would have KL(p||q) == KL(q||p) and tell nothing)."""
    ref, cand = np.array([[2.0, 0.0, 0.0]]), np.array([[0.0, 0.0, 0.0]])
    z = math.exp(2.0) + 2.0
    p = np.array([math.exp(2.0), 1.0, 1.0]) / z        # softmax(ref)
    q = np.full(3, 1.0 / 3.0)                           # softmax(cand)
    forward = float(np.sum(p * np.log(p / q)))          # 0.4330...
    backward = float(np.sum(q * np.log(q / p)))         # 0.4742...
    assert forward == pytest.approx(0.43304, abs=1e-5) and backward - forward > 0.04
    assert M.kl_div(ref, cand)[0] == pytest.approx(forward, rel=1e-12)
    assert M.kl_div(cand, ref)[0] == pytest.approx(backward, rel=1e-12)
    # several rows at once, each its own distribution; never negative (rounding is clipped)
    both = M.kl_div(np.vstack([ref, ref]), np.vstack([cand, ref + 7.0]))
    assert both[0] == pytest.approx(forward, rel=1e-12) and both[1] == 0.0


def test_logits_metrics_on_large_logits_and_small_vocabularies():
    # log-softmax subtracts the row maximum: logits of 1000 do not overflow
    ls = M.log_softmax(np.array([[1000.0, 0.0], [-1000.0, -1001.0]]))
    assert np.isfinite(ls).all()
    assert ls[0].tolist() == pytest.approx([0.0, -1000.0])
    assert ls[1].tolist() == pytest.approx([-math.log1p(math.exp(-1.0)),
                                            -1.0 - math.log1p(math.exp(-1.0))])
    assert M.kl_div(np.array([[1000.0, 0.0]]), np.array([[1000.0, 0.0]]))[0] == 0.0
    # top-k with k at or above the vocabulary size: every token, overlap 1
    x = np.array([[3.0, 1.0, 2.0]])
    assert M.topk_overlap(x, x[:, ::-1], 3).tolist() == [1.0]
    assert M.topk_overlap(x, -x, 5).tolist() == [1.0]
    # top-1 minus top-2 per row; a one-token vocabulary has no margin; a tie has margin 0
    assert M.top2_margin(np.array([[1.0, 3.0], [4.0, 1.5]])).tolist() == [2.0, 2.5]
    assert M.top2_margin(np.array([[3.0], [1.0]])).tolist() == [0.0, 0.0]
    assert M.top2_margin(np.array([2.0, 5.0, 5.0, 1.0])).tolist() == [0.0]
    # the default k is 5: the 6th token does not count
    r = np.array([[9.0, 8.0, 7.0, 6.0, 5.0, 4.0, 0.0, 0.0]])
    c = np.array([[9.0, 8.0, 7.0, 6.0, 0.0, 4.0, 5.0, 0.0]])  # 5th and 7th swapped
    assert M.topk_overlap(r, c).tolist() == [0.8] == M.topk_overlap(r, c, 5).tolist()
    assert M.topk_overlap(r, c, 6).tolist() == pytest.approx([5 / 6])


def test_logits_metrics():
    ref = np.array([[3.0, 1.0, 0.5, 0.0, -1.0, -2.0],
                    [1.0, 0.99, 0.0, 0.0, 0.0, 0.0]])
    cand = np.array([[3.0, 1.0, 0.5, 0.0, -1.0, -2.0],
                     [0.99, 1.0, 0.0, 0.0, 0.0, 0.5]])
    kl = M.kl_div(ref, cand)
    assert kl[0] == 0.0 and kl[1] > 0
    p, q = np.exp(M.log_softmax(ref[1])[0]), np.exp(M.log_softmax(cand[1])[0])
    assert kl[1] == pytest.approx(np.sum(p * np.log(p / q)), rel=1e-12)
    assert kl[1] != pytest.approx(np.sum(q * np.log(q / p)), rel=1e-3)
    assert M.top1_agree(ref, cand).tolist() == [True, False]
    assert M.top2_margin(ref).tolist() == pytest.approx([2.0, 0.01])
    assert M.topk_overlap(ref, cand, 2).tolist() == [1.0, 1.0]
    assert M.topk_overlap(ref, -ref, 2).tolist() == [0.0, 0.0]
    assert M.topk_overlap(ref, cand, 3).tolist() == pytest.approx([1.0, 2 / 3])
    # noise is shift-invariant: a constant offset is not logit error
    assert M.logit_noise(ref, ref + 5.0).tolist() == pytest.approx([0.0, 0.0])
    d = cand[1] - ref[1]
    assert M.logit_noise(ref, cand)[1] == pytest.approx(float(np.std(d)), rel=1e-12)


def test_logit_noise_leaves_out_the_two_tokens_that_trade_places():
    """A fault that lifts one token's logit over the top-1 flips the token; counted in the
    noise, that one moved logit would make any such flip a near-tie (one logit moved by x
    among 32 unmoved is a spread of 0.17x). Left out, the noise is the other tokens' spread."""
    rng = np.random.default_rng(1)
    ref = rng.normal(size=(1, 500))
    d = 1e-3 * rng.normal(size=(1, 500))
    top = np.argsort(ref[0])[-M.LOGIT_NOISE_TOP:]
    margin = ref[0, top[-1]] - ref[0, top[-2]]
    d[0, top[-5]] += ref[0, top[-1]] - ref[0, top[-5]] + 0.5    # the 5th token jumps over
    cand = ref + d
    assert np.argmax(cand[0]) == top[-5]
    others = np.delete(d[0, top], [len(top) - 1, len(top) - 5])
    noise = float(M.logit_noise(ref, cand)[0])
    assert noise == pytest.approx(float(np.std(others)), rel=1e-12)
    assert margin > 8 * noise
    everything = float(np.std(d[0, top]))                          # the moved one counted
    assert margin < 8 * everything
    # too few left: measured over all of them
    c6 = cand[:, :6] + 1e-3 * np.arange(6)
    assert M.logit_noise(ref[:, :6], c6)[0] == pytest.approx(float(np.std(c6 - ref[:, :6])),
                                                             rel=1e-12)


def test_logit_noise_is_measured_where_a_flip_happens_at_the_top_logits():
    """Rounding errors scale with the logit: a row whose error sits at its largest logits has
    the noise of its top logits, not the vocabulary's (which the many small logits dilute)."""
    rng = np.random.default_rng(0)
    ref = rng.normal(size=(1, 1000))
    d = 1e-3 * rng.normal(size=(1, 1000))
    top = np.argsort(ref[0])[-M.LOGIT_NOISE_TOP:]
    d[0, top] = 0.1 * np.where(np.arange(len(top)) % 2 == 0, 1.0, -1.0)
    d -= d.mean()
    noise = float(M.logit_noise(ref, ref + d + 7.0)[0])   # the shift is no error
    assert noise == pytest.approx(0.1, rel=0.02)
    assert noise > 3 * float(np.std(d))                    # the vocabulary's spread is far less
    # spread evenly, the vocabulary's spread is the noise
    flat = 0.05 * rng.normal(size=(1, 1000))
    assert float(M.logit_noise(ref, ref + flat)[0]) == pytest.approx(float(np.std(flat)), rel=0.2)


def test_metrics_module_is_pure():
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(M))
    mods = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
            for a in n.names}
    mods |= {n.module.split(".")[0] for n in ast.walk(tree)
             if isinstance(n, ast.ImportFrom) and n.module}
    assert mods <= {"__future__", "math", "dataclasses", "numpy"}
