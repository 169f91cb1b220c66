"""Tolerance table: looser dtype wins, overrides, both-or-neither, calibration on real captures."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

import diffcases
from accucheck.errors import EXIT_USAGE, UserError
from accucheck.keys import RecordKey
from accucheck.metrics import tensor_metrics
from accucheck.tolerances import (DEFAULT_AMPLIFICATION, DEFAULT_REL_L2, GOLDEN_MULTIPLIER,
                                  Tolerance, ToleranceTable, loosest_dtype, parse_override)

K = RecordKey.parse("r0.s1:model.layers.3.mlp#0:out.0")
ROOT = Path(__file__).resolve().parents[1]


def _documented() -> dict:
    """The numbers the README and docs/diff-json.md promise, parsed from their text: a change
    on either side (code or documentation) alone fails the tests below."""
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    m = re.search(r"\(float32 ([0-9.e+-]+), float16 ([0-9.e+-]+), bfloat16 ([0-9.e+-]+);", readme)
    assert m, "README no longer states the dtype tolerances"
    amp = re.search(r'"introduced" when its error is more than ([0-9.]+)x the error', readme)
    assert amp, "README no longer states the amplification threshold"
    doc = " ".join((ROOT / "docs" / "diff-json.md").read_text(encoding="utf-8").split())
    g = re.search(r"multiplier ([0-9.]+) for fp32/fp64 pairs, ([0-9.]+) for 16-bit", doc)
    assert g, "docs/diff-json.md no longer states the golden multipliers"
    return {"float32": float(m.group(1)), "float16": float(m.group(2)),
            "bfloat16": float(m.group(3)), "amplification": float(amp.group(1)),
            "golden_32": float(g.group(1)), "golden_16": float(g.group(2))}


DOC = _documented()


def test_documented_constants_are_the_code_constants():
    assert DOC == {"float32": 5e-5, "float16": 1e-2, "bfloat16": 5e-2, "amplification": 4.0,
                   "golden_32": 2.0, "golden_16": 3.0}
    for d in ("float32", "float16", "bfloat16"):
        assert DEFAULT_REL_L2[d] == DOC[d], d
        assert ToleranceTable().for_record(K, (d, d)).rel_l2 == DOC[d], d
    assert DEFAULT_AMPLIFICATION == DOC["amplification"]
    assert GOLDEN_MULTIPLIER == {"float64": DOC["golden_32"], "float32": DOC["golden_32"],
                                 "float16": DOC["golden_16"], "bfloat16": DOC["golden_16"]}


def test_documented_defaults_reach_the_diff_and_locate(tmp_path):
    """The defaults as the diff applies them (no option given): per-record tolerance by the
    runs' dtype, the golden multiplier by the runs' dtype, locate's amplification."""
    from test_diff import base, write

    from accucheck.diff import diff_captures
    from accucheck.locate import analyze

    t = base()
    for run_dtype, tol, mult in (("float32", DOC["float32"], DOC["golden_32"]),
                                 ("bfloat16", DOC["bfloat16"], DOC["golden_16"]),
                                 ("float16", DOC["float16"], DOC["golden_16"])):
        d = tmp_path / run_dtype
        d.mkdir()
        a, b = write(d / "a.h5", t, dtype=run_dtype), write(d / "b.h5", t, dtype=run_dtype)
        g = write(d / "g.h5", t, dtype="float64")
        res = diff_captures(a, b, g)
        assert {r.tolerance.rel_l2 for r in res.records} == {tol}, run_dtype
        assert {r.golden.multiplier for r in res.records} == {mult}, run_dtype
    assert analyze(a, b).location.amplification == DOC["amplification"]


def test_looser_dtype_wins():
    t = ToleranceTable()
    assert t.for_record(K, ("float32", "float32")).rel_l2 == DOC["float32"]
    assert t.for_record(K, ("float32", "bfloat16")).rel_l2 == DOC["bfloat16"]
    assert t.for_record(K, ("bfloat16", "float16")).rel_l2 == DOC["bfloat16"]
    assert t.for_record(K, ("float16", "float32")).rel_l2 == DOC["float16"]
    # the capture's compute dtype counts: fp32 logits of a bf16 model are judged as bf16
    assert t.for_record(K, ("float32", "float32", "bfloat16", None)).rel_l2 == DOC["bfloat16"]
    assert t.for_record(K, ("int64", "int64")).rel_l2 == 0.0
    assert t.for_record(K, ("float32", "float32")).source == "default float32"
    assert loosest_dtype(["float64", None, "float16"]) == "float16"
    assert loosest_dtype(["bfloat16", "float16"]) == "bfloat16"
    assert loosest_dtype([None, "int64"]) == "int64"
    assert DEFAULT_REL_L2["float64"] < DOC["float32"]


