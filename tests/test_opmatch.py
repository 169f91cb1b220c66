"""Op alignment inside a module call: pure index-row logic, no torch, no files."""
from __future__ import annotations

import numpy as np
import pytest

from accucheck.keys import RecordKey
from accucheck.compare.opmatch import OpAlignment, align, op_calls
from accucheck.store import IndexRow, Stats

MOD = "model.layers.0.input_layernorm"


def _rows(ops: list[tuple[str, tuple[int, ...], float]], module: str = MOD) -> list[IndexRow]:
    rows = []
    for i, (op, shape, l2) in enumerate(ops):
        key = RecordKey(0, 0, module, 0, "out", "0", op, i)
        st = Stats(0.0, 1.0, 0.5, 0.1, 1.0, l2, 0, 0, 0, int(np.prod(shape)))
        rows.append(IndexRow(key, i, "op", "float32", shape, st, 0, "",
                             '{"site": "modeling_llama.py:%d in forward"}' % (60 + i)))
    return rows


def _seq(ops, module=MOD):
    return op_calls(_rows(ops, module))[(0, 0, module, 0)]


H = (1, 5, 256)
R = (1, 5, 1)
DECOMPOSED = [("aten.pow.Tensor_Scalar", H, 10.0), ("aten.mean.dim", R, 2.0),
              ("aten.add.Tensor", R, 2.0), ("aten.rsqrt.default", R, 1.0),
              ("aten.mul.Tensor", H, 16.0), ("aten.mul.Tensor", H, 16.5),
              ("aten.mm.default", (5, 256), 30.0)]


def test_identical_sequences_match_exactly():
    pairs = align(_seq(DECOMPOSED), _seq(DECOMPOSED))
    assert [(i, j) for i, j, _ in pairs] == [(i, i) for i in range(7)]
    assert {k for _, _, k in pairs} == {"exact"}


def test_fused_kernel_pairs_final_outputs_and_leaves_the_rest_one_sided():
    fused = [("npu.npu_rms_norm.default", H, 16.5), ("aten.mm.default", (5, 256), 30.0)]
    pairs = align(_seq(DECOMPOSED), _seq(fused))
    # the matmul after the norm is found although its index shifted from 6 to 1
    assert (6, 1, "aligned") in pairs
    # the fused kernel is compared with the decomposed chain's LAST op (its final output)
    assert (5, 0, "fused") in pairs
    assert len(pairs) == 2  # pow, mean, add, rsqrt, first mul: ref only (fused / absent)


def test_data_breaks_ties_between_same_op_and_shape():
    """Two reference ops equal in name and shape: the candidate pairs with the one holding the
    same data, whether it comes first or last (without the data score the backtrack would
    pick the last one every time)."""
    ref = [("aten.mul.Tensor", H, 3.0), ("aten.mul.Tensor", H, 40.0)]
    cand = [("aten.mul.Tensor", H, 40.0001)]
    assert align(_seq(ref), _seq(cand)) == [(1, 0, "aligned")]
    ref = [("aten.mul.Tensor", H, 40.0), ("aten.mul.Tensor", H, 3.0)]
    assert align(_seq(ref), _seq(cand)) == [(0, 0, "exact")]
    # the same on the candidate side: two candidates, the reference pairs with its data
    assert align(_seq([("aten.mul.Tensor", H, 40.0)]),
                 _seq([("aten.mul.Tensor", H, 40.0001), ("aten.mul.Tensor", H, 3.0)])) == \
        [(0, 0, "exact")]
    assert align(_seq([("aten.mul.Tensor", H, 3.0)]),
                 _seq([("aten.mul.Tensor", H, 3.0), ("aten.mul.Tensor", H, 40.0)])) == \
        [(0, 0, "exact")]


