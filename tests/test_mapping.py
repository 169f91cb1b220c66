"""vLLM's fused records shown as transformers' (accucheck.compare.mapping) on hand-made captures:
the exact slices of q / k / v and gate / up, tensor-parallel shards cut then joined, renames,
what is left alone; and the weight tables of tensor-parallel ranks joined
(accucheck.capture.record.ranks.merge_weight_tables). The vLLM end to end is tests/test_vllm*.py."""
from __future__ import annotations

import numpy as np

from accucheck.capture.record.ranks import merge_weight_tables
from accucheck.compare.diff import diff_captures
from accucheck.compare.mapping import MappedCapture, maybe_mapped
from accucheck.store import open_capture
from test_verdicts import cap

CONFIG = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 2,
          "hidden_size": 8, "intermediate_size": 6}
Q, KV, FFN = 8, 4, 6
L = "model.layers.0"
RNG = np.random.default_rng(3)


def _vllm(path, recs, tp=1, config=CONFIG):
    return cap(path, recs, meta={"runner": "vllm", "model": {"config": config},
                                 "tensor_parallel": {"size": tp}})


def test_qkv_and_gate_up_are_cut_into_the_transformers_leaves(tmp_path):
    qkv = RNG.standard_normal((1, 3, Q + 2 * KV))
    gu = RNG.standard_normal((1, 3, 2 * FFN))
    path = _vllm(tmp_path / "v.h5", [(f"r0.s0:{L}.self_attn.qkv_proj#0:out.0", qkv, None, None),
                                     (f"r0.s0:{L}.mlp.gate_up_proj#0:out.0", gu, None, None)])
    with open_capture(path) as r:
        m = maybe_mapped(r)
        assert isinstance(m, MappedCapture)
        keys = [str(x.key) for x in m.rows]
        assert keys == [f"r0.s0:{L}.self_attn.{p}_proj#0:out.0" for p in "qkv"] + \
            [f"r0.s0:{L}.mlp.{p}_proj#0:out.0" for p in ("gate", "up")]
        np.testing.assert_array_equal(m.read(keys[0]), qkv[..., :Q].astype(np.float32))
        np.testing.assert_array_equal(m.read(keys[1]), qkv[..., Q:Q + KV].astype(np.float32))
        np.testing.assert_array_equal(m.read(keys[2]), qkv[..., Q + KV:].astype(np.float32))
        np.testing.assert_array_equal(m.read(keys[4]), gu[..., FFN:].astype(np.float32))
        row = m.row(keys[1])
        assert row.shape == (1, 3, KV) and row.has_data
        assert row.stats.numel == 3 * KV
        assert np.isclose(row.stats.l2, np.linalg.norm(qkv[..., Q:Q + KV].astype(np.float32)))
        chunks = np.concatenate(list(m.iter_chunks(keys[2], max_elems=5)))
        np.testing.assert_array_equal(chunks, qkv[..., Q + KV:].astype(np.float32).ravel())


