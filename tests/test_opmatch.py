"""Op alignment inside a module call: pure index-row logic, no torch, no files."""
from __future__ import annotations

import numpy as np

from accucheck.keys import RecordKey
from accucheck.opmatch import OpAlignment, align, op_calls
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
    ref = [("aten.mul.Tensor", H, 3.0), ("aten.mul.Tensor", H, 40.0)]
    cand = [("aten.mul.Tensor", H, 40.0001)]
    assert align(_seq(ref), _seq(cand)) == [(1, 0, "aligned")]


def test_extra_candidate_op_is_one_sided_not_a_shift():
    cand = DECOMPOSED[:4] + [("aten._to_copy.default", R, 1.0)] + DECOMPOSED[4:]
    pairs = align(_seq(DECOMPOSED), _seq(cand))
    assert [(i, j) for i, j, _ in pairs] == [(0, 0), (1, 1), (2, 2), (3, 3), (4, 5), (5, 6),
                                             (6, 7)]


def test_different_op_names_never_pair_outside_a_fused_region():
    ref = [("aten.silu.default", H, 5.0), ("aten.mm.default", (5, 256), 3.0)]
    cand = [("aten.gelu.default", H, 5.0), ("aten.mm.default", (5, 256), 3.0)]
    pairs = align(_seq(ref), _seq(cand))
    # a 1:1 gap before an anchor is a (trivial) fused region: compared, named on both sides
    assert pairs == [(0, 0, "fused"), (1, 1, "exact")]


def test_alignment_sites_lookup():
    al = OpAlignment((), (), (("ref:r0.s0:m#0/aten.mm.default@1", "x.py:3 in f"),))
    assert al.site("ref", "r0.s0:m#0/aten.mm.default@1") == "x.py:3 in f"
    assert al.site("cand", "r0.s0:m#0/aten.mm.default@1") is None
    seq = _seq(DECOMPOSED)
    assert seq[0].site == "modeling_llama.py:60 in forward"
    assert seq[6].ident == f"r0.s0:{MOD}#0/aten.mm.default@6"