def test_same_overload_breaks_ties_at_equal_data():
    ref = [("aten.mul.Tensor", H, 5.0), ("aten.mul.Scalar", H, 5.0)]
    assert align(_seq(ref), _seq([("aten.mul.Tensor", H, 5.0)])) == [(0, 0, "exact")]
    assert align(_seq(ref), _seq([("aten.mul.Scalar", H, 5.0)])) == [(1, 0, "aligned")]
    # the overload is worth 0.5 of data agreement: the same overload with data 0.375 worse
    # (l2 10 vs 16) still wins; with data 0.7 worse (10 vs 33.3) it loses
    ref = [("aten.mul.Tensor", H, 10.0), ("aten.mul.Scalar", H, 16.0)]
    assert align(_seq(ref), _seq([("aten.mul.Scalar", H, 10.0)])) == [(1, 0, "aligned")]
    ref = [("aten.mul.Tensor", H, 10.0), ("aten.mul.Scalar", H, 10.0 / 0.3)]
    assert align(_seq(ref), _seq([("aten.mul.Scalar", H, 10.0)])) == [(0, 0, "aligned")]


def test_data_tie_break_is_relative_and_saturates():
    """The data term is 1 - |l2 difference| / larger l2, floored at 0: the closer relative
    match wins even when both are far apart in absolute terms."""
    ref = [("aten.mul.Tensor", H, 1000.0), ("aten.mul.Tensor", H, 2000.0)]
    assert align(_seq(ref), _seq([("aten.mul.Tensor", H, 1900.0)])) == [(1, 0, "aligned")]
    assert align(_seq(ref), _seq([("aten.mul.Tensor", H, 1100.0)])) == [(0, 0, "exact")]
    # data outweighs the overload bonus (+0.5) ...
    ref = [("aten.mul.Tensor", H, 50.0), ("aten.mul.Scalar", H, 5.0)]
    assert align(_seq(ref), _seq([("aten.mul.Tensor", H, 5.0)])) == [(1, 0, "aligned")]
    # ... but non-finite statistics give no data term (3.5 vs 3 + 0.1 for a 10x l2 gap)
    ref = [("aten.mul.Tensor", H, float("inf")), ("aten.mul.Scalar", H, 50.0)]
    assert align(_seq(ref), _seq([("aten.mul.Tensor", H, 5.0)])) == [(0, 0, "exact")]
    # a finite pair with data 0.8 (l2 4 vs 5) beats the overload bonus of a non-finite one
    ref = [("aten.mul.Tensor", H, float("inf")), ("aten.mul.Scalar", H, 4.0)]
    assert align(_seq(ref), _seq([("aten.mul.Tensor", H, 5.0)])) == [(1, 0, "aligned")]


def test_extra_candidate_op_is_one_sided_not_a_shift():
    cand = DECOMPOSED[:4] + [("aten._to_copy.default", R, 1.0)] + DECOMPOSED[4:]
    pairs = align(_seq(DECOMPOSED), _seq(cand))
    assert [(i, j) for i, j, _ in pairs] == [(0, 0), (1, 1), (2, 2), (3, 3), (4, 5), (5, 6),
                                             (6, 7)]


def test_different_op_names_never_pair_outside_a_fused_region():
    """Ops with different operators pair only as the END of a fused region (both runs between
    two anchors, same final shape). Anywhere else they stay one-sided."""
    mm = ("aten.mm.default", (5, 256), 3.0)
    # not the last op of its run: silu stays one-sided, the run's last op (add) takes the pair
    ref = [("aten.silu.default", H, 5.0), ("aten.add.Tensor", H, 6.0), mm]
    cand = [("aten.gelu.default", H, 5.0), mm]
    assert align(_seq(ref), _seq(cand)) == [(1, 0, "fused"), (2, 1, "aligned")]
    # the runs end with different shapes: no fused region, nothing pairs across operators
    cand = [("aten.gelu.default", (1, 5, 128), 5.0), mm]
    ref = [("aten.silu.default", H, 5.0), mm]
    assert align(_seq(ref), _seq(cand)) == [(1, 1, "exact")]
    # no anchor after them and different shapes: nothing at all
    assert align(_seq([("aten.silu.default", H, 5.0)]),
                 _seq([("aten.gelu.default", R, 5.0)])) == []
    # and alignment proper (exact / aligned) never pairs different operators
    ref = [("aten.silu.default", H, 5.0), ("aten.gelu.default", H, 5.0), mm]
    cand = [("aten.gelu.default", H, 5.0), ("aten.silu.default", H, 5.0), mm]
    for i, j, kind in align(_seq(ref), _seq(cand)):
        if kind != "fused":
            assert ref[i][0] == cand[j][0], (i, j, kind)