def test_tensor_parallel_packed_shards_are_cut_per_rank_then_joined(tmp_path):
    """Two ranks: each holds q_r | k_r | v_r (half the heads of each); q is q_0 | q_1."""
    full = RNG.standard_normal((1, 3, Q + 2 * KV))
    q, k, v = full[..., :Q], full[..., Q:Q + KV], full[..., Q + KV:]
    shard = [np.concatenate([q[..., r * Q // 2:(r + 1) * Q // 2],
                             k[..., r * KV // 2:(r + 1) * KV // 2],
                             v[..., r * KV // 2:(r + 1) * KV // 2]], axis=-1) for r in (0, 1)]
    base = f"r0.s0:{L}.self_attn.qkv_proj#0:out.0"
    path = _vllm(tmp_path / "v.h5", [(f"{base}.rank{r}", shard[r], None, None) for r in (0, 1)],
                 tp=2)
    with open_capture(path) as r:
        m = MappedCapture(r)
        assert len(m.rows) == 3 and m.unmapped == 0
        for name, want in (("q", q), ("k", k), ("v", v)):
            np.testing.assert_array_equal(m.read(f"r0.s0:{L}.self_attn.{name}_proj#0:out.0"),
                                          want.astype(np.float32))


def test_kv_heads_replicated_across_ranks_are_taken_once(tmp_path):
    """TP 4 with 2 KV heads (vLLM's num_kv_head_replicas = 2): rank r holds q head r and KV
    head r // 2, so ranks 0 and 1 hold the same k / v columns; k is head 0 | head 1, not
    every rank's copy side by side (issue 34)."""
    full = RNG.standard_normal((1, 3, Q + 2 * KV))
    q, k, v = full[..., :Q], full[..., Q:Q + KV], full[..., Q + KV:]
    hd = KV // 2
    shard = [np.concatenate([q[..., r * 2:(r + 1) * 2], k[..., r // 2 * hd:(r // 2 + 1) * hd],
                             v[..., r // 2 * hd:(r // 2 + 1) * hd]], axis=-1) for r in range(4)]
    base = f"r0.s0:{L}.self_attn.qkv_proj#0:out.0"
    path = _vllm(tmp_path / "v.h5", [(f"{base}.rank{r}", shard[r], None, None) for r in range(4)],
                 tp=4)
    with open_capture(path) as r:
        m = MappedCapture(r)
        assert len(m.rows) == 3 and m.unmapped == 0
        for name, want in (("q", q), ("k", k), ("v", v)):
            np.testing.assert_array_equal(m.read(f"r0.s0:{L}.self_attn.{name}_proj#0:out.0"),
                                          want.astype(np.float32))


def test_renames_drops_and_what_is_left_alone(tmp_path):
    attn = RNG.standard_normal((1, 3, Q))
    act = RNG.standard_normal((1, 3, FFN))
    res = RNG.standard_normal((1, 3, 8))
    path = _vllm(tmp_path / "v.h5", [
        (f"r0.s0:{L}.self_attn.attn#0:out.0", attn, None, None),
        (f"r0.s0:{L}.post_attention_layernorm#0:out.0", res * 2, None, None),
        (f"r0.s0:{L}.post_attention_layernorm#0:out.vllm.1", res, None, None),
        (f"r0.s0:{L}.mlp.act_fn#0:in.0", RNG.standard_normal((1, 3, 2 * FFN)), None, None),
        (f"r0.s0:{L}.mlp.act_fn#0:out.0", act, None, None),
        (f"r0.s0:{L}.mlp.down_proj#0:out.0", res, None, None)])
    with open_capture(path) as r:
        keys = [str(x.key) for x in MappedCapture(r).rows]
    assert keys == [f"r0.s0:{L}.self_attn.o_proj#0:in.0",
                    f"r0.s0:{L}.post_attention_layernorm#0:out.0",
                    f"r0.s0:{L}.post_attention_layernorm#0:in.0",
                    f"r0.s0:{L}.mlp.down_proj#0:in.0", f"r0.s0:{L}.mlp.down_proj#0:out.0"]
    # a target the capture already holds (o_proj's input recorded with --inputs: the tensor
    # attn returned) is kept, attn's own record hidden
    path2 = _vllm(tmp_path / "w.h5", [
        (f"r0.s0:{L}.self_attn.attn#0:out.0", attn, None, None),
        (f"r0.s0:{L}.self_attn.o_proj#0:in.0", attn, None, None)])
    with open_capture(path2) as r:
        assert [str(x.key) for x in MappedCapture(r).rows] == [
            f"r0.s0:{L}.self_attn.o_proj#0:in.0"]
    # a transformers capture, and a vLLM one without sizes in its config, are not mapped
    hf = cap(tmp_path / "h.h5", [(f"r0.s0:{L}.self_attn.qkv_proj#0:out.0",
                                  RNG.standard_normal((1, 3, 16)), None, None)])
    with open_capture(hf) as r:
        assert maybe_mapped(r) is r
    bare = _vllm(tmp_path / "b.h5", [(f"r0.s0:{L}.self_attn.qkv_proj#0:out.0",
                                      RNG.standard_normal((1, 3, 16)), None, None)], config={})
    with open_capture(bare) as r:
        assert [x.key.module for x in MappedCapture(r).rows] == [f"{L}.self_attn.qkv_proj"]


def test_a_fault_in_the_k_part_is_named_at_k_proj(tmp_path):
    """transformers' q / k / v against vLLM's fused record whose k columns are off: the
    culprit is k_proj, and the mapping is in the notes and the JSON."""
    from accucheck.verdict.locate import analyze

    x = RNG.standard_normal((1, 3, 8))
    q, k, v = (RNG.standard_normal((1, 3, n)) for n in (Q, KV, KV))
    src = {"0": f"{L}.input_layernorm#0:out.0"}
    hf = cap(tmp_path / "h.h5", [(f"r0.s0:{L}.input_layernorm#0:out.0", x, None, None)] +
             [(f"r0.s0:{L}.self_attn.{n}_proj#0:out.0", t, {"src": src}, None)
              for n, t in (("q", q), ("k", k), ("v", v))])
    vl = _vllm(tmp_path / "v.h5", [
        (f"r0.s0:{L}.input_layernorm#0:out.0", x, None, None),
        (f"r0.s0:{L}.self_attn.qkv_proj#0:out.0",
         np.concatenate([q, k * 1.01, v], axis=-1), None, None)])
    a = analyze(hf, vl)
    assert a.culprit.module == f"{L}.self_attn.k_proj"
    d = diff_captures(hf, vl)
    assert d.mapping["sides"] == {"cand": {"mapped": 1, "statistics_only": 0}}
    assert any(n.startswith("vLLM's fused records shown as transformers' (cand)")
               for n in d.notes)


def test_rank_weight_tables_join():
    """Checksums are bit-pattern sums: the ranks' parts of a column- / row-split weight add
    up to the whole; shapes join; a replicated weight comes from rank 0; vocab-parallel ones
    (padded rows) are left out under TP."""
    def e(shape, c, par, **kw):
        return {"dtype": "float32", "shape": shape, "checksum": c, "parallel": par,
                "cast": {"bfloat16": c + 1}, **kw}
    r0 = {"a.q_proj.weight": e([4, 8], 2 ** 52 - 1, "column", source="qkv_proj rows 0-3"),
          "a.o_proj.weight": e([8, 4], 5, "row"), "a.o_proj.bias": e([8], 7, "row"),
          "a.norm.weight": e([8], 9, "replicated"), "embed.weight": e([16, 8], 1, "vocab")}
    r1 = {k: dict(v, checksum=v["checksum"] + 10, cast={"bfloat16": 3}) for k, v in r0.items()}
    out = merge_weight_tables({0: r0, 1: r1}, 2)
    assert out["a.q_proj.weight"]["shape"] == [8, 8]
    assert out["a.q_proj.weight"]["checksum"] == (2 ** 52 - 1 + 2 ** 52 + 9) % 2 ** 52
    assert out["a.q_proj.weight"]["cast"] == {"bfloat16": (2 ** 52 + 3) % 2 ** 52}
    assert out["a.q_proj.weight"]["source"] == "qkv_proj rows 0-3 of each of 2 ranks"
    assert out["a.o_proj.weight"]["shape"] == [8, 8] and out["a.o_proj.weight"]["checksum"] == 20
    assert out["a.o_proj.bias"]["checksum"] == 7 and out["a.norm.weight"]["checksum"] == 9
    assert "embed.weight" not in out and "parallel" not in out["a.norm.weight"]
    assert merge_weight_tables({0: r0, 1: None}, 2) == {}  # a rank without its table
    one = merge_weight_tables({0: r0}, 1)
    assert one["embed.weight"]["shape"] == [16, 8] and "parallel" not in one["embed.weight"]


def test_rank_weight_tables_count_a_replicated_kv_head_once():
    """TP 4, 2 KV heads: ranks 0 / 1 hold head 0's k rows, ranks 2 / 3 head 1's. The join
    adds heads 0 and 1 once each (shape and checksums of the unsharded k_proj); a rank whose
    copy differs from its twin's is named, and the diff's weight note says so (issue 34)."""
    from accucheck.compare.weights import weight_notes

    def e(c, **kw):
        return {"dtype": "float32", "shape": [2, 8], "checksum": c, "parallel": "column",
                "cast": {"bfloat16": c + 1}, "source": "qkv_proj rows 2-3", **kw}
    tables = {r: {"a.k_proj.weight": e(10 + r // 2 * 5, replicas=2),
                  "a.q_proj.weight": e(100 + r)} for r in range(4)}
    out = merge_weight_tables(tables, 4)
    k = out["a.k_proj.weight"]
    assert k["shape"] == [4, 8] and k["checksum"] == 10 + 15
    assert k["cast"] == {"bfloat16": 11 + 16} and "replicas" not in k
    assert k["source"] == "qkv_proj rows 2-3 of ranks 0, 2 (each KV head held by 2 ranks)"
    assert out["a.q_proj.weight"]["shape"] == [8, 8]
    assert out["a.q_proj.weight"]["checksum"] == 100 + 101 + 102 + 103
    whole = {"a.k_proj.weight": {"dtype": "float32", "shape": [4, 8], "checksum": 25}}
    assert weight_notes({"weights": whole}, {"weights": out}) == []
    tables[3]["a.k_proj.weight"] = e(99, replicas=2)
    bad = merge_weight_tables(tables, 4)["a.k_proj.weight"]
    assert bad["replicas_differ"] == [[2, 3]]
    [note] = weight_notes({"weights": whole}, {"weights": {"a.k_proj.weight": bad}})
    assert "cand's tensor-parallel ranks 2 and 3 hold different copies" in note


def test_the_arguments_of_a_fused_add_norm_are_vllms_own(tmp_path):
    """With --inputs, vLLM's fused add + norm records its arguments (x, residual) as in.0 /
    in.1: shown as in.vllm.0 / in.vllm.1, so that in.0 is the residual sum, as in
    transformers and in a vLLM capture without --inputs."""
    x, res = RNG.standard_normal((1, 3, 8)), RNG.standard_normal((1, 3, 8))
    n = f"r0.s0:{L}.post_attention_layernorm#0"
    path = _vllm(tmp_path / "v.h5", [(f"{n}:in.0", x, None, None), (f"{n}:in.1", res, None, None),
                                     (f"{n}:out.0", x * 0.5, None, None),
                                     (f"{n}:out.vllm.1", x + res, None, None)])
    with open_capture(path) as r:
        m = MappedCapture(r)
        assert [str(k.key) for k in m.rows] == [f"{n}:in.vllm.0", f"{n}:in.vllm.1", f"{n}:out.0",
                                                f"{n}:in.0"]
        np.testing.assert_array_equal(m.read(f"{n}:in.vllm.1"), res.astype(np.float32))
        np.testing.assert_array_equal(m.read(f"{n}:in.0"), (x + res).astype(np.float32))
