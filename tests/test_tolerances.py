"""Tolerance table: looser dtype wins, overrides, both-or-neither, calibration on real captures."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

import diffcases
from accucheck.errors import EXIT_USAGE, UserError
from accucheck.keys import RecordKey
from accucheck.compare.metrics import DTYPE_EPS, tensor_metrics
from accucheck.compare.tolerances import (DEFAULT_AMPLIFICATION, DEFAULT_REL_L2, GOLDEN_MULTIPLIER,
                                          NOISE_FLOOR_FACTOR, NOISE_FLOOR_MIN_FRACTION,
                                          NOISE_FLOOR_MIN_PEERS, NOISE_FLOOR_WINDOW, Tolerance,
                                          ToleranceTable, loosest_dtype, parse_override)

K = RecordKey.parse("r0.s1:model.layers.3.mlp#0:out.0")
ROOT = Path(__file__).resolve().parents[1]


def _documented() -> dict:
    """The numbers the README and docs/diff-json.md promise, parsed from their text: a change
    on either side (code or documentation) alone fails the tests below."""
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    m = re.search(r"compute dtypes \((float32 [^;]*), integer / bool exact;", readme)
    assert m, "README no longer states the dtype tolerances"
    rows = {d: float(v) for d, v in (r.split() for r in m.group(1).split(", "))}
    amp = re.search(r'"introduced" when its error is more than ([0-9.]+)x the error', readme)
    assert amp, "README no longer states the amplification threshold"
    doc = " ".join((ROOT / "docs" / "diff-json.md").read_text(encoding="utf-8").split())
    g = re.search(r"multiplier ([0-9.]+) for fp32/fp64 pairs, ([0-9.]+) for 16-bit", doc)
    assert g, "docs/diff-json.md no longer states the golden multipliers"
    g2 = re.search(r"RMSE ratio above x([0-9.]+) for float32, x([0-9.]+) for 16-bit runs, plus "
                   r"a floor of a tenth of the tolerance", readme)
    assert g2, "README no longer states the golden multipliers"
    assert g2.groups() == g.groups(), "README and docs/diff-json.md disagree"
    nf = re.search(r"more than ([0-9.]+)x and more than ([0-9.]+)x the median of the same module "
                   r"in the layers within ([0-9]+) of it \(same request and step, at least "
                   r"([0-9]+) of them\), with a local error above ([0-9.]+) % of its tolerance",
                   readme)
    assert nf, "README no longer states the noise-floor rule"
    assert float(nf.group(1)) == float(amp.group(1))
    return {**rows, "amplification": float(amp.group(1)),
            "golden_32": float(g.group(1)), "golden_16": float(g.group(2)),
            "noise_factor": float(nf.group(2)), "noise_window": int(nf.group(3)),
            "noise_min_peers": int(nf.group(4)), "noise_min_fraction": float(nf.group(5)) / 100}


DOC = _documented()


def test_documented_constants_are_the_code_constants():
    assert DOC == {"float32": 5e-5, "float16": 1e-2, "bfloat16": 5e-2, "float64": 1e-10,
                   "float8_e4m3fn": 0.25, "float8_e5m2": 0.4, "amplification": 4.0,
                   "golden_32": 2.0, "golden_16": 3.0, "noise_factor": 5.0, "noise_window": 4,
                   "noise_min_peers": 3, "noise_min_fraction": 0.05}
    assert (NOISE_FLOOR_FACTOR, NOISE_FLOOR_WINDOW, NOISE_FLOOR_MIN_PEERS) == \
        (DOC["noise_factor"], DOC["noise_window"], DOC["noise_min_peers"])
    assert NOISE_FLOOR_MIN_FRACTION == pytest.approx(DOC["noise_min_fraction"], rel=1e-12)
    assert set(DEFAULT_REL_L2) == set(DTYPE_EPS)   # every float dtype has a documented row
    for d in DEFAULT_REL_L2:
        assert DEFAULT_REL_L2[d] == DOC[d], d
        assert ToleranceTable().for_record(K, (d, d)).rel_l2 == DOC[d], d
    assert DEFAULT_AMPLIFICATION == DOC["amplification"]
    assert GOLDEN_MULTIPLIER == {"float64": DOC["golden_32"], "float32": DOC["golden_32"],
                                 "float16": DOC["golden_16"], "bfloat16": DOC["golden_16"]}


def test_documented_defaults_reach_the_diff_and_locate(tmp_path):
    """The defaults as the diff applies them (no option given): per-record tolerance by the
    runs' dtype, the golden multiplier by the runs' dtype, locate's amplification."""
    from test_diff import base, write

    from accucheck.compare.diff import diff_captures
    from accucheck.verdict.locate import analyze

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


