"""Tensor-parallel record merging (accucheck.capture.record.ranks) and the coverage verdict
(accucheck.coverage) on hand-made records: no vLLM, fast."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from accucheck.coverage import coverage, coverage_line, sites_of
from accucheck.errors import UserError
from accucheck.capture.record.ranks import merge_ranks, rank_slot, shard_layout
from accucheck.store import open_capture


@dataclass
class Rec:
    req: int
    step: int
    module: str
    call: int
    role: str
    slot: str
    dtype: str
    shape: tuple
    stats: np.ndarray
    checksum: int
    data: np.ndarray | None
    order: int
    rank: int
    spilled: list | None = None


def rec(module, rank, values, *, req=0, step=0, role="out", order=0, data=True, checksum=None):
    v = np.asarray(values, dtype=np.float32)
    f = v.astype(np.float64).ravel()
    stats = np.array([f.min(), f.max(), f.mean(), 0.0, np.abs(f).max(), np.sqrt(f @ f), 0, 0,
                      0, f.size])
    return Rec(req, step, module, 0, role, "0", "float32", v.shape, stats,
               int(v.view(np.uint32).sum()) if checksum is None else checksum,
               v if data else None, order, rank)


KINDS = {"emb": "VocabParallelEmbedding", "qkv": "QKVParallelLinear",
         "o": "RowParallelLinear", "up": "ColumnParallelLinear", "attn": "Attention",
         "layer": "LlamaAttention"}


def test_shard_layouts_by_class_and_role():
    assert shard_layout("QKVParallelLinear", "out") == "packed"
    assert shard_layout("MergedColumnParallelLinear", "out") == "packed"
    assert shard_layout("ColumnParallelLinear", "out") == "concat"
    assert shard_layout("Attention", "out") == "concat"
    # the container around the inner attention ends with "Attention" but is replicated
    assert shard_layout("LlamaAttention", "out") is None
    assert shard_layout("RowParallelLinear", "out") is None   # all-reduced
    assert shard_layout("RowParallelLinear", "in") == "concat"  # input_is_parallel
    assert shard_layout("VocabParallelEmbedding", "out") is None
    assert shard_layout("ColumnParallelLinear", "shadow") is None
    # subclasses (vllm-ascend's) keep their parent's layout
    assert shard_layout("AscendRowParallelLinear", "in") == "concat"
    assert shard_layout("AscendQKVParallelLinear", "out") == "packed"
    assert shard_layout("AscendColumnParallelLinear", "out") == "concat"


def test_equal_replicated_copies_are_stored_once():
    m = merge_ranks({0: [rec("emb", 0, [1, 2]), rec("o", 0, [3, 4], order=1)],
                     1: [rec("emb", 1, [1, 2]), rec("o", 1, [3, 4], order=1)]}, KINDS, 2)
    assert [(slot, r.module, r.rank) for slot, r in m.records] == [("0", "emb", 0),
                                                                    ("0", "o", 0)]
    assert m.verified == 2 and m.disagreements == [] and m.shards == {}
    assert sorted(m.seen) == [(0, 0, 0, "emb#0:out.0"), (0, 0, 0, "o#0:out.0"),
                              (1, 0, 0, "emb#0:out.0"), (1, 0, 0, "o#0:out.0")]


def test_a_rank_that_differs_is_stored_and_reported_with_its_size():
    m = merge_ranks({0: [rec("emb", 0, [1, 2]), rec("o", 0, [3, 4], order=1)],
                     1: [rec("emb", 1, [1, 2]), rec("o", 1, [3, 4.4], order=1)]}, KINDS, 2)
    assert [(slot, r.module, r.rank) for slot, r in m.records] == [
        ("0", "emb", 0), ("0", "o", 0), ("0.rank1", "o", 1)]
    [d] = m.disagreements
    assert (d["module"], d["ranks"], d["basis"]) == ("o", [0, 1], "tensor")
    assert d["rel_l2"] == pytest.approx(0.4 / 5.0, rel=1e-6)
    assert m.verified == 1


def test_statistics_only_disagreement_is_sized_by_the_norms():
    a = rec("o", 0, [3, 4], data=False)
    b = rec("o", 1, [3, 4.4], data=False)
    [d] = merge_ranks({0: [a], 1: [b]}, KINDS, 2).disagreements
    assert d["basis"] == "l2 norms"
    assert d["rel_l2"] == pytest.approx(abs(np.hypot(3, 4.4) - 5.0) / 5.0, rel=1e-6)
    # same values, different checksum (bit patterns): still a disagreement
    c = rec("o", 1, [3, 4], data=False, checksum=a.checksum + 1)
    [d] = merge_ranks({0: [a], 1: [c]}, KINDS, 2).disagreements
    assert d["rel_l2"] == 0.0


def test_copies_differ_by_shape_checksum_or_statistics():
    a = rec("o", 0, [3, 4])
    for b in (rec("o", 1, [3, 4], checksum=a.checksum),               # equal: verified
              rec("o", 1, [[3, 4]], checksum=a.checksum),             # another shape
              rec("o", 1, [3, 4], checksum=a.checksum + 1)):          # another bit pattern
        b.stats = a.stats.copy()
        m = merge_ranks({0: [a], 1: [b]}, KINDS, 2)
        assert (m.verified, len(m.disagreements)) == ((1, 0) if b.shape == a.shape and
                                                      b.checksum == a.checksum else (0, 1))
    c = rec("o", 1, [3, 4], checksum=a.checksum)
    c.stats = a.stats.copy()
    c.stats[3] = 7.0  # same shape and checksum, other statistics: still not the same tensor
    assert len(merge_ranks({0: [a], 1: [c]}, KINDS, 2).disagreements) == 1
    # a NaN statistic (the mean of an all-NaN tensor) is equal to itself
    n0, n1 = rec("o", 0, [3, 4]), rec("o", 1, [3, 4])
    n0.stats[2] = n1.stats[2] = np.nan
    assert merge_ranks({0: [n0], 1: [n1]}, KINDS, 2).verified == 1


@pytest.mark.parametrize("with_data", [(True, False), (False, True)])
def test_a_copy_without_data_is_sized_by_the_norms(with_data):
    a = rec("o", 0, [3, 4], data=with_data[0])
    b = rec("o", 1, [3, 4.4], data=with_data[1])
    [d] = merge_ranks({0: [a], 1: [b]}, KINDS, 2).disagreements
    assert d["basis"] == "l2 norms"
    assert d["rel_l2"] == pytest.approx(abs(np.hypot(3, 4.4) - 5.0) / 5.0, rel=1e-6)


def test_sharded_records_keep_every_rank_with_an_annotation():
    m = merge_ranks({0: [rec("qkv", 0, [1, 2]), rec("attn", 0, [5], order=1),
                         rec("o", 0, [5], role="in", order=2)],
                     1: [rec("qkv", 1, [7, 8]), rec("attn", 1, [6], order=1),
                         rec("o", 1, [6], role="in", order=2)]}, KINDS, 2)
    assert [(slot, r.module, r.role, r.rank) for slot, r in m.records] == [
        ("0.rank0", "qkv", "out", 0), ("0.rank1", "qkv", "out", 1),
        ("0.rank0", "attn", "out", 0), ("0.rank1", "attn", "out", 1),
        ("0.rank0", "o", "in", 0), ("0.rank1", "o", "in", 1)]
    assert m.shards == {
        "qkv#0:out.0": {"dim": -1, "ranks": [0, 1], "layout": "packed"},
        "attn#0:out.0": {"dim": -1, "ranks": [0, 1], "layout": "concat"},
        "o#0:in.0": {"dim": -1, "ranks": [0, 1], "layout": "concat"}}
    assert m.disagreements == [] and m.verified == 0
    assert rank_slot("1.0", 3) == "1.0.rank3"


def test_a_record_one_rank_lacks_is_stored_but_not_verified():
    m = merge_ranks({0: [rec("emb", 0, [1, 2]), rec("o", 0, [3], order=1)],
                     1: [rec("emb", 1, [1, 2])]}, KINDS, 2)
    assert [(slot, r.module) for slot, r in m.records] == [("0", "emb"), ("0", "o")]
    assert m.verified == 1 and m.disagreements == []
    assert (1, 0, 0, "o#0:out.0") not in m.seen  # the coverage check finds it missing


def test_one_rank_is_a_plain_capture():
    m = merge_ranks({0: [rec("qkv", 0, [1, 2]), rec("o", 0, [3], order=1)]}, KINDS, 1)
    assert [(slot, r.module) for slot, r in m.records] == [("0", "qkv"), ("0", "o")]
    assert m.shards == {} and m.verified == 0


def test_writing_order_follows_execution_per_request_and_step():
    r0 = [rec("emb", 0, [1], req=1, step=0, order=0), rec("emb", 0, [1], req=0, step=1, order=0),
          rec("emb", 0, [1], req=0, step=0, order=0), rec("o", 0, [2], req=0, step=0, order=1)]
    m = merge_ranks({0: r0}, KINDS, 1)
    assert [(r.req, r.step, r.module) for _s, r in m.records] == [
        (0, 0, "emb"), (0, 0, "o"), (0, 1, "emb"), (1, 0, "emb")]


def _sites(ranks, reqs, steps, names, drop=()):
    return [(r, q, s, f"{n}#0:out.0") for r in ranks for q in range(reqs) for s in range(steps)
            for n in names if (r, q, s, n) not in drop]


def test_full_coverage():
    cov = coverage(_sites([0, 1], 2, 3, ["a", "b"]), 2, 3, [0, 1])
    assert cov["ok"] and cov["expected"] == cov["recorded"] == 24
    assert coverage_line(cov) == ("coverage: 24 of 24 expected records (2 ranks x 2 requests "
                                  "x 3 steps x 2 sites)")


def test_a_silent_rank_is_named():
    cov = coverage(_sites([0], 2, 3, ["a", "b"]), 2, 3, [0, 1])
    assert not cov["ok"] and cov["missing"]["by_rank"] == {"1": 12}
    line = coverage_line(cov)
    assert line.startswith("coverage FAILED: 12 of 24 expected records (2 ranks x 2 requests")
    assert "rank 1 recorded 0 of 12 expected records" in line
    assert "first missing: rank 1 r0.s0:a#0:out.0" in line
    # every step and every request lacks something: neither is singled out
    assert line == ("coverage FAILED: 12 of 24 expected records (2 ranks x 2 requests x 3 steps "
                    "x 2 sites); rank 1 recorded 0 of 12 expected records; first missing: "
                    "rank 1 r0.s0:a#0:out.0")


def test_a_missing_decode_step_is_named():
    drop = {(0, q, 2, n) for q in range(2) for n in "ab"}
    cov = coverage(_sites([0], 2, 3, ["a", "b"], drop), 2, 3)
    assert cov["missing"]["by_step"] == {"2": 4} and not cov["ok"]
    assert "missing at step 2" in coverage_line(cov)
    assert coverage_line(cov) == ("coverage FAILED: 8 of 12 expected records (1 rank x 2 "
                                  "requests x 3 steps x 2 sites); missing at step 2; first "
                                  "missing: rank 0 r0.s2:a#0:out.0")
    assert "rank" not in coverage_line(cov).split(";", 1)[1].split("first missing")[0]


def test_a_module_missing_in_one_request_is_named():
    drop = {(0, 1, s, "b") for s in range(3)}
    cov = coverage(_sites([0], 2, 3, ["a", "b"], drop), 2, 3)
    line = coverage_line(cov)
    assert "missing in request 1" in line and "first missing: rank 0 r1.s0:b#0:out.0" in line
    assert line == ("coverage FAILED: 9 of 12 expected records (1 rank x 2 requests x 3 steps "
                    "x 2 sites); missing in request 1; first missing: rank 0 r1.s0:b#0:out.0")


def test_decode_steps_expect_the_prefill_sites_when_none_was_recorded():
    cov = coverage(_sites([0], 1, 1, ["a"]), 1, 3)
    assert cov["expected"] == 3 and cov["missing"]["by_step"] == {"1": 1, "2": 1}


def test_decode_may_record_other_sites_than_prefill():
    got = _sites([0], 1, 1, ["a", "mask"]) + [(0, 0, s, "a#0:out.0") for s in (1, 2)]
    cov = coverage(got, 1, 3)
    assert cov["ok"] and cov["sites"] == {"prefill": 2, "decode": 1} and cov["expected"] == 4


def test_nothing_recorded_fails():
    cov = coverage([], 2, 3)
    assert not cov["ok"] and coverage_line(cov).startswith("coverage FAILED: nothing")


def test_sites_of_counts_module_records_only():
    keys = ["r0.s0:model.a#0:out.0", "r0.s1:model.a#0/aten.mm@0:out.0",
            "r0.s0:model.a#0:shadow.0", "r1.s0:logits#0:out.0"]
    assert sites_of(keys, rank=2) == [(2, 0, 0, "model.a#0:out.0"), (2, 1, 0, "logits#0:out.0")]


# -- diff of tensor-parallel captures (accucheck.compare.diff.rank_pairs / _join_shards) ----------
SITE = "model.layers.0.self_attn.o_proj"


def _tp_pair(tmp_path, *, fault_rank=None, layout="concat", store="full", ref_sharded=False,
             role="in"):
    """A TP=1 capture and a TP=2 one of the same run: o_proj's input (row-parallel: each rank
    holds half of its last dimension; or, role "out", a column-parallel output) stored per rank
    with a shard annotation; the layers before and after replicated. `fault_rank`: that rank's
    part is off by 10 %."""
    from tests.test_diff import base, write

    t = base(layers=2, hidden=8)
    order = list(t)
    i = order.index("r0.s0:model.layers.0.self_attn#0:out.0")
    whole = np.random.default_rng(1).standard_normal((1, 3, 8))
    one = {k: t[k] for k in order[:i]}
    one[f"r0.s0:{SITE}#0:{role}.0"] = whole
    one.update({k: t[k] for k in order[i:]})
    two = {}
    for k, v in one.items():
        if k == f"r0.s0:{SITE}#0:{role}.0":
            for r in (0, 1):
                part = v[..., 4 * r:4 * r + 4].copy()
                if r == fault_rank:
                    part *= 1.1
                two[f"{k}.rank{r}"] = part
        else:
            two[k] = v
    meta = {"tensor_parallel": {"size": 2, "shards": {
        f"{SITE}#0:{role}.0": {"dim": -1, "ranks": [0, 1], "layout": layout}}}}
    tmp_path.mkdir(exist_ok=True)
    a = write(tmp_path / "tp1.h5", one, store=store)
    b = write(tmp_path / "tp2.h5", two, store=store, meta=meta)
    return (b, a) if ref_sharded else (a, b)


def test_shards_are_joined_against_the_unsharded_tensor(tmp_path):
    from accucheck.compare.diff import diff_captures

    for ref_sharded in (False, True):
        ref, cand = _tp_pair(tmp_path / str(ref_sharded), ref_sharded=ref_sharded)
        d = diff_captures(ref, cand)
        parts = [r for r in d.records if r.key.module == SITE]
        assert [r.key.slot for r in parts] == ["0.rank0", "0.rank1"]
        assert all(r.error == 0.0 and r.ref_shape == (1, 3, 4) for r in parts)
        assert d.missing == () and not any("shard" in n for n in d.notes)


def test_a_wrong_shard_is_named_with_its_rank(tmp_path):
    from accucheck.compare.diff import diff_captures
    from accucheck.verdict.locate import locate

    ref, cand = _tp_pair(tmp_path, fault_rank=1, role="out")
    d = diff_captures(ref, cand)
    by_slot = {r.key.slot: r for r in d.records if r.key.module == SITE}
    assert by_slot["0.rank0"].error == 0.0
    assert by_slot["0.rank1"].error == pytest.approx(0.1, rel=1e-5)
    assert not by_slot["0.rank1"].within
    # the parts keep the unsharded record's place in the execution order
    order = [str(r.key) for r in d.records]
    assert order.index(f"r0.s0:{SITE}#0:out.0.rank1") < order.index(
        "r0.s0:model.layers.0.self_attn#0:out.0")
    first = locate(d).first_divergence
    assert (first.key.module, first.key.slot, first.cause) == (SITE, "0.rank1", "introduced")


@pytest.mark.parametrize("layout,store", [("packed", "full"), ("concat", "stats")])
def test_shards_that_cannot_be_joined_are_noted_never_errors(tmp_path, layout, store):
    from accucheck.compare.diff import diff_captures

    ref, cand = _tp_pair(tmp_path, layout=layout, store=store)
    d = diff_captures(ref, cand)
    assert not [r for r in d.records if r.key.module == SITE]
    assert d.missing == ()
    [note] = [n for n in d.notes if "shard records" in n]
    assert note.startswith("2 tensor-parallel shard records (meta tensor_parallel.shards) are "
                           "not compared")


def test_a_differing_rank_copy_is_compared_under_its_own_key(tmp_path):
    from accucheck.compare.diff import diff_captures
    from tests.test_diff import base, write

    t = base(layers=2, hidden=8)
    k = "r0.s0:model.layers.1.mlp#0:out.0"
    cand = dict(t)
    items = list(cand.items())
    at = [x for x, _ in items].index(k)
    items.insert(at + 1, (f"{k}.rank1", t[k] * 1.5))
    meta = {"tensor_parallel": {"size": 2, "shards": {}, "disagreements": [
        {"request": 0, "step": 0, "module": "model.layers.1.mlp", "call": 0, "role": "out",
         "slot": "0", "ranks": [0, 1], "rel_l2": 0.5, "basis": "tensor"}]}}
    a = write(tmp_path / "a.h5", t)
    b = write(tmp_path / "b.h5", dict(items), meta=meta)
    d = diff_captures(a, b)
    rec = d.record(f"{k}.rank1")
    assert rec.error == pytest.approx(0.5, rel=1e-6) and rec.cand_key is None
    assert d.record(k).error == 0.0 and d.missing == ()
    [note] = [n for n in d.notes if n.startswith("RANKS DISAGREE")]
    assert note.startswith("RANKS DISAGREE in cand: 1 replicated tensors differ between "
                           "tensor-parallel ranks (first: r0.s0:model.layers.1.mlp#0:out.0, "
                           "rank 1 vs rank 0, rel_l2 0.5)")
    # --include / --step select rank copies like any record
    d = diff_captures(a, b, include=["model.layers.0.*"])
    assert not [r for r in d.records if r.key.module == "model.layers.1.mlp"]
    assert not [m for m in d.missing if "rank1" in m.key]
    assert diff_captures(a, b, include=["model.layers.1.mlp"]).record(f"{k}.rank1").error \
        == pytest.approx(0.5, rel=1e-6)


def test_disagreement_sizes_at_the_edges():
    from accucheck.capture.record.ranks import _rel_l2 as measured

    def _rel_l2(a, b):
        return measured(a, b, a.data, b.data)["rel_l2"]

    z, nz = rec("o", 0, [0.0, 0.0]), rec("o", 1, [-0.0, 0.0])
    assert z.checksum != nz.checksum  # -0.0 and 0.0 differ in their bits ...
    [d] = merge_ranks({0: [z], 1: [nz]}, KINDS, 2).disagreements
    assert d["rel_l2"] == 0.0  # ... not in value
    assert _rel_l2(z, rec("o", 1, [0.0, 1e-30])) == float("inf")  # from zero to anything
    assert _rel_l2(rec("o", 0, [1.0, 2.0]), rec("o", 1, [1.0, np.inf])) == float("inf")
    assert _rel_l2(rec("o", 0, [np.nan, 2.0]), rec("o", 1, [1.0, 2.0])) == float("inf")
    assert _rel_l2(rec("o", 0, [1.0, 2.0]), rec("o", 1, [[1.0, 2.0]])) is None
    assert _rel_l2(rec("o", 0, [3.0, 4.0]), rec("o", 1, [3.0, 4.0])) == 0.0
    # a copy whose norm is below 1 is measured like any other (0.06 / 0.5 from the data,
    # | 0.4 - 0.5 | / 0.5 from the norms), not taken for zero
    small, off = rec("o", 0, [0.3, 0.4]), rec("o", 1, [0.3, 0.46])
    assert _rel_l2(small, off) == pytest.approx(0.06 / 0.5, rel=1e-6)
    assert _rel_l2(rec("o", 0, [0.3, 0.4], data=False), rec("o", 1, [0.0, 0.4], data=False)) \
        == pytest.approx(0.1 / 0.5, rel=1e-6)
    a, b = rec("o", 0, [0.0], data=False), rec("o", 1, [0.0], data=False)
    assert _rel_l2(a, b) == 0.0


def test_spilled_tensors_come_back_record_by_record(tmp_path):
    """The workers' tensors on disk (record.spill): written forward by forward, across a drain
    (the file reopened, nothing lost), read back per record, and a disagreement between ranks
    measured from them, not from the statistics."""
    from accucheck.capture.record.spill import Spill, SpillReader

    recs = {0: [], 1: []}
    for rank, values in ((0, [1.0, 2.0, 3.0, 4.0]), (1, [1.0, 2.0, 3.0, 4.5])):
        spill = Spill(str(tmp_path), rank)
        for order, (module, v) in enumerate((("emb", values[:2]), ("o", values[2:]))):
            r = rec(module, rank, [v], order=order)
            r.spilled, r.data = spill.put(r.data), None
            recs[rank].append(r)
            spill.close()  # a drain between forwards
    reader = SpillReader(str(tmp_path))
    np.testing.assert_array_equal(reader.data(recs[1][1]), np.float32([[3.0, 4.5]]))
    m = merge_ranks(recs, KINDS, 2, reader.data)
    [d] = m.disagreements
    assert (d["module"], d["basis"]) == ("o", "tensor")
    assert d["rel_l2"] == pytest.approx(0.5 / 5.0, rel=1e-6)
    assert m.verified == 1  # emb: equal on both ranks
    # without the tensors (the default load: the records' data, gone to disk) only the norms
    [d] = merge_ranks(recs, KINDS, 2).disagreements
    assert d["basis"] == "l2 norms"
    # a spill file cut short is an error, never a tensor of zeros
    with open(tmp_path / "rank1.bin", "r+b") as f:
        f.truncate(8)
    with pytest.raises(UserError, match="end early"):
        reader.data(recs[1][1])
    (tmp_path / "rank1.bin").unlink()   # gone: one line too, not a traceback
    with pytest.raises(UserError, match="rank 1's tensors on disk cannot be read"):
        reader.data(recs[1][1])


def test_coverage_lists_the_first_ten_missing():
    cov = coverage(_sites([0], 1, 1, ["a"]) + [(0, 0, 0, f"m{i:02d}#0:out.0") for i in range(30)],
                   2, 1)
    assert cov["missing"]["count"] == 31 and len(cov["missing"]["first"]) == 10
    assert cov["missing"]["first"][0] == "rank 0 r1.s0:a#0:out.0"


def test_a_prefill_only_site_missing_in_one_request_is_found():
    # prefill records a mask module that decode steps do not run; request 1 lacks it
    got = [(0, 0, 0, "a#0:out.0"), (0, 0, 0, "mask#0:out.0"), (0, 1, 0, "a#0:out.0")]
    got += [(0, q, s, "a#0:out.0") for q in range(2) for s in (1, 2)]
    cov = coverage(got, 2, 3)
    assert not cov["ok"] and cov["missing"]["first"] == ["rank 0 r1.s0:mask#0:out.0"]


def test_sites_of_is_rank_zero_by_default():
    assert sites_of(["r0.s0:model.a#0:out.0"]) == [(0, 0, 0, "model.a#0:out.0")]


def test_shard_parts_after_a_token_flip_are_not_compared(tmp_path):
    from accucheck.compare.diff import diff_captures
    from tests.test_diff import write

    rng = np.random.default_rng(3)
    one, two = {}, {}
    for s in (0, 1):
        n = 3 if s == 0 else 1
        x = rng.standard_normal((1, n, 8))
        one[f"r0.s{s}:model.embed_tokens#0:out.0"] = two[f"r0.s{s}:model.embed_tokens#0:out.0"] = x
        w = rng.standard_normal((1, n, 8))
        one[f"r0.s{s}:{SITE}#0:out.0"] = w
        for r in (0, 1):
            two[f"r0.s{s}:{SITE}#0:out.0.rank{r}"] = w[..., 4 * r:4 * r + 4] * (1.5 if s else 1)
    meta = {"tensor_parallel": {"size": 2, "shards": {
        f"{SITE}#0:out.0": {"dim": -1, "ranks": [0, 1], "layout": "concat"}}}}
    a = write(tmp_path / "a.h5", one, gen=((4, 5),))
    b = write(tmp_path / "b.h5", two, gen=((7, 5),), meta=meta)  # the first token differs
    d = diff_captures(a, b)
    parts = [r for r in d.records if r.key.module == SITE]
    assert [(r.key.step, r.key.slot) for r in parts] == [(0, "0.rank0"), (0, "0.rank1")]
    assert all(r.error == 0.0 for r in parts)  # step 1 (1.5x) is after the flip: not compared


def _shard_files(tmp_path, parts_of, whole_shape=(1, 3, 8), layouts=("concat",), cand_store=None,
                 extra_ref=None):
    """ref: unsharded tensors at sites s0, s1, ...; cand: their parts as `parts_of(x)` gives
    them (a list per rank), each site annotated with its layout."""
    from tests.test_diff import write

    rng = np.random.default_rng(5)
    one, two, shards = {}, {}, {}
    for i, layout in enumerate(layouts):
        site = f"model.layers.{i}.mlp.down_proj"
        x = rng.standard_normal(whole_shape)
        one[f"r0.s0:{site}#0:in.0"] = x
        for r, p in enumerate(parts_of(x)):
            two[f"r0.s0:{site}#0:in.0.rank{r}"] = p
        shards[f"{site}#0:in.0"] = {"dim": -1, "ranks": [0, 1], "layout": layout}
    common = {"r0.s0:model.embed_tokens#0:out.0": np.ones((1, 3, 8)), **(extra_ref or {})}
    one, two = {**common, **one}, {**common, **two}
    tmp_path.mkdir(parents=True, exist_ok=True)
    a = write(tmp_path / "a.h5", one)
    b = write(tmp_path / "b.h5", two, meta={"tensor_parallel": {"size": 2, "shards": shards}},
              store=cand_store or "full")
    return a, b


def _halves(x):
    return [x[..., :4], x[..., 4:]]


@pytest.mark.parametrize("case", ["narrow", "other_rows", "stats_cand", "scalar"])
def test_parts_that_do_not_fit_are_not_compared(tmp_path, case):
    from accucheck.compare.diff import diff_captures

    parts = {"narrow": lambda x: [x[..., :4], x[..., 4:7]],         # 7 of 8 columns
             "other_rows": lambda x: [x[:, :2, :4], x[:, :2, 4:]],  # another leading shape
             "stats_cand": _halves, "scalar": lambda x: [x[..., :4], x[..., 4:]]}[case]
    shape = (1,) if case == "scalar" else (1, 3, 8)
    if case == "scalar":
        parts = lambda x: [np.float32(1.0), np.float32(2.0)]  # noqa: E731
    a, b = _shard_files(tmp_path, parts, whole_shape=shape,
                        cand_store="stats" if case == "stats_cand" else None)
    d = diff_captures(a, b)
    assert not [r for r in d.records if ".rank" in r.key.slot]
    assert any(n.startswith("2 tensor-parallel shard records") for n in d.notes)


def test_a_site_that_cannot_be_joined_does_not_stop_the_next(tmp_path):
    from accucheck.compare.diff import diff_captures

    a, b = _shard_files(tmp_path, _halves, layouts=("packed", "concat"))
    d = diff_captures(a, b)
    assert [(r.key.module, r.key.slot) for r in d.records if ".rank" in r.key.slot] == [
        ("model.layers.1.mlp.down_proj", "0.rank0"), ("model.layers.1.mlp.down_proj", "0.rank1")]
    assert any(n.startswith("2 tensor-parallel shard records") for n in d.notes)


def test_two_tp2_captures_compare_rank_keys_directly(tmp_path):
    from accucheck.compare.diff import diff_captures
    from tests.test_diff import write

    a, b = _shard_files(tmp_path / "x", _halves)
    with open_capture(b) as r:
        rows = {str(row.key): r.read(row.key) for row in r.rows}
        meta = r.meta
    rows["r0.s0:model.layers.0.mlp.down_proj#0:in.0.rank1"] *= 1.1
    c = write(tmp_path / "c.h5", rows, meta={"tensor_parallel": meta["tensor_parallel"]})
    d = diff_captures(b, c)
    errs = {r.key.slot: r.error for r in d.records}
    assert len(d.records) == 3 and errs["0.rank0"] == 0.0
    assert errs["0.rank1"] == pytest.approx(0.1, rel=1e-5) and d.missing == ()


def test_op_records_never_name_a_rank():
    from accucheck.compare.shards import _base_key
    from accucheck.keys import RecordKey

    assert _base_key(RecordKey.parse("r0.s0:m#0/aten.mm@0:out.0.rank1")) is None
    assert str(_base_key(RecordKey.parse("r1.s2:m#0:out.0.rank1"))) == "r1.s2:m#0:out.0"
    assert _base_key(RecordKey.parse("r1.s2:m#0:out.0")) is None

