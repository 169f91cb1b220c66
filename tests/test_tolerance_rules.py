"""compare.tolerances probed where a plausible wrong rule gives another answer (issue 16: tests
that can fail): every documented default row (float64 and float8 included), which dtype names
the row, frozen criteria, and each guard of the --tol override parser with a concrete bad input
and its exact message. No files, no model: each test runs in milliseconds."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from accucheck.compare.metrics import DTYPE_EPS, tensor_metrics
from accucheck.compare.tolerances import (DEFAULT_REL_L2, Tolerance, ToleranceTable,
                                          loosest_dtype, parse_override)
from accucheck.errors import EXIT_USAGE, UserError
from accucheck.keys import RecordKey
from test_tolerances import DOC

K = RecordKey.parse("r0.s1:model.layers.3.mlp#0:out.0")
USE = ("use PATTERN=REL_L2 or PATTERN=rel_l2:X,rtol:X,atol:X (e.g. '*.mlp=rel_l2:1e-3')")


def _usage_error(fn, *args, **kwargs) -> str:
    with pytest.raises(UserError) as e:
        fn(*args, **kwargs)
    assert e.value.exit_code == EXIT_USAGE
    return str(e.value)


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16", "bfloat16", "float8_e4m3fn",
                                   "float8_e5m2"])
def test_each_documented_row_is_the_default(dtype):
    """The README's numbers (parsed in test_tolerances.DOC), one dtype at a time, as the table
    hands them out: both sides of that dtype, and that dtype against float32."""
    t = ToleranceTable()
    tol = t.for_record(K, (dtype, dtype))
    assert (tol.rel_l2, tol.rtol, tol.atol, tol.source) == (DOC[dtype], None, None,
                                                            f"default {dtype}")
    looser = dtype if DTYPE_EPS[dtype] >= DTYPE_EPS["float32"] else "float32"
    assert t.for_record(K, ("float32", dtype)).rel_l2 == DOC[looser]
    assert t.as_dict()["rel_l2_by_dtype"][dtype] == DOC[dtype]


def test_documented_rows_order_the_dtypes_by_precision():
    """A coarser dtype never gets a tighter default than a finer one (float64 < float32 <
    float16 < bfloat16 < float8_e4m3fn < float8_e5m2)."""
    by_eps = sorted(DEFAULT_REL_L2, key=DTYPE_EPS.__getitem__)
    assert by_eps == ["float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"]
    assert [DOC[d] for d in by_eps] == [1e-10, 5e-5, 1e-2, 5e-2, 0.25, 0.4]


def test_exact_dtypes_never_win_over_a_float_and_the_first_names_the_row():
    # an integer / unknown dtype counts as exact (eps 0), whatever its position
    assert loosest_dtype(["float64", "int64"]) == "float64"
    assert loosest_dtype(["int64", "bfloat16"]) == "bfloat16"
    assert loosest_dtype(["float8_e5m2", "float8_e4m3fn", "bool"]) == "float8_e5m2"
    assert loosest_dtype(["float8_e4m3fn", "bfloat16"]) == "float8_e4m3fn"
    # among exact dtypes only, the first one listed (the reference's) names the row
    assert loosest_dtype(["int32", "bool"]) == "int32"
    assert loosest_dtype(["bool", "int32", None]) == "bool"
    assert loosest_dtype([]) == "int64" and loosest_dtype([None, None]) == "int64"
    t = ToleranceTable()
    tol = t.for_record(K, ("int32", "int64"))
    assert (tol.rel_l2, tol.source) == (0.0, "default int32")
    tol = t.for_record(K, ("uint8", "float16"))
    assert (tol.rel_l2, tol.source) == (DOC["float16"], "default float16")


def test_tolerances_are_frozen_and_hashable():
    tol = Tolerance(1e-3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        tol.rel_l2 = 1.0
    table = ToleranceTable()
    with pytest.raises(dataclasses.FrozenInstanceError):
        table.rtol = 1e-3
    assert hash(tol) == hash(Tolerance(1e-3)) and hash(table) == hash(ToleranceTable())


@pytest.mark.parametrize("spec", ["nopattern", "=1e-3", "*.mlp=", "="])
def test_override_without_pattern_or_value_says_how_to_write_one(spec):
    assert _usage_error(parse_override, spec) == f"bad tolerance override {spec!r}: {USE}"


@pytest.mark.parametrize("spec, field", [("*.mlp=foo:1", "foo"),
                                         ("*.mlp=rel_l2:1e-3,foo:1", "foo"),
                                         ("*.mlp=rtol:1e-3,atol:0,max:2", "max")])
def test_override_unknown_field(spec, field):
    assert _usage_error(parse_override, spec) == (
        f"bad tolerance override {spec!r}: unknown field {field!r} (use rel_l2, rtol, atol)")


@pytest.mark.parametrize("spec, num", [("*.mlp=fast", "fast"), ("*.mlp=rtol:x,atol:0", "x"),
                                       ("*.mlp=,", "")])
def test_override_value_not_a_number(spec, num):
    assert _usage_error(parse_override, spec) == (
        f"bad tolerance override {spec!r}: {num!r} is not a number")


@pytest.mark.parametrize("spec", ["*.mlp=rtol:1e-3", "*.mlp=1e-2,atol:0"])
def test_override_rtol_atol_together_even_when_the_table_has_both(spec):
    want = f"bad tolerance override {spec!r}: give rtol and atol together, or neither"
    assert _usage_error(parse_override, spec) == want
    base = ToleranceTable(rtol=1e-2, atol=1e-4)
    assert _usage_error(parse_override, spec, base) == want


def test_override_values_are_checked_like_any_tolerance():
    assert _usage_error(parse_override, "*.mlp=-1") == \
        "tolerance rel_l2=-1.0 must be a finite number >= 0"
    assert _usage_error(parse_override, "*.mlp=rtol:1e-3,atol:nan") == \
        "tolerance atol=nan must be a finite number >= 0"
    assert _usage_error(Tolerance, 1e-3, rtol=1e-3) == \
        "give --rtol and --atol together, or neither"
    assert _usage_error(ToleranceTable.from_options, atol=1e-3) == \
        "give --rtol and --atol together, or neither"


def test_good_overrides_parse_to_exact_values():
    pat, tol = parse_override("*.mlp= rel_l2 :2e-3")
    assert (pat, tol.rel_l2, tol.rtol, tol.atol, tol.source) == (
        "*.mlp", 2e-3, None, None, "override *.mlp")
    base = ToleranceTable(rtol=1e-2, atol=1e-4)
    pat, tol = parse_override("model.norm=5e-1", base)       # rtol/atol from the table
    assert (pat, tol.rel_l2, tol.rtol, tol.atol) == ("model.norm", 0.5, 1e-2, 1e-4)
    pat, tol = parse_override("logits=atol:1,rtol:0", base)   # elementwise only, own values
    assert (pat, tol.rel_l2, tol.rtol, tol.atol) == ("logits", 1e300, 0.0, 1.0)
    pat, tol = parse_override("x=rel_l2:inf,rtol:0,atol:0")   # an explicit inf: no limit
    assert (tol.rel_l2, tol.rtol, tol.atol) == (1e300, 0.0, 0.0)
    pat, tol = parse_override("x=0,rtol:1e-3,atol:1e-6")
    assert (tol.rel_l2, tol.rtol, tol.atol) == (0.0, 1e-3, 1e-6)


def test_from_options_builds_the_table_it_was_given():
    t = ToleranceTable.from_options(rel_l2=2e-3, rtol=1e-3, atol=1e-6, overrides=["*.mlp=1e-1"])
    assert dict(t.by_dtype) == {d: 2e-3 for d in DEFAULT_REL_L2}
    assert (t.rtol, t.atol) == (1e-3, 1e-6)
    assert t.overrides == (("*.mlp", Tolerance(1e-1, 1e-3, 1e-6, "override *.mlp")),)
    plain = ToleranceTable.from_options()
    assert plain == ToleranceTable() and dict(plain.by_dtype) == DEFAULT_REL_L2


def test_within_answers_a_bool_for_each_rule():
    """within() is written to JSON and csv as it is: False, never a falsy None."""
    a = np.linspace(1, 2, 100)
    b = a.copy()
    b[3] = np.nan
    nan = tensor_metrics(a, b)
    assert Tolerance(1.0).within(nan) is False                      # NaN position differs
    far = tensor_metrics(a, a * (1 + 1e-3))
    assert Tolerance(1e-4).within(far) is False                     # rel_l2 over the limit
    assert Tolerance(1e-2).within(far) is True
    ew = tensor_metrics(a, a * (1 + 1e-3), rtol=1e-4, atol=0.0)
    assert Tolerance(1e-2, rtol=1e-4, atol=0.0).within(ew) is False  # elementwise
    assert Tolerance(1e-2, rtol=1e-2, atol=0.0).within(
        tensor_metrics(a, a * (1 + 1e-3), rtol=1e-2, atol=0.0)) is True