def test_a_one_to_one_gap_before_an_anchor_is_a_trivial_fused_region():
    ref = [("aten.silu.default", H, 5.0), ("aten.mm.default", (5, 256), 3.0)]
    cand = [("aten.gelu.default", H, 5.0), ("aten.mm.default", (5, 256), 3.0)]
    # compared (as "fused": different operators with the same result shape), named on both sides
    assert align(_seq(ref), _seq(cand)) == [(0, 0, "fused"), (1, 1, "exact")]


def _two_outputs(seq, i: int, shape2):
    """seq with op i given a second output (slot 1) of shape2, as a fused norm returning
    (y, rstd) has."""
    from dataclasses import replace

    c = seq[i]
    extra = replace(c.outs[0], key=replace(c.outs[0].key, slot="1"), shape=shape2)
    return seq[:i] + [replace(c, outs=c.outs + (extra,))] + seq[i + 1:]


def test_fused_kernel_with_two_outputs_pairs_by_its_first_output():
    mm = ("aten.mm.default", (5, 256), 30.0)
    ref = _seq(DECOMPOSED[:6] + [mm])
    cand = _two_outputs(_seq([("npu.npu_rms_norm.default", H, 16.5), mm]), 0, R)
    assert align(ref, cand) == [(5, 0, "fused"), (6, 1, "aligned")]
    # the same with the multi-output op on the reference side
    ref = _two_outputs(_seq([("npu.npu_rms_norm.default", H, 16.5), mm]), 0, R)
    cand = _seq(DECOMPOSED[:6] + [mm])
    assert align(ref, cand) == [(0, 5, "fused"), (1, 6, "aligned")]


def test_fused_region_with_another_final_shape_is_not_compared(tmp_path):
    """A fused kernel whose output has another shape than the decomposed chain's last op (e.g. a
    kernel that also returns a reduced statistic first): the two are not paired, so the diff
    reports no false shape error; both runs are listed as fused / absent."""
    from test_diff import write

    from accucheck.compare.diff import diff_captures

    mod = "r0.s0:model.layers.0.input_layernorm#0/"
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal(H), rng.standard_normal((5, 256))
    ref = {f"{mod}aten.pow.Tensor_Scalar@0:out.0": x, f"{mod}aten.mul.Tensor@1:out.0": x,
           f"{mod}aten.mm.default@2:out.0": y}
    cand = {f"{mod}npu.npu_rms_norm.default@0:out.0": rng.standard_normal(R),
            f"{mod}npu.npu_cast.default@1:out.0": rng.standard_normal((1, 5, 128)),
            f"{mod}aten.mm.default@2:out.0": y}
    d = diff_captures(write(tmp_path / "r.h5", ref), write(tmp_path / "c.h5", cand))
    assert [str(r.key) for r in d.records] == [f"{mod}aten.mm.default@2:out.0"]
    assert d.within and not [r for r in d.records if r.basis == "shape"]
    assert d.ops.n_fused == 0 and len(d.ops.one_sided) == 4
    # the same chain ending in the fused kernel's shape IS compared by its final output
    cand[f"{mod}npu.npu_cast.default@1:out.0"] = x
    d = diff_captures(write(tmp_path / "r2.h5", ref), write(tmp_path / "c2.h5", cand))
    assert d.ops.n_fused == 1 and d.record(f"{mod}aten.mul.Tensor@1:out.0").error == 0.0


def test_alignment_sites_lookup():
    al = OpAlignment((), (), (("ref:r0.s0:m#0/aten.mm.default@1", "x.py:3 in f"),))
    assert al.site("ref", "r0.s0:m#0/aten.mm.default@1") == "x.py:3 in f"
    assert al.site("cand", "r0.s0:m#0/aten.mm.default@1") is None
    seq = _seq(DECOMPOSED)
    assert seq[0].site == "modeling_llama.py:60 in forward"
    assert seq[6].ident == f"r0.s0:{MOD}#0/aten.mm.default@6"
    from accucheck.compare.opmatch import op_ident

    assert op_ident(seq[6].outs[0].key) == seq[6].ident