def test_overrides_last_match_wins_and_match_module_site_or_key():
    t = ToleranceTable.from_options(overrides=["*.mlp=1e-2", "model.layers.3.*=rel_l2:2e-2",
                                               "r0.s1:*=rtol:1e-3,atol:1e-5"])
    tol = t.for_record(K, ("float32", "float32"))
    assert (tol.rel_l2, tol.rtol, tol.atol) == (1e300, 1e-3, 1e-5)
    assert tol.source == "override r0.s1:*"
    k0 = RecordKey.parse("r0.s0:model.layers.3.mlp#0:out.0")
    assert t.for_record(k0, ("float32",)).rel_l2 == 2e-2
    k2 = RecordKey.parse("r0.s0:model.layers.2.mlp#0:out.0")
    assert t.for_record(k2, ("float32",)).rel_l2 == 1e-2
    assert t.for_record(RecordKey.parse("r0.s0:model.norm#0:out.0"), ("float32",)).source == \
        "default float32"
    assert ToleranceTable.from_options(rel_l2=1e-3).for_record(K, ("bfloat16",)).rel_l2 == 1e-3


@pytest.mark.parametrize("kwargs", [dict(rtol=1e-3), dict(atol=1e-5)])
def test_rtol_atol_both_or_neither(kwargs):
    with pytest.raises(UserError) as e:
        ToleranceTable.from_options(**kwargs)
    assert e.value.exit_code == EXIT_USAGE
    with pytest.raises(UserError):
        Tolerance(1e-3, **kwargs)


@pytest.mark.parametrize("spec", ["nopattern", "*.mlp=", "*.mlp=fast", "*.mlp=rtol:1e-3",
                                  "*.mlp=foo:1", "*.mlp=-1"])
def test_bad_overrides_are_usage_errors(spec):
    with pytest.raises(UserError) as e:
        parse_override(spec)
    assert e.value.exit_code == EXIT_USAGE
    assert "\n" not in str(e.value)


def test_within_judges_rel_l2_nan_and_elementwise():
    a = np.linspace(1, 2, 1000)
    m = tensor_metrics(a, a * (1 + 1e-5), rtol=1e-6, atol=0.0)
    assert Tolerance(1e-4).within(m)
    assert not Tolerance(1e-6).within(m)
    assert not Tolerance(1e-4, rtol=1e-6, atol=0.0).within(m)
    b = a.copy()
    b[3] = np.nan
    assert not Tolerance(1.0).within(tensor_metrics(a, b))


@pytest.fixture(scope="module")
def cal(tiny, tmp_path_factory):
    model, tok = tiny
    d = tmp_path_factory.mktemp("cal")
    ref = diffcases.make("ref", model, tok, d / "ref.h5")
    return {k: diffcases.make(k, model, tok, d / f"{k}.h5", ref)
            for k in ("threads1", "fp64", "norm_bf16")} | {"ref": ref}


def _max_error(ref, cand):
    from accucheck.diff import diff_captures

    return diff_captures(ref, cand)


def test_calibration_fp32_noise_passes_with_margin(cal):
    """fp32 reordering noise (1 vs 2 threads, both set explicitly by diffcases, so the same on
    every machine; fp32 vs float64) passes, >= 5x below tolerance."""
    for kind in ("threads1", "fp64"):
        d = _max_error(cal["ref"], cal[kind])
        assert d.within, kind
        worst = max(r.error for r in d.records)
        assert 0 < worst < DOC["float32"] / 5, (kind, worst)


def test_calibration_one_norm_in_bf16_fails_with_margin(cal):
    """One RMSNorm output rounded through bf16 in an fp32 model: >= 10x over tolerance."""
    d = _max_error(cal["ref"], cal["norm_bf16"])
    assert not d.within
    r = d.record(f"r0.s0:{diffcases.NORM_FAULT}#0:out.0")
    assert r.error > 10 * DOC["float32"]
    assert r.tolerance.source == "default float32"
