"""MoE routing records on every path vLLM and vllm-ascend route through (issue 34), on the CPU
fakes of tests/vllm_fakes.py driven through the plugin's Collector (no engine): the router's
private `_select_experts` (vllm-ascend main), router logits from F.linear on the gate's weight
(the gate module never runs), the fused shared-expert gate, vllm-ascend v0.23's module-level
select_experts, a monolithic kernel; and the front end refusing a MoE capture with no
routing records (a path nothing taps)."""
from __future__ import annotations

import h5py
import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

import vllm_fakes as fk  # noqa: E402

GATES = ("model.layers.0.mlp.gate", "model.layers.1.mlp.gate")
PROMPTS = fk.PROMPTS


def _run(variant: str) -> tuple[list, dict]:
    """A prefill and a decode step of two requests; the records drained, by key."""
    out, recs = fk.prefill_and_decode(fk.Runner(fk.MoEModel(variant)))
    by_key = {}
    for r in recs:
        key = (r.req, r.step, r.module, r.call, r.slot)
        assert key not in by_key, f"recorded twice: {key}"
        by_key[key] = r
    return out, by_key


@pytest.mark.parametrize("variant", ["vllm", "private", "flinear", "ascend", "fused_gate",
                                     "v023"])
def test_every_routing_path_records_logits_weights_and_ids(variant, monkeypatch):
    """Each router's logits [tokens, experts], top-k weights and expert ids, once per request
    and step as call 0, the ids those of the recorded logits. Before: `private` / `ascend`
    (router._select_experts called directly) recorded no weights or ids, `flinear` / `ascend`
    / `fused_gate` (the gate module never runs) no logits, `v023` (a module-level
    select_experts, no router object) nothing at all."""
    if variant == "v023":
        fk.fake_vllm_ascend_023(monkeypatch)
    out, recs = _run(variant)
    for req, n in enumerate(len(p) for p in PROMPTS):
        for step, tokens in ((0, n), (1, 1)):
            for gate in GATES:
                rows = {s: recs.get((req, step, gate, 0, s)) for s in "012"}
                assert all(rows.values()), (variant, req, step, gate, rows)
                logits = torch.from_numpy(np.array(rows["0"].data))
                assert logits.shape == (1, tokens, fk.EXPERTS)
                w, ids = fk.topk_route(logits[0])
                assert np.array_equal(rows["2"].data[0], ids.numpy())
                assert np.allclose(rows["1"].data[0], w.numpy(), atol=1e-6)
                assert (req, step, gate, 1, "2") not in recs


def test_a_monolithic_kernel_records_the_logits_and_says_why_not_the_ids():
    """forward_monolithic routes inside the kernel: the gate's logits are recorded once, the
    weights / ids slots are named in `skipped` with the reason, and the front end's routing
    check accepts that (it is said, not silent). Before: nothing said why."""
    from accucheck.capture.runners.vllm_moe import routing_gap

    out, recs = _run("monolithic")
    for gate in GATES:
        assert (0, 0, gate, 0, "0") in recs and (0, 0, gate, 0, "2") not in recs
        assert "monolithic" in out["skipped"][f"{gate}:out.2"]
    sites = {f"{k[2]}#{k[3]}:out.{k[4]}" for k in recs}
    assert routing_gap(list(GATES), sites, out["skipped"]) is None


def test_routing_gap_names_a_router_without_ids():
    from accucheck.capture.runners.vllm_moe import routing_gap

    sites = {f"{GATES[0]}#0:out.0", f"{GATES[0]}#0:out.2", f"{GATES[1]}#0:out.0"}
    line = routing_gap(list(GATES), sites, {})
    assert line.startswith("routing FAILED: 1 of 2 MoE routers recorded no expert ids "
                           f"(first: {GATES[1]})") and "\n" not in line
    assert routing_gap(list(GATES), sites, {f"{GATES[1]}:out.2": "graph mode"}) is None
    assert routing_gap([], set(), {}) is None


@pytest.fixture
def fake_engine(monkeypatch):
    return fk.install_engine(monkeypatch)


def test_a_moe_capture_without_routing_records_is_refused(fake_engine, tiny_dir, tmp_path,
                                                          monkeypatch):
    """A MoE model whose routing goes where no tap is: one line, exit 3, the file left
    incomplete, as the coverage verdict does. Before: coverage passed (it expects only what
    was recorded once) and the capture was complete without any routing."""
    from accucheck.capture.options import CaptureOptions
    from accucheck.capture.runners.vllm import capture_vllm
    from accucheck.errors import UserError

    out = tmp_path / "x.h5"
    monkeypatch.setattr(fake_engine, "make_runner",
                        staticmethod(lambda: fk.Runner(fk.MoEModel("untapped"))))
    with pytest.raises(UserError, match="routing FAILED: 2 of 2 MoE routers recorded no "
                                        "expert ids") as e:
        capture_vllm(tiny_dir, PROMPTS, out, CaptureOptions(max_new_tokens=1))
    assert e.value.exit_code == 3 and "\n" not in str(e.value)
    assert "left incomplete" in str(e.value)
    with h5py.File(out, "r") as f:
        assert not f.attrs["complete"]


def test_the_fake_engine_capture_with_routing_completes(fake_engine, tiny_dir, tmp_path):
    """The same capture through vLLM's own path (gate module, select_experts) completes."""
    from accucheck.capture.options import CaptureOptions
    from accucheck.capture.runners.vllm import capture_vllm
    from accucheck.store import open_capture

    out = capture_vllm(tiny_dir, PROMPTS, tmp_path / "x.h5", CaptureOptions(max_new_tokens=1))
    with open_capture(out) as c:
        assert c.complete
        assert f"r1.s1:{GATES[1]}#0:out.2" in c
