"""The verdict rules of verdict.locate and verdict.culprit, probed where a plausible wrong rule
gives another answer (issue 16: tests that can fail). DiffResults are built record by record
(exact rel_l2 values, no files, no model), so boundaries (err == amplification x explained, a
gain of exactly factor x the peers' median, a local error of exactly the tolerance) are hit
exactly. Each test asserts the exact record / number / label."""
from __future__ import annotations

import dataclasses
import math

import pytest

from accucheck.verdict.culprit import Culprit, culprit_lines, find_culprit, precision_finding
from accucheck.compare.results import DiffResult, GoldenLabel, RecordDiff
from accucheck.keys import RecordKey
from accucheck.verdict.locate import (Analysis, Divergence, Location, RecordLocation, Suspicious,
                                      locate, noise_floor)
from accucheck.verdict.types import LayerPoint
from accucheck.compare.metrics import TensorMetrics
from accucheck.compare.opmatch import OneSided, OpAlignment
from accucheck.compare.tolerances import Tolerance

TOL = 1e-2
E = 2.0 ** -8          # an exactly representable input error for the noise-floor cases
NF_TOL = 0.125         # noise-floor cases: within tolerance up to a gain of 32 over E


def _m(err: float, nan_inf: int = 0) -> TensorMetrics:
    return TensorMetrics(numel=8, max_abs=err, mean_abs=err, max_rel=err, rel_l2=err,
                         cosine=1.0, sqnr_db=0.0, rmse=err, max_ulp=None, ulp_dtype=None,
                         frac_rel_lt_1e3=1.0, frac_rel_lt_5e3=1.0, nan_inf_mismatch=nan_inf,
                         worst_index=None, worst_ref=None, worst_cand=None)


class D:
    """A DiffResult built record by record, in execution order; `src` maps input slots to
    producer sites of the same request and step."""

    def __init__(self):
        self.recs: list[RecordDiff] = []

    def add(self, key, err=0.0, *, tol=TOL, src=None, shadow=None, shape=False,
            ref_dtype="float32", cand_dtype="float32", golden=None, cand_key=None, nan_inf=0):
        k = RecordKey.parse(key)
        pre = f"r{k.req}.s{k.step}:"
        kw = dict(key=k, kind="op" if k.op else "module", order=len(self.recs),
                  ref_dtype=ref_dtype, cand_dtype=cand_dtype, ref_shape=(1, 8),
                  cand_shape=(1, 9) if shape else (1, 8), tolerance=Tolerance(tol),
                  shadow=_m(shadow) if shadow is not None else None,
                  golden=GoldenLabel(golden, 1.0, 1.0, 2.0) if golden else None,
                  cand_key=RecordKey.parse(cand_key) if cand_key else None,
                  src=tuple((s, pre + p) for s, p in (src or {}).items()))
        if shape:
            self.recs.append(RecordDiff(basis="shape", **kw))
        else:
            self.recs.append(RecordDiff(basis="tensor", metrics=_m(err, nan_inf), **kw))
        return self

    def diff(self, golden_path=None, ops=None, compute=(None, None)) -> DiffResult:
        return DiffResult("ref.h5", "cand.h5", golden_path, tuple(self.recs), (), (), None, (),
                          (), 0, (), ops=ops, compute_dtypes=compute)

    def locate(self, **kw) -> Location:
        return locate(self.diff(), **kw)

    def analysis(self, *, golden_path=None, ops=None, compute=(None, None), **kw) -> Analysis:
        d = self.diff(golden_path, ops, compute)
        return Analysis(d, locate(d, **kw))


def _locs(L: Location) -> dict[str, RecordLocation]:
    return {str(x.key): x for x in L.records}


# ----------------------------------------------------------------- result records

def test_explained_and_amplification_take_the_larger_of_input_and_inner_error():
    k = RecordKey.parse("r0.s0:m.a#0:out.0")
    cases = ((None, None), (None, 0.5), (0.5, None), (0.25, 0.5), (0.5, 0.25))
    rl = [RecordLocation(k, 2.0, i, (), False, "inherited", 0.0, n).explained for i, n in cases]
    assert rl == [0.0, 0.5, 0.5, 0.5, 0.5]
    dv = [Divergence(k, "introduced", 2.0, i, (), TOL, "tensor", None, (), n).amplification
          for i, n in cases]
    assert dv == [math.inf, 4.0, 4.0, 4.0, 4.0]


def test_divergence_module_names_the_op_and_the_step():
    m = Divergence(RecordKey.parse("r0.s3:m.a#0:out.0"), "introduced", 1.0, None, (), TOL,
                   "tensor", None, ())
    o = dataclasses.replace(m, key=RecordKey.parse("r0.s2:m.a#0/aten.mm.default@1:out.0"))
    assert (m.module, m.step, o.module, o.step) == ("m.a", 3, "m.a/aten.mm.default", 2)


def test_suspicious_ratio_and_frozen():
    k = RecordKey.parse("r0.s0:m.layers.0.a#0:out.0")
    s = Suspicious(k, 1.0, 1.0, 10.0, 0.5, 3, "m.layers.*.a#0:out.0", TOL, True)
    assert [dataclasses.replace(s, peers_median=m).ratio for m in (0.5, 2.0, 0.0)] == \
        [20.0, 5.0, math.inf]
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.gain = 1.0


def test_diffuse_needs_records_over_and_no_first_divergence():
    k = RecordKey.parse("r0.s0:m.a#0:out.0")
    dv = Divergence(k, "inherited", 1.0, None, (), TOL, "tensor", None, ())

    def loc(fd, fo):
        return Location(fd, (), (), (), 4.0, fo).diffuse
    assert [loc(None, None), loc(None, dv), loc(dv, dv), loc(dv, None)] == \
        [False, True, False, False]



def test_verdict_records_are_frozen():
    """The verdict's records are shared by locate, culprit and the reports: none can be
    changed after it is made."""
    k = RecordKey.parse("r0.s0:m.layers.0.a#0:out.0")
    dv = Divergence(k, "introduced", 1.0, None, (), TOL, "tensor", None, ())
    records = [(RecordLocation(k, 2.0, None, (), False, "introduced", 2.0), "error"),
               (dv, "error"), (LayerPoint(0, 0, 0, k, 1.0, None, False), "rel_l2"),
               (Location(dv, (), (), (), 4.0), "amplification")]
    for rec, name in records:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(rec, name, 0.5)
        assert getattr(rec, name) != 0.5