def _op_capture(path, calls, module_calls=((0, 0, "model.layers.0.mlp", 0),)):
    """A synthetic op-level capture: calls = [(module call index, op, op_index, {role.slot:
    shape}, site)], tensors of ones scaled by the op index."""
    from test_diff import _stats

    from accucheck.store import CaptureWriter

    with CaptureWriter(path, meta={"dtype": "float32"}, store="full") as w:
        for mc, op, idx, outs, site in calls:
            req, step, module, call = module_calls[mc]
            for rs, shape in outs.items():
                role, slot = rs.split(".")
                key = RecordKey(req, step, module, call, role, slot, op, idx)
                x = np.full(shape, 1.0 + idx, np.float32)
                w.add(key, "op", "float32", x.shape, _stats(x), 0, x,
                      '{"site": "%s"}' % site if site else "")
        w.set_request(0, [1, 2, 3], [4])
    return path


def test_align_captures_pairs_outputs_and_inputs_by_slot_fused_by_output_only(tmp_path):
    from accucheck.compare.opmatch import align_captures
    from accucheck.store import open_capture

    ref = _op_capture(tmp_path / "r.h5", [
        (0, "aten.pow.Tensor_Scalar", 0, {"in.0": H, "out.0": H}, "m.py:1 in f"),
        (0, "aten.mean.dim", 1, {"in.0": H, "out.0": R}, "m.py:2 in f"),
        (0, "aten.mul.Tensor", 2, {"in.0": H, "in.1": R, "out.0": H}, "m.py:3 in f"),
        (0, "aten.mm.default", 3, {"in.0": H, "in.1": (256, 256), "out.0": (5, 256)},
         "m.py:4 in f")])
    cand = _op_capture(tmp_path / "c.h5", [
        (0, "npu.npu_rms_norm.default", 0, {"in.0": H, "in.1": (256,), "out.0": H}, "n.py:9"),
        (0, "aten.mm.default", 1, {"in.0": H, "in.2": H, "out.0": (5, 256)}, "")])
    with open_capture(ref) as r, open_capture(cand) as c:
        pairs, al = align_captures(r, c)
    got = [(str(a.key), str(b.key)) for a, b in pairs]
    mod = "r0.s0:model.layers.0.mlp#0/"
    assert got == [
        # fused: the chain's last op against the kernel, outputs only (inputs differ in kind)
        (f"{mod}aten.mul.Tensor@2:out.0", f"{mod}npu.npu_rms_norm.default@0:out.0"),
        # aligned: output, then the inputs both sides have (slot 0; 1 is ref only, 2 cand only)
        (f"{mod}aten.mm.default@3:out.0", f"{mod}aten.mm.default@1:out.0"),
        (f"{mod}aten.mm.default@3:in.0", f"{mod}aten.mm.default@1:in.0")]
    assert [(m.kind, m.ref.split("/")[1], m.cand.split("/")[1]) for m in al.matches] == [
        ("fused", "aten.mul.Tensor@2", "npu.npu_rms_norm.default@0"),
        ("aligned", "aten.mm.default@3", "aten.mm.default@1")]
    assert [(o.ident.split("/")[1], o.only_in, o.site) for o in al.one_sided] == [
        ("aten.pow.Tensor_Scalar@0", "ref", "m.py:1 in f"),
        ("aten.mean.dim@1", "ref", "m.py:2 in f")]
    assert al.n_fused == 1
    assert al.site("ref", f"{mod}aten.mm.default@3") == "m.py:4 in f"
    assert al.site("cand", f"{mod}npu.npu_rms_norm.default@0") == "n.py:9"
    assert al.site("cand", f"{mod}aten.mm.default@1") is None   # no site recorded


