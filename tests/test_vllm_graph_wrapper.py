"""The vLLM plugin under a graph wrapper (issue 34, item 9): in graph mode vLLM's GPUModelRunner
holds its model inside a CUDAGraphWrapper / UBatchWrapper (vllm-ascend's NPUModelRunner inside
an ACLGraphWrapper), which is no nn.Module; `runner.get_model()` unwraps it. The Collector
walks the module tree of what get_model returns (runner.model where there is no get_model).
On the CPU fakes of tests/vllm_fakes.py driven through the Collector (no engine)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

import vllm_fakes as fk  # noqa: E402
from accucheck.capture.runners.vllm_facts import model_of  # noqa: E402

LAYER = "model.layers.0"


class CUDAGraphWrapper:
    """vLLM's wrapper (vllm/compilation/cuda_graph.py): no nn.Module, no named_modules; calls
    through to the runnable it holds, which `unwrap()` returns."""

    def __init__(self, runnable: torch.nn.Module):
        self.runnable = runnable

    def __call__(self, *args, **kwargs):
        return self.runnable(*args, **kwargs)

    def unwrap(self) -> torch.nn.Module:
        return self.runnable


class GraphRunner(fk.Runner):
    """A model runner in graph mode: `.model` is the wrapper, `get_model()` the module
    (GPUModelRunner.get_model in vLLM 0.32)."""

    def __init__(self, model: torch.nn.Module, **kwargs):
        super().__init__(model, **kwargs)
        self.model = CUDAGraphWrapper(model)

    def get_model(self) -> torch.nn.Module:
        return self.model.unwrap() if isinstance(self.model, CUDAGraphWrapper) else self.model


def _capture(runner, **cfg) -> tuple[dict, set]:
    out, recs = fk.prefill_and_decode(runner, **cfg)
    return out, {(r.req, r.step, r.module, r.role) for r in recs}


@pytest.mark.parametrize("graph", [False, True], ids=["eager hooks", "graph buffers"])
def test_the_collector_finds_the_model_under_a_graph_wrapper(graph):
    """Every request and step records the layer, and meta's vLLM class is the model's, not
    the wrapper's. Before: the Collector read runner.model, the wrapper, and failed on its
    first named_modules() (AttributeError), so the capture recorded nothing."""
    runner = GraphRunner(fk.MoEModel("vllm"))
    out, keys = _capture(runner, graph=graph)
    assert out["model_class"] == "MoEModel"
    assert LAYER in out["modules"]
    assert all((req, step, LAYER, "out") in keys for req in (0, 1) for step in (0, 1)), keys
    if graph:
        assert any(b.startswith(f"{LAYER}:out.") for b in out["buffers"])


def test_model_of_prefers_get_model_and_falls_back_to_model():
    module = fk.MoEModel("vllm")
    assert model_of(GraphRunner(module)) is module
    assert model_of(SimpleNamespace(model=module)) is module  # a runner without get_model
    cpu_like = SimpleNamespace(model=module, get_model=lambda: module)  # CPUModelRunner's
    assert model_of(cpu_like) is module