def test_diff_records_are_frozen_and_keep_their_basis_invariants():
    """compare.diff's records (StatsDelta, GoldenLabel, RecordDiff) cannot be changed once
    made, and a RecordDiff refuses an unknown basis and metrics / statistics that do not go
    with its basis, each in its own words."""
    from accucheck.compare.results import StatsDelta

    k = RecordKey.parse("r0.s0:m.layers.0.a#0:out.0")
    sd = StatsDelta(False, 0.25, "l2", 0)
    gl = GoldenLabel("cand worse", 1.0, 3.0, 2.0)
    kw = dict(key=k, kind="module", order=0, ref_dtype="float32", cand_dtype="float32",
              ref_shape=(1, 8), cand_shape=(1, 8), tolerance=Tolerance(TOL))
    rd = RecordDiff(basis="sample", metrics=_m(0.5), stats=sd, **kw)
    assert rd.error == 0.5
    for rec, name in ((sd, "rel_l2_lower_bound"), (gl, "label"), (rd, "basis")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(rec, name, "x")
    cases = [(dict(basis="tensors", metrics=_m(0.5)), "bad basis 'tensors'"),
             (dict(basis="tensor"), "metrics go with basis 'tensor' or 'sample'"),
             (dict(basis="stats", metrics=_m(0.5), stats=sd),
              "metrics go with basis 'tensor' or 'sample'"),
             (dict(basis="sample", metrics=_m(0.5)),
              "statistics go with basis 'sample' or 'stats'"),
             (dict(basis="tensor", metrics=_m(0.5), stats=sd),
              "statistics go with basis 'sample' or 'stats'")]
    for extra, message in cases:
        with pytest.raises(ValueError) as e:
            RecordDiff(**kw, **extra)
        assert str(e.value) == message
    assert RecordDiff(basis="stats", stats=sd, **kw).error == 0.25
    assert RecordDiff(basis="shape", **kw).error == math.inf


def test_record_within_needs_both_bases_of_a_sample_and_a_real_golden_label():
    """A stats-mode record (basis "sample") is within tolerance only when its statistics bound
    AND its sampled estimate are; a golden label of "n/a" (no exact tensors on one side) is no
    referee: the tolerance decides."""
    from accucheck.compare.results import StatsDelta

    k = RecordKey.parse("r0.s0:m.layers.0.a#0:out.0")
    kw = dict(key=k, kind="module", order=0, ref_dtype="float32", cand_dtype="float32",
              ref_shape=(1, 8), cand_shape=(1, 8), tolerance=Tolerance(TOL))
    quiet, loud = StatsDelta(False, TOL / 2, "l2", 0), StatsDelta(False, 2 * TOL, "l2", 0)
    assert RecordDiff(basis="sample", metrics=_m(TOL / 2), stats=quiet, **kw).within
    assert not RecordDiff(basis="sample", metrics=_m(2 * TOL), stats=quiet, **kw).within
    assert not RecordDiff(basis="sample", metrics=_m(TOL / 2), stats=loud, **kw).within
    na = RecordDiff(basis="tensor", metrics=_m(2 * TOL), golden=GoldenLabel("n/a", None, None,
                                                                            2.0), **kw)
    assert not na.refereed and not na.within
    judged = RecordDiff(basis="tensor", metrics=_m(2 * TOL),
                        golden=GoldenLabel("both within noise", 1.0, 1.1, 2.0), **kw)
    assert judged.refereed and judged.within


def test_every_diff_result_type_is_frozen():
    """Everything compare.diff returns (compare.results) is shared by locate, culprit and the
    reports, so none of it can be changed once made (dataclasses.FrozenInstanceError on
    assignment)."""
    import accucheck.compare.results as d

    types = [v for v in vars(d).values() if isinstance(v, type) and dataclasses.is_dataclass(v)
             and v.__module__ == d.__name__]
    assert {"StatsDelta", "GoldenLabel", "RecordDiff", "MissingKey", "LogitsPosition",
            "LogitsStep", "TokenFlip", "DiffResult"} <= {t.__name__ for t in types}
    assert [t.__name__ for t in types if not t.__dataclass_params__.frozen] == []
    step = d.LogitsStep(RecordKey.parse("r0.s0:logits#0:out.0"), ())
    with pytest.raises(dataclasses.FrozenInstanceError):
        step.positions = ()


def test_logits_step_summaries_with_and_without_positions():
    k = RecordKey.parse("r0.s0:logits#0:out.0")
    from accucheck.compare.results import LogitsPosition, LogitsStep

    assert LogitsStep(k, ()).max_kl == 0.0 and LogitsStep(k, ()).top1_agreement == 1.0
    ps = (LogitsPosition(0, 0.25, 3, 3, 1.0, 2.0, 0.1), LogitsPosition(1, 0.5, 3, 4, 0.8, 0.1, 0.1),
          LogitsPosition(2, 0.125, 5, 5, 1.0, 0.05, 0.1))
    st = LogitsStep(k, ps)
    assert st.max_kl == 0.5 and st.top1_agreement == pytest.approx(2 / 3)
    assert [p.agree for p in ps] == [True, False, True]
    assert [p.near_tie for p in ps] == [False, True, True]  # margin <= noise, ties included


def test_token_flip_label_needs_both_margin_and_noise():
    from accucheck.compare.results import TokenFlip

    def flip(margin, noise):
        return TokenFlip(0, 1, 5, 10, 11, margin, noise, True, "logits")

    assert [(f.near_tie, f.label) for f in (flip(None, 0.1), flip(0.1, None), flip(None, None))] \
        == [(None, "unknown (no logits stored)")] * 3
    assert (flip(0.1, 0.1).near_tie, flip(0.1, 0.1).label) == (True, "near-tie")
    assert (flip(0.8, 0.1).near_tie, flip(0.8, 0.1).label) == (True, "near-tie")  # x8
    assert (flip(0.81, 0.1).near_tie, flip(0.81, 0.1).label) == (False, "real")


def test_diff_basis_ignores_shape_records_and_precision_needs_one_compute_dtype():
    one = D().add("r0.s0:m.a#0:out.0", 0.1, ref_dtype="float32", cand_dtype="float16") \
        .add("r0.s0:m.b#0:out.0", shape=True)
    assert one.diff().basis == "tensor"
    assert D().add("r0.s0:m.b#0:out.0", shape=True).diff().basis == "none"
    assert one.diff(compute=("float32", "float32")).precision_findings == (one.recs[0],)
    assert one.diff(compute=("bfloat16", "float32")).precision_findings == ()
    assert one.diff(compute=(None, None)).precision_findings == ()


def test_flips_merge_the_generated_ids_flip_with_the_logits_ones():
    """compare.diff's flip list: a generated-id flip the stored logits already show is not
    listed twice; one they do not show is added, and it is the first flip when it comes
    earlier (request, step) than every logits flip."""
    from accucheck.compare.diff import _Differ
    from accucheck.compare.results import LogitsPosition, LogitsStep, TokenFlip

    def step(s, flip_at):  # three positions, the last one generating
        return LogitsStep(RecordKey.parse(f"r0.s{s}:logits#0:out.0"), tuple(
            LogitsPosition(i, 0.1, 3, 4 if i == flip_at else 3, 1.0, 0.5, 0.1)
            for i in range(3)))

    def ids(s):
        return TokenFlip(0, s, -1, 3, 4, None, None, True, "tokens")

    first, gen = _Differ._flips(None, [step(1, 2)], ids(1))
    assert [(f.step, f.source) for f in gen] == [(1, "logits")] and first.source == "logits"
    first, gen = _Differ._flips(None, [step(2, 2), step(1, 0)], ids(0))
    assert [(f.step, f.source) for f in gen] == [(2, "logits"), (0, "tokens")]
    assert (first.step, first.source) == (0, "tokens")
    first, gen = _Differ._flips(None, [step(1, 0)], ids(3))  # a prompt-position flip first
    assert (first.step, first.position, first.generating) == (1, 0, False)
    assert [(f.step, f.source) for f in gen] == [(3, "tokens")]


def test_golden_label_noise_floor_and_ties_exactly():
    """compare.diff._golden_label on RMS errors chosen to be exact in binary: rmse is
    sqrt(sum / n); the noise floor is a tenth of the tolerance times the golden's RMS; a
    side is worse only when its error is strictly above multiplier x the other's + floor."""
    import numpy as np

    from accucheck.compare.diff import _golden_label

    tol = Tolerance(10.0)  # floor = 0.1 * 10 * rms(golden) = 1.0 with rms(golden) = 1

    def label(er, ec, n=1):
        return _golden_label(np.array([er * er * n, ec * ec * n, 1.0 * n]), n, tol, 2.0)

    g = label(1.0, 2.0, n=4)
    assert (g.ref_rmse, g.cand_rmse, g.multiplier) == (1.0, 2.0, 2.0)
    assert label(1.0, 3.0).label == "both within noise"      # 3 == 2 x 1 + 1: a tie
    assert label(3.0, 1.0).label == "both within noise"
    assert label(1.0, 3.25).label == "cand worse"
    assert label(3.25, 1.0).label == "ref worse"
    assert label(0.0, 1.5).label == "cand worse"              # over the floor of 1.0 ...
    assert label(0.0, 0.75).label == "both within noise"      # ... and under it
    assert label(1.5, 0.0).label == "ref worse"
    assert label(0.75, 0.0).label == "both within noise"


# ----------------------------------------------------------------- locate: verdict lists

def test_analyze_ranks_ten_by_default_and_refuses_an_incomplete_capture(tmp_path):
    import h5py
    from test_verdicts import Run, cap

    from accucheck.errors import UserError
    from accucheck.verdict.locate import analyze

    run = Run()
    run.add("r0.s0:model.embed_tokens#0:out.0")
    for i in range(11):
        run.add(f"r0.s0:model.layers.{i}.mlp#0:out.0", (i + 1) * 1e-3,
                src={"0": "model.embed_tokens#0:out.0"})
    r = cap(tmp_path / "r.h5", run.ref, gen=((4,),))
    c = cap(tmp_path / "c.h5", run.cand, gen=((4,),))
    want = [f"model.layers.{i}.mlp" for i in range(10, 0, -1)]
    assert [x.key.module for x in analyze(r, c).location.top] == want
    with h5py.File(c, "r+") as f:
        f.attrs["complete"] = False
    with pytest.raises(UserError, match="incomplete capture"):
        analyze(r, c)
    assert [x.key.module for x in analyze(r, c, allow_incomplete=True).location.top] == want


def test_amplification_of_one_is_allowed_below_one_refused():
    d = D().add("r0.s0:e#0:out.0").add("r0.s0:a#0:out.0", 0.02, src={"0": "e#0:out.0"}) \
        .add("r0.s0:b#0:out.0", 0.03, src={"0": "a#0:out.0"})
    L = d.locate(amplification=1.0)
    assert str(L.first_divergence.key) == "r0.s0:a#0:out.0"
    assert _locs(L)["r0.s0:b#0:out.0"].cause == "introduced"   # 0.03 > 1 x 0.02
    with pytest.raises(ValueError, match="amplification must be >= 1"):
        d.locate(amplification=0.999)


def test_input_records_are_neither_first_over_nor_worst():
    """An input record over tolerance (x5) precedes its module's output (x2, inherited) and a
    later output (x3): first_over is the first OUTPUT, worst the largest output ratio."""
    d = D().add("r0.s0:e#0:out.0")
    d.add("r0.s0:a#0:in.0", 0.05).add("r0.s0:a#0:out.0", 0.02)
    d.add("r0.s0:b#0:out.0", 0.03, src={"0": "a#0:out.0"})
    L = d.locate()
    assert str(L.first_over.key) == "r0.s0:a#0:out.0" and L.first_over.cause == "inherited"
    assert str(L.worst.key) == "r0.s0:b#0:out.0" and L.first_divergence is None and L.diffuse
    x = _locs(L)["r0.s0:a#0:in.0"]
    assert (x.input_error, x.input_from, x.cause, x.introduced) == (None, (), "inherited", 0.0)


def test_worst_is_the_largest_error_over_its_own_tolerance():
    """ratio / error / error x tolerance each pick another record; a zero tolerance (exact
    match demanded) makes any error the worst."""
    d = D().add("r0.s0:e#0:out.0")
    for name, err, tol in (("a", 0.03, 0.01), ("b", 0.05, 0.04), ("c", 0.02, 0.001)):
        d.add(f"r0.s0:{name}#0:out.0", err, tol=tol, src={"0": "e#0:out.0"})
    assert d.locate().worst.key.module == "c"
    d.add("r0.s0:z#0:out.0", 1e-6, tol=0.0, src={"0": "e#0:out.0"})
    assert d.locate().worst.key.module == "z"


def test_top_ranks_introduced_error_largest_first_ten_by_default():
    d = D().add("r0.s0:e#0:out.0").add("r0.s0:x#0:in.0", 0.5)
    for i in range(12):
        d.add(f"r0.s0:m{i}#0:out.0", (i + 1) / 8, src={"0": "e#0:out.0"})
    L = d.locate()
    assert [x.key.module for x in L.top] == [f"m{i}" for i in range(11, 1, -1)]
    assert [x.introduced for x in L.top[:2]] == [12 / 8, 11 / 8]
    assert [x.key.module for x in d.locate(top=20).top] == \
        [f"m{i}" for i in range(11, -1, -1)]   # never the exact e, never an input record
    small = D().add("r0.s0:e#0:out.0").add("r0.s0:a#0:out.0", 0.5, src={"0": "e#0:out.0"})
    assert [x.introduced for x in small.locate().top] == [0.5]   # below 1 too


def test_curve_takes_only_layer_block_first_outputs():
    d = D().add("r0.s0:model.layers.0#0:in.0", 0.1)
    d.add("r0.s0:model.layers.0#0:out.0", 0.1).add("r0.s0:model.layers.0#0:out.1", 0.2)
    d.add("r0.s0:model.layers.1#0/aten.add.Tensor@0:out.0", 0.1)
    d.add("r0.s0:model.layers.1#0:out.hidden_states", 0.1)
    d.add("r0.s0:model.norm#0:out.0", 0.1).add("r0.s0:model.layers.2#0:out.0.0", 0.1)
    assert [str(p.key) for p in d.locate().curve] == [
        "r0.s0:model.layers.0#0:out.0", "r0.s0:model.layers.1#0:out.hidden_states",
        "r0.s0:model.layers.2#0:out.0.0"]


def _dp(d, gains, *, req=0, step=0, first=0, module="model.layers.{}.mlp.down_proj",
        e_in=E, tol=NF_TOL, shadow=None):
    """One module per layer (first, first+1, ...): a recorded input with error e_in and an
    output with error gain x e_in (gain None: a shape mismatch)."""
    for j, g in enumerate(gains):
        p = f"r{req}.s{step}:{module.format(first + j)}#0"
        d.add(f"{p}:in.0", e_in, tol=tol)
        if g is None:
            d.add(f"{p}:out.0", shape=True, tol=tol)
        else:
            d.add(f"{p}:out.0", g * e_in, tol=tol,
                  shadow=None if shadow is None else shadow[j])
    return d


def _names(L_or_sus):
    sus = L_or_sus.suspicious if isinstance(L_or_sus, Location) else L_or_sus
    return [str(s.key) for s in sus]


def _dpk(i, req=0, step=0):
    return f"r{req}.s{step}:model.layers.{i}.mlp.down_proj#0:out.0"


# ----------------------------------------------------------------- noise floor

def test_noise_floor_uses_the_peers_median_gain_floored_at_one():
    d = D()
    _dp(d, [3, 3, 3, 20], req=0)      # median 3: 20 > 15
    _dp(d, [3, 3, 3, 10], req=1)      # 10 < 15 (5 x the median, not 5)
    _dp(d, [0.5, 0.5, 0.5, 4.5], req=2)   # median 0.5 floored at 1: 4.5 < 5
    _dp(d, [0.5, 0.5, 0.5, 8], req=3)     # 8 > 5, not > 10
    L = d.locate()
    assert _names(L) == [_dpk(3, 0), _dpk(3, 3)]
    s0, s3 = L.suspicious
    assert (s0.gain, s0.peers_median, s0.peers, s0.local, s0.within) == (20.0, 3.0, 3, 19 * E,
                                                                          True)
    assert s0.kind == "model.layers.*.mlp.down_proj#0:out.0" and s0.tolerance == NF_TOL
    assert (s3.gain, s3.peers_median, s3.error) == (8.0, 0.5, 8 * E)


def test_noise_floor_boundaries_are_strict():
    """A gain of exactly 5 x max(1, median) is not suspicious, 6 is; a gain of exactly the
    amplification (8 here) is not judged, 9 is."""
    d = D()
    _dp(d, [1, 1, 1, 5], req=0)
    _dp(d, [1, 1, 1, 6], req=1)
    assert _names(d.locate()) == [_dpk(3, 1)]
    d = D()
    _dp(d, [1, 1, 1, 8], req=0)
    _dp(d, [1, 1, 1, 9], req=1)
    assert _names(d.locate(amplification=8.0)) == [_dpk(3, 1)]


def test_noise_floor_exact_input_gains_over_one_rounding_and_error_free_peers_gain_one():
    """An exact input explains one rounding of the run's dtype (float32 here: 2^-24), not
    nothing: the gain is finite (it was x inf, and every first rounding site stood out)."""
    d = D()
    _dp(d, [0, 0, 0, 0], e_in=0.0)
    d.recs[-1] = dataclasses.replace(d.recs[-1], metrics=_m(2 * E))
    L = d.locate()
    assert _names(L) == [_dpk(3)]
    s = L.suspicious[0]
    assert (s.gain, s.peers_median, s.ratio, s.local) == (2 * E / 2 ** -24, 1.0,
                                                          2 * E / 2 ** -24, 2 * E)


def test_noise_floor_with_shadow_compares_shadow_errors_unfloored():
    """With shadow records the gain is the shadow (local) error itself, and the peers' median
    is not floored at 1; the amplification does not apply."""
    d = D()
    _dp(d, [8, 8, 8, 8], shadow=[E, E, E, 6 * E])
    L = d.locate()
    assert _names(L) == [_dpk(3)]
    s = L.suspicious[0]
    assert (s.gain, s.peers_median, s.local) == (6 * E, E, 6 * E)
    assert _locs(L)[_dpk(3)].input_basis == "shadow"


def test_noise_floor_peer_selection():
    """Layer 0 has no peer within 4 layers (not judged, and the walk goes on); shape
    mismatches are no peers; the first record of a step (nothing known to feed it) is no
    peer either."""
    d = D()
    _dp(d, [20], first=0)
    _dp(d, [1, 1, 20, 1, 1], first=6)
    assert _names(d.locate()) == [_dpk(8)]
    assert d.locate().suspicious[0].peers == 4
    d = D()
    _dp(d, [1, 1, 1, 20])
    _dp(d, [None, None, None], first=4)   # shape mismatches: inf gain if they counted
    L = d.locate()
    assert _names(L) == [_dpk(3)] and L.suspicious[0].peers == 3
    assert L.first_divergence.key.module == "model.layers.4.mlp.down_proj"
    d = D().add(_dpk(0), 2 * E, tol=NF_TOL)   # no input: basis "none", no gain
    _dp(d, [1, 1, 1, 20], first=1)
    L = d.locate()
    assert _locs(L)[_dpk(0)].input_basis == "none"
    assert _names(L) == [_dpk(4)] and L.suspicious[0].peers == 3


def test_noise_floor_outside_layers_is_not_judged():
    d = D()
    _dp(d, [1, 1, 1, 20], module="vision.stages.{}.proj")
    assert d.locate().suspicious == ()


def test_noise_floor_leaves_out_introduced_records_and_small_local_errors():
    d = D()
    _dp(d, [1, 1, 1, 40])              # 40 E = 0.156: over tolerance, introduced
    _dp(d, [1, 1, 1, 17], req=1)       # local 16 E = 0.0625: exactly half the tolerance
    _dp(d, [1, 1, 1, 18], req=2)
    L = d.locate()
    assert L.first_divergence.key == RecordKey.parse(_dpk(3))
    assert _names(noise_floor(d.diff(), _locs(L), min_fraction=0.5)) == [_dpk(3, 2)]
    assert _names(noise_floor(d.diff(), _locs(L))) == [_dpk(3, 1), _dpk(3, 2)]


def test_no_noise_floor_with_a_golden_referee():
    d = D()
    _dp(d, [1, 1, 1, 20])
    assert _names(d.analysis().location) == [_dpk(3)]
    assert d.analysis(golden_path="gold.h5").location.suspicious == ()


# ----------------------------------------------------------------- locate: input errors

def test_node_error_and_inner_error_are_maxima():
    """A container's children: a (out.0 1e-3, out.1 2e-3) and b (out.0 8e-3, out.1 1e-3), all
    of one norm: what its own code can pass on is their largest error, or the sum of their
    absolute errors over its output's norm (a residual sum), whichever is larger: 1.2e-2, so
    2e-2 is inherited (< 4 x 1.2e-2)."""
    d = D().add("r0.s0:e#0:out.0")
    d.add("r0.s0:m.layers.0.a#0:out.0", 1e-3, src={"0": "e#0:out.0"})
    d.add("r0.s0:m.layers.0.a#0:out.1", 2e-3, src={"0": "e#0:out.0"})
    d.add("r0.s0:m.layers.0.b#0:out.0", 8e-3, src={"0": "e#0:out.0"})
    d.add("r0.s0:m.layers.0.b#0:out.1", 1e-3, src={"0": "e#0:out.0"})
    d.add("r0.s0:m.layers.0#0:out.0", 2e-2, src={"0": "e#0:out.0"})
    x = _locs(d.locate())["r0.s0:m.layers.0#0:out.0"]
    assert x.input_error == 0.0 and x.cause == "inherited"
    assert x.inner_error == pytest.approx(1.2e-2, rel=1e-12)
    assert x.introduced == pytest.approx(2e-2 - 1.2e-2, rel=1e-12)


def test_links_of_any_output_of_a_module_call_count():
    """The mlp's out.0 carries no link, its out.1 does (to the exact e): both outputs are one
    call fed by e, not by the attention recorded before (1e-2)."""
    d = D().add("r0.s0:e#0:out.0")
    d.add("r0.s0:attn#0:out.0", 1e-2, src={"0": "e#0:out.0"})
    d.add("r0.s0:mlp#0:out.0", 1.5e-2).add("r0.s0:mlp#0:out.1", 1.5e-2, src={"0": "e#0:out.0"})
    x = _locs(d.locate())["r0.s0:mlp#0:out.0"]
    assert (x.input_basis, x.input_error, x.input_from, x.cause) == \
        ("links", 0.0, ("r0.s0:e#0:out.0",), "introduced")


def test_partial_links_add_the_proxy_and_stay_links():
    """One producer compared (exact), one not: the preceding record (1e-2) also bounds it."""
    d = D().add("r0.s0:e#0:out.0")
    d.add("r0.s0:attn#0:out.0", 1e-2, src={"0": "e#0:out.0"})
    d.add("r0.s0:mlp#0:out.0", 1.5e-2, src={"0": "e#0:out.0", "1": "gone#0:out.0"})
    x = _locs(d.locate())["r0.s0:mlp#0:out.0"]
    assert (x.input_basis, x.input_error, x.input_from, x.cause) == \
        ("links", 1e-2, ("r0.s0:attn#0:out.0",), "inherited")


def test_proxy_is_the_preceding_sibling_not_a_later_one():
    d = D().add("r0.s0:e#0:out.0").add("r0.s0:x#0:out.0", 2e-2).add("r0.s0:y#0:out.0", 1e-2)
    locs = _locs(d.locate())
    x = locs["r0.s0:x#0:out.0"]
    assert (x.input_basis, x.input_error, x.input_from, x.cause) == \
        ("proxy", 0.0, ("r0.s0:e#0:out.0",), "introduced")
    first = locs["r0.s0:e#0:out.0"]
    assert (first.input_basis, first.input_error, first.introduced) == ("none", None, 0.0)


def test_recorded_inputs_the_largest_wins_and_names_itself():
    d = D().add("r0.s0:e#0:out.0")
    d.add("r0.s0:a#0:in.0", 1e-3).add("r0.s0:a#0:in.1", 5e-3).add("r0.s0:a#0:out.0", 3e-2)
    d.add("r0.s0:b#0:in.0", 1e-3)          # inputs of a call whose output is not recorded
    x = _locs(d.locate())["r0.s0:a#0:out.0"]
    assert (x.input_basis, x.input_error, x.input_from, x.cause) == \
        ("inputs", 5e-3, ("r0.s0:a#0:in.1",), "introduced")
    assert x.introduced == pytest.approx(3e-2 - 5e-3, rel=1e-12)


def test_carried_state_at_decode_steps_keeps_links_basis():
    d = D()
    for step in (0, 1):
        d.add(f"r0.s{step}:e#0:out.0")
        d.add(f"r0.s{step}:attn#0:out.0", 3e-3 if step == 0 else 1e-2, src={"0": "e#0:out.0"})
    d.add("r0.s2:attn#0:out.0", 2e-2)     # the first record of step 2: the cache alone feeds it
    locs = _locs(d.locate())
    s1 = locs["r0.s1:attn#0:out.0"]
    assert (s1.input_basis, s1.input_error, s1.cause) == ("links", 0.0, None)  # not its own
    s2 = locs["r0.s2:attn#0:out.0"]
    assert (s2.input_basis, s2.input_error, s2.input_from, s2.cause) == \
        ("proxy", 1e-2, ("r0.s1:attn#0:out.0",), "inherited")


def test_parents_ops_in_their_call_and_modules_in_the_nearest_recorded_prefix():
    """Ops belong to their module call; a module to the deepest recorded enclosing module
    (m.layers.0.self_attn is not recorded: o_proj's parent is the layer; enc is one word)."""
    d = D().add("r0.s0:e#0:out.0")
    mlp = "r0.s0:m.layers.0.mlp#0"
    d.add(f"{mlp}/aten.mm.default@0:out.0", 0.0, src={"0": "e#0:out.0"})
    d.add(f"{mlp}/aten.silu.default@1:out.0", 2e-2,
          src={"0": "m.layers.0.mlp#0/aten.mm.default@0:out.0"})
    d.add(f"{mlp}/aten.mul.Tensor@2:out.0", 2.2e-2,
          src={"0": "m.layers.0.mlp#0/aten.silu.default@1:out.0"})
    d.add(f"{mlp}:out.0", 2.2e-2, src={"0": "e#0:out.0"})
    d.add("r0.s0:m.layers.0.self_attn.o_proj#0:out.0", 2.2e-2)
    d.add("r0.s0:m.layers.0#0:out.0", 2.2e-2, src={"0": "e#0:out.0"})
    d.add("r0.s0:enc.a#0:out.0", 2.2e-2).add("r0.s0:enc#0:out.0", 2.2e-2)
    L = d.locate()
    fd = L.first_divergence
    assert fd.module == "m.layers.0.mlp/aten.silu.default"
    assert fd.path == ("m.layers.0", "m.layers.0.mlp")
    locs = _locs(L)
    assert locs[f"{mlp}:out.0"].inner_error == 2.2e-2
    assert locs["r0.s0:m.layers.0#0:out.0"].inner_error == 2.2e-2
    o = locs["r0.s0:m.layers.0.self_attn.o_proj#0:out.0"]
    assert (o.input_basis, o.input_error, o.cause) == ("proxy", 2.2e-2, "inherited")
    assert locs["r0.s0:enc#0:out.0"].inner_error == 2.2e-2
    assert Analysis(d.diff(), L).culprit.ops_compared == 3


def test_an_op_of_an_unrecorded_call_is_not_put_in_the_next_call():
    """m.x#0's output is not recorded; its op must not be taken as a child of m.x#1 (recorded
    next): it belongs to m, the enclosing module."""
    d = D().add("r0.s0:e#0:out.0")
    d.add("r0.s0:m.x#0/aten.mm.default@0:out.0", 2e-2, src={"0": "e#0:out.0"})
    d.add("r0.s0:m.x#1:out.0", 2e-2, src={"0": "e#0:out.0"})
    d.add("r0.s0:m#0:out.0", 2.5e-2, src={"0": "e#0:out.0"})
    L = d.locate()
    assert L.first_divergence.path == ("m",)
    x1 = _locs(L)["r0.s0:m.x#1:out.0"]
    assert (x1.inner_error, x1.cause) == (None, "introduced")


def test_a_module_called_after_its_parent_finished_has_no_parent():
    d = D().add("r0.s0:e#0:out.0").add("r0.s0:enc#0:out.0", 0.0, src={"0": "e#0:out.0"})
    d.add("r0.s0:enc.head#0:out.0", 2e-2, src={"0": "e#0:out.0"})
    L = d.locate()
    assert str(L.first_divergence.key) == "r0.s0:enc.head#0:out.0"
    assert L.first_divergence.path == ()


def test_a_node_is_ordered_by_its_last_output():
    """a's out.0, then a child's output, then a's out.1: the child ran inside a."""
    d = D().add("r0.s0:e#0:out.0")
    d.add("r0.s0:a#0:out.0", 2e-2, src={"0": "e#0:out.0"})
    d.add("r0.s0:a.c#0:out.0", 2e-2, src={"0": "e#0:out.0"})
    d.add("r0.s0:a#0:out.1", 2e-2, src={"0": "e#0:out.0"})
    L = d.locate()
    assert str(L.first_divergence.key) == "r0.s0:a.c#0:out.0" and L.first_divergence.path == \
        ("a",)
    assert _locs(L)["r0.s0:a#0:out.0"].cause == "inherited"


# ----------------------------------------------------------------- locate: classification

def test_introduced_is_error_minus_explained_never_negative():
    d = D().add("r0.s0:m.c#0:out.0", 5e-3)          # first record: nothing feeds it
    d.add("r0.s0:m#0:out.0", 3e-2)                  # container, no input: inner 5e-3
    L1 = "model.layers.1"
    d.add(f"r0.s0:{L1}#0:in.0", 4e-3).add(f"r0.s0:{L1}.c#0:out.0", 2e-3, src={"0": "m#0:out.0"})
    d.add(f"r0.s0:{L1}#0:out.0", 1e-1)  # a decoder layer: inner 4e-3 + 2e-3 (summed)
    d.add("r0.s0:k#0:in.0", 1e-3).add("r0.s0:k.c#0:out.0", 9e-2, src={"0": f"{L1}#0:out.0"})
    d.add("r0.s0:k#0:out.0", 5e-1)                  # not a layer: inner 9e-2, its child's
    d.add("r0.s0:z#0:out.0", 1e-3, src={"0": "k#0:out.0"})   # below what feeds it
    locs = _locs(d.locate())
    got = {k.split(":")[1]: (x.input_error, x.inner_error, x.introduced)
           for k, x in locs.items() if ":out." in k}
    assert got["m.c#0"] == (None, None, 5e-3)
    assert got["m#0"] == (None, 5e-3, pytest.approx(3e-2 - 5e-3, rel=1e-12))
    assert got[f"{L1}#0"][0] == 4e-3 and got[f"{L1}#0"][1] == pytest.approx(6e-3, rel=1e-12)
    assert got[f"{L1}#0"][2] == pytest.approx(1e-1 - 6e-3, rel=1e-12)
    assert got["k#0"][:2] == (1e-3, pytest.approx(9e-2, rel=1e-12))
    assert got["k#0"][2] == pytest.approx(5e-1 - 9e-2, rel=1e-12)
    assert got["z#0"] == (5e-1, None, 0.0)


def test_amplification_boundary_is_strict():
    """err == 4 x explained exactly is inherited; just above is introduced."""
    d = D().add("r0.s0:e#0:out.0", E, tol=E / 2)
    d.add("r0.s0:a#0:out.0", 4 * E, tol=E / 2, src={"0": "e#0:out.0"})
    d.add("r0.s0:b#0:out.0", 16.5 * E, tol=E / 2, src={"0": "a#0:out.0"})
    locs = _locs(d.locate())
    assert [locs[f"r0.s0:{n}#0:out.0"].cause for n in "eab"] == \
        ["introduced", "inherited", "introduced"]


def test_shadow_decides_introduced_strictly_above_tolerance():
    d = D().add("r0.s0:e#0:out.0")
    d.add("r0.s0:a#0:out.0", 4 * E, tol=E, shadow=E, src={"0": "e#0:out.0"})
    d.add("r0.s0:b#0:out.0", 4 * E, tol=E, shadow=2 * E, src={"0": "e#0:out.0"})
    d.add("r0.s0:c#0:out.0", E / 2, tol=E, shadow=E / 4, src={"0": "e#0:out.0"})
    locs = _locs(d.locate())
    got = [(locs[f"r0.s0:{n}#0:out.0"].cause, locs[f"r0.s0:{n}#0:out.0"].introduced,
            locs[f"r0.s0:{n}#0:out.0"].input_basis) for n in "abc"]
    assert got == [("inherited", E, "shadow"), ("introduced", 2 * E, "shadow"),
                   (None, E / 4, "shadow")]


def test_a_shape_mismatch_is_introduced_even_behind_another():
    d = D().add("r0.s0:e#0:out.0").add("r0.s0:a#0:out.0", shape=True, src={"0": "e#0:out.0"})
    d.add("r0.s0:b#0:out.0", shape=True, src={"0": "a#0:out.0"})
    locs = _locs(d.locate())
    b = locs["r0.s0:b#0:out.0"]
    assert (b.input_error, b.cause, b.introduced) == (math.inf, "introduced", math.inf)


def test_nan_mismatch_without_error_is_introduced():
    """NaN / Inf positions differ, rel_l2 of the rest 0: over tolerance with nothing to
    explain it, and 0 is not > 4 x 0."""
    d = D().add("r0.s0:e#0:out.0").add("r0.s0:a#0:out.0", 0.0, nan_inf=2,
                                       src={"0": "e#0:out.0"})
    L = d.locate()
    assert str(L.first_divergence.key) == "r0.s0:a#0:out.0"
    assert L.first_divergence.cause == "introduced"


# ----------------------------------------------------------------- culprit

def _op_case():
    """r1.s1 holds the culprit (silu in m.x#1); the same module in r0.s1 and r1.s0, m.x#0, an
    input record and an op input record, a submodule op and another module's call-1 op all sit
    next to it."""
    d = D()
    for req, step in ((0, 0), (1, 0), (0, 1), (1, 1)):
        p = f"r{req}.s{step}:"
        d.add(f"{p}e#0:out.0")
        if (req, step) != (1, 1):
            d.add(f"{p}m.x#1/aten.mm.default@0:out.0", src={"0": "e#0:out.0"})
            d.add(f"{p}m.x#1:out.0", src={"0": "e#0:out.0"})
            continue
        d.add(f"{p}m.x#0/aten.mm.default@0:out.0", 1e-3, src={"0": "e#0:out.0"})
        d.add(f"{p}m.x#0:out.0", 5e-3, src={"0": "e#0:out.0"})
        d.add(f"{p}n#1/aten.add.Tensor@0:out.0", 0.0, src={"0": "e#0:out.0"})
        d.add(f"{p}n#1:out.0", 0.0, src={"0": "e#0:out.0"})
        d.add(f"{p}m.x#1:in.0", 3e-3)
        d.add(f"{p}m.x.sub#0/aten.mm.default@0:out.0", 0.0, src={"0": "e#0:out.0"})
        d.add(f"{p}m.x.sub#0:out.0", 0.0, src={"0": "e#0:out.0"})
        d.add(f"{p}m.x#1/aten.mm.default@0:out.0", 0.0, src={"0": "m.x.sub#0:out.0"})
        d.add(f"{p}m.x#1/aten.silu.default@1:in.0", 0.0)
        d.add(f"{p}m.x#1/aten.silu.default@1:out.0", 2e-2,
              src={"0": "m.x#1/aten.mm.default@0:out.0"})
        d.add(f"{p}m.x#1:out.0", 3e-2, src={"0": "e#0:out.0"})
    return d


def test_op_culprit_reads_its_own_module_call():
    a = _op_case().analysis()
    c = a.culprit
    assert c.where == "m.x#1 / aten.silu.default@1" and (c.req, c.step) == (1, 1)
    assert (c.module_error, c.module_local, c.error) == (3e-2, None, 2e-2)
    assert c.ops_compared == 3                        # mm, silu, and the submodule's mm
    assert (c.ops_one_sided, c.site_ref, c.site_cand, c.neighbours) == (0, None, None, ())
    assert (c.local_error, c.local_basis, c.inherited_error) == (2e-2, "links", 0.0)
    assert c.next_step is None and c.op_key == RecordKey.parse(
        "r1.s1:m.x#1/aten.silu.default@1:out.0")


def test_op_culprit_module_shadow_and_missing_module_record():
    d = _op_case()
    i = next(j for j, r in enumerate(d.recs) if str(r.key) == "r1.s1:m.x#1:out.0")
    d.recs[i] = dataclasses.replace(d.recs[i], shadow=_m(1e-3))
    assert d.analysis().culprit.module_local == 1e-3
    del d.recs[i]
    c = d.analysis().culprit
    assert (c.where, c.module_error, c.module_local) == ("m.x#1 / aten.silu.default@1", None,
                                                         None)


def test_neighbours_are_the_one_sided_ops_right_next_to_the_named_op():
    d = _op_case()
    d.recs[-2] = dataclasses.replace(
        d.recs[-2], cand_key=RecordKey.parse("r1.s1:m.x#1/aten.silu.default@3:out.0"))
    pre = "r1.s1:m.x#1/"
    ops = OpAlignment((), (
        OneSided(f"{pre}aten._to_copy.default@2", "cand", "p.py:5"),
        OneSided(f"{pre}aten._to_copy.default@4", "cand", ""),
        OneSided(f"{pre}aten._to_copy.default@6", "cand", "p.py:9"),
        OneSided(f"{pre}aten.clone.default@2", "ref", "m.py:3"),
        OneSided(f"{pre}aten.clone.default@0", "ref", "m.py:1"),
        OneSided("r1.s1:m.x#0/aten.clone.default@1", "ref", "m.py:7")),
        (("ref:r1.s1:m.x#1/aten.silu.default@1", "m.py:2"),
         ("cand:r1.s1:m.x#1/aten.silu.default@3", "p.py:6")))
    c = d.analysis(ops=ops).culprit
    assert c.neighbours == ("cand only: aten._to_copy.default@2 at p.py:5",
                            "cand only: aten._to_copy.default@4",
                            "ref only: aten.clone.default@2 at m.py:3",
                            "ref only: aten.clone.default@0 at m.py:1")
    assert (c.ops_one_sided, c.site_ref, c.site_cand) == (5, "m.py:2", "p.py:6")
    assert str(c.cand_key) == "r1.s1:m.x#1/aten.silu.default@3:out.0"
    c2 = _op_case().analysis(ops=OpAlignment((), (), ())).culprit
    assert (c2.site_ref, c2.site_cand, c2.ops_one_sided) == (None, None, 0)


def test_module_culprit_local_error_basis_and_next_step():
    d = D().add("r0.s0:m.c#0:out.0", 2e-3).add("r0.s0:m#0:out.0", 2e-2)
    c = d.analysis().culprit
    assert (c.where, c.local_error, c.local_basis, c.inherited_error) == \
        ("m#0", 2e-2, "none", None)
    assert (c.module_error, c.op, c.op_key, c.ops_compared) == (2e-2, None, None, 0)
    assert c.next_step.startswith("accucheck capture MODEL --include 'm' --level op")
    ops = OpAlignment((), (OneSided("r0.s0:m#0/aten.mm.default@0", "cand", "p.py:1"),), ())
    c = d.analysis(ops=ops).culprit
    assert (c.ops_one_sided, c.neighbours, c.site_ref) == (1, (), None)
    # a module culprit with ops recorded inside: no narrowing command
    d2 = D().add("r0.s0:m.c#0/aten.mm.default@0:out.0", 2e-3).add("r0.s0:m#0:out.0", 2e-2)
    c2 = d2.analysis().culprit
    assert (c2.where, c2.ops_compared, c2.next_step) == ("m#0", 1, None)
    # a shape mismatch: nothing to narrow
    c3 = D().add("r0.s0:m#0:out.0", shape=True).analysis().culprit
    assert (c3.where, c3.next_step, c3.error) == ("m#0", None, math.inf)


def test_shadow_culprit_and_golden_label():
    d = D().add("r0.s0:e#0:out.0")
    d.add("r0.s0:m#0:out.0", 3e-2, shadow=2e-2, src={"0": "e#0:out.0"}, golden="cand worse")
    c = d.analysis(golden_path="g.h5").culprit
    assert (c.local_error, c.local_basis, c.module_local, c.golden) == \
        (2e-2, "shadow", 2e-2, "cand worse")
    d = D().add("r0.s0:m#0:out.0", 3e-2)
    assert d.analysis().culprit.golden is None
    # the first record (nothing known to feed it): the shadow error is still the local one
    c = D().add("r0.s0:m#0:out.0", 3e-2, shadow=2e-2).analysis().culprit
    assert (c.local_error, c.local_basis, c.inherited_error) == (2e-2, "shadow", None)


def test_precision_finding_needs_a_dtype_mismatch_inside_one_run_dtype():
    d = D().add("r0.s0:m#0/aten._softmax.default@0:out.0", 1e-3, cand_dtype="float16")
    d.add("r0.s0:m#0:out.0", 1e-3, cand_dtype="float16").add("r0.s0:m#0:out.1", 1e-3)
    op, mod, same = d.recs
    f32 = ("float32", "float32")
    assert precision_finding(op, f32) == \
        "candidate computes aten._softmax.default in float16, reference in float32 " \
        "(both runs float32)"
    assert precision_finding(mod, f32).startswith("candidate computes m in float16")
    assert [precision_finding(op, c) for c in ((None, None), ("float32", "bfloat16"),
                                                (None, "float32"), ("float32", None))] == \
        [None] * 4
    assert precision_finding(same, f32) is None


def _cu(**kw) -> Culprit:
    base = dict(req=0, step=0, module="m", call=0, module_error=None, module_local=None,
                op=None, op_key=None, cand_key=None, error=1.0, local_error=None,
                local_basis="none", inherited_error=None, tolerance=0.5, golden=None,
                site_ref=None, site_cand=None, ops_compared=0, ops_one_sided=0)
    base.update(kw)
    return Culprit(**base)


def test_culprit_amplification_and_local_within():
    amp = [_cu(error=e, inherited_error=i).amplification
           for e, i in ((2.0, 0.5), (0.5, 0.0), (0.0, 0.0), (0.5, None))]
    assert amp == [4.0, math.inf, 1.0, math.inf]
    lw = [_cu(local_error=x, tolerance=0.5).local_within for x in (None, 0.5, 0.4, 0.6)]
    assert lw == [False, True, True, False]


def test_culprit_as_dict_and_where():
    k = RecordKey.parse("r0.s0:m#0/aten.mm.default@2:out.0")
    ck = RecordKey.parse("r0.s0:m#0/aten.mm.default@3:out.0")
    d = _cu(op="aten.mm.default", op_key=k, cand_key=ck, neighbours=("x",),
            error=2.0, inherited_error=0.5).as_dict()
    assert (d["op_key"], d["cand_key"], d["neighbours"], d["amplification"], d["where"]) == \
        (str(k), str(ck), ["x"], 4.0, "m#0 / aten.mm.default@2")
    assert d["local_within"] is False and d["tolerance"] == 0.5
    d = _cu().as_dict()
    assert (d["op_key"], d["cand_key"], d["where"]) == (None, None, "m#0")


@pytest.mark.parametrize("x,text", [(None, "-"), (math.inf, "inf"), (0.0, "0"), (1.0, "1"),
                                    (1e-3, "0.001"), (1.5e-3, "0.0015"), (7e-4, "7.00e-04"),
                                    (7000.0, "7e+03"), (1e4, "1.00e+04"),
                                    (1.5e4, "1.50e+04")])
def test_culprit_lines_number_format(x, text):
    line = culprit_lines(_cu(local_error=x))[1]
    assert line.startswith(f"  module output rel_l2 1; local {text} (none); inherited -; ")


def test_culprit_lines_sections():
    k = RecordKey.parse("r2.s1:m#0/aten.mm.default@2:out.0")
    c = _cu(req=2, step=1, op="aten.mm.default", op_key=k, error=2.0, inherited_error=0.5,
            module_error=0.25, module_local=0.125, precision="candidate computes x",
            golden="cand worse", site_ref="a.py:1", site_cand="a.py:1", ops_one_sided=2,
            neighbours=("cand only: y@1",), cand_key=k)
    assert culprit_lines(c) == [
        "CULPRIT: step 1, request 2, m#0 / aten.mm.default@2",
        "  op output rel_l2 2; local - (none); inherited 0.5; amplification 4; tolerance 0.5",
        "  module output rel_l2 0.25; module local (shadow) 0.125",
        "  precision: candidate computes x",
        "  golden referee: cand worse",
        "  call site: a.py:1",
        f"  candidate op: {k} (aligned across fused / shifted ops)",
        "  next to it, cand only: y@1",
        "  2 op calls in this module on one side only (fused / absent)"]
    lines = culprit_lines(dataclasses.replace(c, module_local=None, site_cand=None,
                                              precision=None, golden=None, cand_key=None,
                                              neighbours=(), ops_one_sided=0))
    assert lines[2:] == ["  module output rel_l2 0.25", "  call site: a.py:1"]
    sites = [culprit_lines(dataclasses.replace(c, site_ref=r, site_cand=s))[5]
             for r, s in ((None, "b.py:2"), ("a.py:1", "b.py:2"))]
    assert sites == ["  call site: ref - | cand b.py:2", "  call site: ref a.py:1 | cand b.py:2"]
    assert not any("call site" in ln for ln in culprit_lines(
        dataclasses.replace(c, site_ref=None, site_cand=None)))
    assert len(culprit_lines(dataclasses.replace(c, module_error=None))) == 8
    m = culprit_lines(_cu(module_error=0.25, next_step="one\ntwo"))
    assert m[0] == "CULPRIT: step 0, m#0" and m[1].startswith("  module output rel_l2 1;")
    assert m[2:] == ["  next, to name the operator (same prompts, --tokens-from as before):",
                     "    one", "    two"]


def test_find_culprit_is_none_without_a_first_divergence():
    d = D().add("r0.s0:e#0:out.0", 6e-3).add("r0.s0:a#0:out.0", 2e-2, src={"0": "e#0:out.0"})
    a = d.analysis()
    assert a.location.diffuse and find_culprit(a) is None
    assert find_culprit(D().add("r0.s0:e#0:out.0").analysis()) is None


# ----------------------------------------------------------------- first difference

def test_first_difference_is_the_first_record_not_identical_after_identical_ones():
    from accucheck.report.diff import first_difference_line

    d = (D().add("r0.s1:m.e#0:out.0", 5e-3)            # later step, earlier in capture order
         .add("r0.s0:m.e#0:out.0", 0.0)
         .add("r1.s0:m.e#0:out.0", 0.0)
         .add("r0.s0:m.l.0.attn.o#0:in.0", 2e-3)       # within tolerance: still the first
         .add("r0.s0:m.l.0.attn.o#0:out.0", 3e-2))
    L = d.locate()
    fd = L.first_difference
    # execution order is step, request, capture order: r0.s0:e, r0.s0:o.in, ..., r1.s0:e,
    # r0.s1:e (the step-1 record added first comes last)
    assert (str(fd.key), fd.error, fd.tolerance) == ("r0.s0:m.l.0.attn.o#0:in.0", 2e-3, TOL)
    line = first_difference_line(fd)
    assert line.startswith("First difference: step 0, m.l.0.attn.o (in.0): rel_l2 0.002 "
                           "(tolerance 0.01); every record before it is identical")
    assert line.endswith("made by code of m.l.0.attn that no record covers")
    assert "no record covers" not in first_difference_line(
        D().add("r0.s0:m.e#0:out.0").add("r0.s0:m.f#0:out.0", 1e-3).locate().first_difference)
    # a top-level module's input: no parent to name
    assert "no record covers" not in first_difference_line(
        D().add("r0.s0:e#0:out.0").add("r0.s0:f#0:in.0", 1e-3).locate().first_difference)


def test_no_first_difference_when_the_first_record_differs_or_none_does():
    assert D().add("r0.s0:m.e#0:out.0", 1e-9).add("r0.s0:m.f#0:out.0", 0.0) \
        .locate().first_difference is None
    assert D().add("r0.s0:m.e#0:out.0").add("r0.s0:m.f#0:out.0").locate().first_difference \
        is None
    # the same values in another dtype are not identical (a precision finding)
    fd = (D().add("r0.s0:m.e#0:out.0").add("r0.s0:m.f#0:out.0", 0.0, cand_dtype="float16")
          .locate().first_difference)
    assert str(fd.key) == "r0.s0:m.f#0:out.0"
    # a shape difference is a difference
    fd = D().add("r0.s0:m.e#0:out.0").add("r0.s0:m.f#0:out.0", shape=True).locate() \
        .first_difference
    assert str(fd.key) == "r0.s0:m.f#0:out.0"


# ----------------------------------------------------------------- two correct devices (issue 33)

def test_the_first_rounding_site_is_no_amplification_in_a_bf16_run():
    """The embedding is bitwise equal; layer 0's norm differs by 0.003 (two correct bf16
    kernels rounding differently) and by more than a float32 tolerance: it is explained by one
    bfloat16 rounding (2^-8), not introduced "x inf". Over 4 x that, it is introduced."""
    for err, cause in ((0.003, "inherited"), (0.0157, "introduced")):
        d = D().add("r0.s0:model.embed_tokens#0:out.0", 0.0)
        d.add("r0.s0:model.layers.0.input_layernorm#0:out.0", err, tol=1e-3,
              src={"0": "model.embed_tokens#0:out.0"})
        a = d.analysis(compute=("float32", "bfloat16"))
        loc = _locs(a.location)["r0.s0:model.layers.0.input_layernorm#0:out.0"]
        assert (loc.cause, loc.rounding, loc.gain) == (cause, 2.0 ** -8, err / 2.0 ** -8)
    # the same in a float32 run: a float32 rounding is 2^-24, 0.003 is introduced
    d = D().add("r0.s0:model.embed_tokens#0:out.0", 0.0)
    d.add("r0.s0:model.layers.0.input_layernorm#0:out.0", 0.003, tol=1e-3,
          src={"0": "model.embed_tokens#0:out.0"})
    assert _locs(d.locate())["r0.s0:model.layers.0.input_layernorm#0:out.0"].cause == "introduced"


def _logits_rows(gains: list[float], fed: float = 0.02) -> Analysis:
    d = D()
    for step, g in enumerate(gains):
        d.add(f"r0.s{step}:model.norm#0:out.0", fed, tol=0.05)
        d.add(f"r0.s{step}:logits#0:out.0", g * fed, tol=0.05, src={"0": "model.norm#0:out.0"})
    return d.analysis(compute=("bfloat16", "bfloat16"))


def test_one_logits_row_that_amplifies_by_chance_is_not_named():
    """Decode rows of the logits amplify what feeds them x1.2 ... x4.5 between two correct
    bf16 devices (measured on SmolLM2): the one over x4 and over tolerance was the culprit.
    A site without peers is judged against what feeds it over its records: median x1.5."""
    a = _logits_rows([1.0, 1.2, 1.5, 4.5])
    assert a.culprit is None and a.exit_code == 0 and a.accumulated
    n = a.location.noise_like
    assert n.peers == 0 and n.ratio == pytest.approx(1.5) and n.gate == 4.0
    assert "a site without peers that amplifies what feeds it x1.5" in a.location.no_culprit_reason


def test_a_logits_site_that_amplifies_in_every_row_is_named():
    """A faulty lm_head: every decode row x4.5 (the prefill row too)."""
    a = _logits_rows([4.5, 4.5, 4.5, 4.5])
    assert a.culprit.module == "logits" and a.exit_code == 1


def test_a_fault_behind_noise_like_rounding_is_still_named():
    """The peer gate judges every introduced record in order: the first (layer 0's norm, like
    its peers) is noise-like; layer 6's down_proj stands out x10 from its peers and is named."""
    d = D()
    prev = "model.embed_tokens#0:out.0"
    d.add(f"r0.s0:{prev}", 0.01, tol=0.05)
    for i in range(10):
        p = f"r0.s0:model.layers.{i}"
        d.add(f"{p}.input_layernorm#0:out.0", 0.06, tol=0.05, src={"0": prev})
        d.add(f"{p}.mlp.down_proj#0:out.0", 0.6 if i == 6 else 0.06, tol=0.05,
              src={"0": f"model.layers.{i}.input_layernorm#0:out.0"})
        d.add(f"{p}#0:out.0", 0.01, tol=0.05, src={"0": f"model.layers.{i}.mlp.down_proj#0:out.0"})
        prev = f"model.layers.{i}#0:out.0"
    a = d.analysis(compute=("bfloat16", "bfloat16"))
    assert a.culprit.module == "model.layers.6.mlp.down_proj" and a.exit_code == 1
    assert a.location.noise_like is None


def test_a_decode_site_is_named_only_where_most_requests_stand_out():
    """Of a site's two records one is x10 its peers, the other x1. Sampled estimates (stats
    store): the lower median over the records (x1), at either phase. Exact tensors: at the
    prefill the median (x5.5: a fault one request's prefill meets alone, x20 there, is named);
    at a decode step the lower median over the requests of each request's median (x1): no
    culprit (before, the median, x5.5, named it); raised in both requests (x10 and x8): named."""
    from accucheck.verdict.locate import _median, _over_requests

    for basis, want in (("sample", 1.0), ("stats", 1.0), ("tensor", 5.5)):
        r = type("R", (), {"basis": basis})()
        assert _median([10.0, 1.0], r) == want, basis
        assert _over_requests({0: [10.0], 1: [1.0]}, r, False) == want, basis
        assert _over_requests({0: [10.0], 1: [1.0]}, r, True) == 1.0, basis

    def analysis(raised: dict[int, float], step: int):
        d = D()
        for req in (0, 1):
            for st in range(step + 1):
                for i in range(6):
                    err = raised.get(req, 0.06) if i == 3 and st == step else 0.06
                    d.add(f"r{req}.s{st}:model.layers.{i}.mlp.down_proj#0:in.0", 0.01, tol=0.05)
                    d.add(f"r{req}.s{st}:model.layers.{i}.mlp.down_proj#0:out.0", err,
                          tol=0.05, src={"0": f"model.layers.{i}.mlp.down_proj#0:in.0"})
        return d.analysis(compute=("bfloat16", "bfloat16"))

    one = analysis({1: 0.6}, step=1)
    assert one.culprit is None and one.exit_code == 0 and one.location.noise_like is not None
    both = analysis({0: 0.6, 1: 0.48}, step=1)
    assert both.culprit.module == "model.layers.3.mlp.down_proj"
    prefill = analysis({1: 1.2}, step=0)
    assert prefill.culprit.module == "model.layers.3.mlp.down_proj"