def test_override_patterns_match_key_site_or_module_each_alone():
    t = ToleranceTable.from_options(overrides=["r0.s1:model.layers.3.mlp#0:out.0=1e-1",
                                               "model.layers.3.mlp#0:out.0=2e-1",
                                               "model.layers.3.mlp=3e-1"])
    # each pattern matches exactly one of the three forms; the last matching one wins
    assert t.for_record(K, ("float32",)).rel_l2 == 3e-1
    for spec, want in (("r0.s1:model.layers.3.mlp#0:out.0=1e-1", 1e-1),   # full key only
                       ("model.layers.3.mlp#0:out.0=2e-1", 2e-1),         # site only
                       ("model.layers.3.mlp=3e-1", 3e-1)):                # module only
        tol = ToleranceTable.from_options(overrides=[spec]).for_record(K, ("float32",))
        assert (tol.rel_l2, tol.source) == (want, f"override {spec.rsplit('=', 1)[0]}")
    other = RecordKey.parse("r0.s0:model.layers.3.mlp#1:out.0")
    tol = ToleranceTable.from_options(overrides=["model.layers.3.mlp#0:out.0=2e-1"]).for_record(
        other, ("float32",))
    assert tol.source == "default float32"
    # overrides are case-sensitive
    assert ToleranceTable.from_options(overrides=["*.MLP=1e-1"]).for_record(
        K, ("float32",)).source == "default float32"


def test_override_fields_and_inheritance():
    base_t = ToleranceTable.from_options(rtol=1e-3, atol=1e-5,
                                         overrides=["*.mlp=2e-2", "*.norm=rtol:1e-2,atol:0",
                                                    "logits=rel_l2 : 1e-1 , rtol:0,atol:1"])
    mlp = base_t.for_record(K, ("float32",))
    assert (mlp.rel_l2, mlp.rtol, mlp.atol) == (2e-2, 1e-3, 1e-5)   # rtol/atol inherited
    norm = base_t.for_record(RecordKey.parse("r0.s0:model.norm#0:out.0"), ("float32",))
    assert (norm.rel_l2, norm.rtol, norm.atol) == (1e300, 1e-2, 0.0)  # elementwise only
    lg = base_t.for_record(RecordKey.parse("r0.s0:logits#0:out.0"), ("float32",))
    assert (lg.rel_l2, lg.rtol, lg.atol, lg.source) == (1e-1, 0.0, 1.0, "override logits")
    dflt = base_t.for_record(RecordKey.parse("r0.s0:model.embed_tokens#0:out.0"), ("float32",))
    assert (dflt.rel_l2, dflt.rtol, dflt.atol) == (DOC["float32"], 1e-3, 1e-5)
    assert parse_override("x=0", None)[1].rel_l2 == 0.0    # 0 is a limit (exact), not "unset"
    pat, tol = parse_override("a=b=1e-3")   # the LAST '=' splits
    assert (pat, tol.rel_l2) == ("a=b", 1e-3)
    d = base_t.as_dict()
    assert d["rtol"] == 1e-3 and d["atol"] == 1e-5
    assert d["rel_l2_by_dtype"]["float32"] == DOC["float32"]
    assert d["overrides"][0] == {"pattern": "*.mlp", "rel_l2": 2e-2, "rtol": 1e-3,
                                 "atol": 1e-5, "source": "override *.mlp"}


@pytest.mark.parametrize("kwargs", [dict(rel_l2=-1e-3), dict(rel_l2=float("nan")),
                                    dict(rel_l2=float("inf")), dict(rel_l2=1e-3, rtol=-1.0,
                                                                    atol=0.0),
                                    dict(rel_l2=1e-3, rtol=0.0, atol=float("inf"))])
def test_tolerance_values_must_be_finite_and_non_negative(kwargs):
    with pytest.raises(UserError) as e:
        Tolerance(**kwargs)
    assert e.value.exit_code == EXIT_USAGE and "must be a finite number >= 0" in str(e.value)


def test_within_at_the_limit():
    a = np.linspace(1, 2, 1000)
    m = tensor_metrics(a, a * (1 + 1e-5))
    assert Tolerance(m.rel_l2).within(m) and not Tolerance(m.rel_l2 * 0.999).within(m)
    assert Tolerance(0.0).within(tensor_metrics(a, a))   # zero tolerance, identical: within
    # elementwise: within when no element is outside atol + rtol |ref|
    m2 = tensor_metrics(a, a * (1 + 1e-5), rtol=2e-5, atol=0.0)
    assert m2.mismatched == 0 and Tolerance(1e-4, rtol=2e-5, atol=0.0).within(m2)
    with pytest.raises(UserError):
        ToleranceTable(rtol=1e-3)


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
            for k in ("fp32_dither", "fp64", "norm_bf16")} | {"ref": ref}


def _max_error(ref, cand):
    from accucheck.compare.diff import diff_captures

    return diff_captures(ref, cand)


def test_calibration_fp32_noise_passes_with_margin(cal):
    """fp32 reordering noise (made by the test: a one-ULP dither of a quarter of every rounding
    op's output, diffcases "fp32_dither"; fp32 vs float64) passes, >= 5x below tolerance, and
    is not zero (the noise exists: the test made it)."""
    for kind in ("fp32_dither", "fp64"):
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