def test_align_captures_module_calls_by_key_and_one_side_only_calls(tmp_path):
    from accucheck.compare.opmatch import align_captures
    from accucheck.store import open_capture

    calls = ((0, 0, "model.layers.0.mlp", 0), (0, 0, "model.layers.0.mlp", 1),
             (0, 1, "model.layers.0.mlp", 0), (0, 1, "model.norm", 0))
    silu, gelu = "aten.silu.default", "aten.gelu.default"
    ref = _op_capture(tmp_path / "r.h5", [(0, silu, 0, {"out.0": H}, ""),
                                          (1, silu, 0, {"out.0": H}, ""),
                                          (2, silu, 0, {"out.0": H}, "")], calls)
    cand = _op_capture(tmp_path / "c.h5", [(1, silu, 0, {"out.0": H}, ""),
                                           (2, gelu, 0, {"out.0": H}, ""),
                                           (3, "aten.rsqrt.default", 0, {"out.0": R}, "")], calls)
    with open_capture(ref) as r, open_capture(cand) as c:
        pairs, al = align_captures(r, c)
        # a filter (diff --step / --include) applies before alignment
        pairs1, al1 = align_captures(r, c, lambda k: k.step == 1)
    assert [(str(a.key), str(b.key)) for a, b in pairs] == [
        ("r0.s0:model.layers.0.mlp#1/aten.silu.default@0:out.0",
         "r0.s0:model.layers.0.mlp#1/aten.silu.default@0:out.0"),
        ("r0.s1:model.layers.0.mlp#0/aten.silu.default@0:out.0",
         "r0.s1:model.layers.0.mlp#0/aten.gelu.default@0:out.0")]
    assert [m.kind for m in al.matches] == ["exact", "fused"]
    assert [(o.ident, o.only_in) for o in al.one_sided] == [
        ("r0.s0:model.layers.0.mlp#0/aten.silu.default@0", "ref"),
        ("r0.s1:model.norm#0/aten.rsqrt.default@0", "cand")]   # a call the reference lacks
    assert [m.kind for m in al1.matches] == ["fused"] and len(pairs1) == 1
    assert [o.only_in for o in al1.one_sided] == ["cand"]


def _best(ref, cand) -> float:
    """Oracle: the best total score of any monotone matching (memoized recursion)."""
    from functools import lru_cache

    from accucheck.compare.opmatch import _score

    @lru_cache(maxsize=None)
    def best(i, j):
        if i == len(ref) or j == len(cand):
            return 0.0
        s = _score(ref[i], cand[j])
        pair = s + best(i + 1, j + 1) if s != float("-inf") else float("-inf")
        return max(best(i + 1, j), best(i, j + 1), pair)
    return best(0, 0)


def test_alignment_is_monotone_one_to_one_and_optimal():
    from accucheck.compare.opmatch import _score

    rng = np.random.default_rng(11)
    alphabet = [("aten.mul.Tensor", H), ("aten.mul.Scalar", H), ("aten.add.Tensor", H),
                ("aten.mul.Tensor", R)]
    for trial in range(150):
        def seq():
            k = int(rng.integers(1, 6))
            return [alphabet[int(rng.integers(len(alphabet)))] + (float(rng.choice([1, 2, 5])),)
                    for _ in range(k)]
        ref, cand = _seq(seq()), _seq(seq())
        pairs = align(ref, cand)
        for kind in ("exact/aligned", "all"):
            ps = [(i, j) for i, j, k in pairs if kind == "all" or k != "fused"]
            assert [i for i, _ in ps] == sorted({i for i, _ in ps}), (trial, pairs)
            assert [j for _, j in ps] == sorted({j for _, j in ps}), (trial, pairs)
        nw = [(i, j) for i, j, k in pairs if k != "fused"]
        assert all(_score(ref[i], cand[j]) != float("-inf") for i, j in nw)
        assert sum(_score(ref[i], cand[j]) for i, j in nw) == pytest.approx(_best(ref, cand)), \
            trial


def test_large_calls_fall_back_to_difflib(monkeypatch):
    """Above MAX_DP cell pairs the alignment is difflib on (operator, shapes): no data
    tie-break there (the first equal token pairs), and no junk heuristic on long sequences."""
    import accucheck.compare.opmatch as om

    ref = _seq([("aten.mul.Tensor", H, 40.0), ("aten.mul.Tensor", H, 3.0)])
    cand = _seq([("aten.mul.Tensor", H, 3.0)])
    monkeypatch.setattr(om, "MAX_DP", 2)            # 2 x 1 cells: still the DP (data wins)
    assert align(ref, cand) == [(1, 0, "aligned")]
    monkeypatch.setattr(om, "MAX_DP", 1)            # over it: difflib, first token
    assert align(ref, cand) == [(0, 0, "exact")]
    long = _seq([("aten.add.Tensor", H, 1.0)] * 250)
    monkeypatch.setattr(om, "MAX_DP", 0)
    got = align(long, long[:200] + _seq([("aten.mm.default", (5, 256), 1.0)]) + long[200:])
    assert [(i, j) for i, j, _ in got] == [(i, i if i < 200 else i + 1) for i in range(250)]
    shifted = align(ref, _seq([("aten.add.Tensor", R, 1.0), ("aten.mul.Tensor", H, 3.0)]))
    assert shifted == [(0, 1, "aligned")]
    # cells are n x m (1 x 2 = 2 > 1): difflib pairs the first equal candidate, not the data
    monkeypatch.setattr(om, "MAX_DP", 1)
    assert align(cand, _seq([("aten.mul.Tensor", H, 40.0), ("aten.mul.Tensor", H, 3.0)])) == \
        [(0, 0, "exact")]


def test_op_calls_groups_op_records_only():
    from dataclasses import replace

    rows = _rows(DECOMPOSED[:3])
    module_row = replace(rows[0], key=RecordKey(0, 0, MOD, 0, "out", "0"), order=10)
    shadow = replace(rows[1], key=replace(rows[1].key, role="shadow"), order=11)
    inp = replace(rows[2], key=replace(rows[2].key, role="in"), order=12, extra="")
    calls = op_calls(rows + [module_row, shadow, inp])
    (seq,) = calls.values()
    assert [(c.op, c.op_index, len(c.outs), len(c.ins)) for c in seq] == [
        ("aten.pow.Tensor_Scalar", 0, 1, 0), ("aten.mean.dim", 1, 1, 0),
        ("aten.add.Tensor", 2, 1, 1)]       # module and shadow records left out, inputs kept
    kept = op_calls(rows, lambda k: k.op_index != 1)[(0, 0, MOD, 0)]
    assert [c.op_index for c in kept] == [0, 2]          # a filter drops records before grouping
    # the call site: from the first record that has one; null / malformed extra ignored
    a = replace(rows[0], extra='{"site": null}')
    b = replace(rows[0], key=replace(rows[0].key, role="in"), extra='{"site": "x.py:1 in f"}')
    c = replace(rows[0], key=replace(rows[0].key, role="in", slot="1"),
                extra='{"site": "y.py:2 in g"}')
    assert op_calls([a, b, c])[(0, 0, MOD, 0)][0].site == "x.py:1 in f"
    assert op_calls([a])[(0, 0, MOD, 0)][0].site == ""
    bad = [replace(rows[0], extra="[1, 2]"), replace(rows[1], extra="{not json")]
    assert [x.site for x in op_calls(bad)[(0, 0, MOD, 0)]] == ["", ""]
    # an op call whose outputs were not recorded has no l2 and no shapes
    only_in = op_calls([inp])[(0, 0, MOD, 0)][0]
    assert (only_in.outs, only_in.l2, only_in.shapes) == ((), 0.0, ())


def test_records_are_frozen_and_validated():
    import dataclasses

    from accucheck.compare.opmatch import OneSided, OpMatch, op_packet

    seq = _seq(DECOMPOSED[:1])
    al = OpAlignment((OpMatch("a", "b", "fused"),), (OneSided("c", "ref", ""),), ())
    for obj, field in ((seq[0], "op"), (al.matches[0], "kind"), (al.one_sided[0], "ident"),
                       (al, "matches")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, field, None)
    with pytest.raises(ValueError, match="kind must be one of"):
        OpMatch("a", "b", "similar")
    assert al.n_fused == 1 and OpAlignment((), (), ()).n_fused == 0
    assert op_packet("aten.mm.default") == "aten.mm" and op_packet("aten.mm") == "aten.mm"
    assert op_packet("npu.npu_rms_norm.default") == "npu.npu_rms_norm" and op_packet("f") == "f"


def test_same_operator_with_another_shape_never_pairs():
    assert align(_seq([("aten.mul.Tensor", H, 5.0)]), _seq([("aten.mul.Tensor", R, 5.0)])) == []
    ref = _seq([("aten.mul.Tensor", H, 5.0), ("aten.mm.default", (5, 256), 3.0)])
    cand = _seq([("aten.mul.Tensor", (1, 5, 128), 5.0), ("aten.mm.default", (5, 256), 3.0)])
    assert align(ref, cand) == [(1, 1, "exact")]
