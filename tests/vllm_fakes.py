"""Small CPU fakes of vLLM / vllm-ascend pieces for the worker plugin and the front end (not a
test module): a fused MoE layer in each of the ways upstream routes, a model runner that the
plugin's Collector attaches to, and an `LLM` whose workers are that runner in this process.

Routing variants of `MoERunner` (what upstream does, see accucheck.capture.runners.vllm_moe):
    vllm           the gate module runs, then router.select_experts -> router._select_experts
    private        the gate module runs, then router._select_experts is called directly
    flinear        F.linear(x, gate.weight) (the gate's forward never runs), router.select_experts
    ascend         vllm-ascend main: F.linear in float32, routed_experts._select_experts calling
                   router._select_experts
    fused_gate     vLLM's _fse_fuse_gate: one GEMM over the gate and the shared-expert gate
    monolithic     the gate runs, routed_experts.forward_monolithic routes inside the "kernel"
    untapped       the routing goes through a function no tap knows
and `AscendFusedMoE` (vllm-ascend v0.23): the block calls the gate, the layer calls the
module-level `select_experts` of a fake vllm_ascend.ops.fused_moe.experts_selector.
"""
from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

HIDDEN, EXPERTS, TOP_K, VOCAB = 8, 4, 2, 1024


def topk_route(router_logits: torch.Tensor, k: int = TOP_K):
    """softmax then top-k over the first EXPERTS columns: (weights, ids)."""
    w, ids = torch.softmax(router_logits[..., :EXPERTS].float(), -1).topk(k, dim=-1)
    return w / w.sum(-1, keepdim=True), ids.to(torch.int32)


class GateLinear(nn.Module):
    """vLLM's router gate: returns (logits, bias)."""

    def __init__(self, g: torch.Generator):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(EXPERTS, HIDDEN, generator=g), requires_grad=False)

    def forward(self, x):
        return F.linear(x, self.weight), None


class Router:
    """vLLM's FusedMoERouter: select_experts calls _select_experts."""

    def _select_experts(self, hidden_states, router_logits, topk_indices_dtype=None, *,
                        input_ids=None):
        return topk_route(router_logits)

    def select_experts(self, hidden_states, router_logits, topk_indices_dtype=None, *,
                       input_ids=None):
        return self._select_experts(hidden_states, router_logits, topk_indices_dtype,
                                    input_ids=input_ids)


def untapped_route(hidden_states, router_logits):
    return topk_route(router_logits)


class RoutedExperts(nn.Module):
    def __init__(self, g: torch.Generator, router: Router):
        super().__init__()
        self.w = nn.Parameter(torch.randn(EXPERTS, HIDDEN, HIDDEN, generator=g) / 3,
                              requires_grad=False)
        self.router = router

    def apply(self, x, weights, ids):
        out = torch.zeros_like(x)
        for j in range(ids.shape[-1]):
            out += weights[:, j:j + 1].to(x.dtype) * torch.einsum(
                "th,tih->ti", x, self.w[ids[:, j].long()])
        return out

    def _select_experts(self, hidden_states, router_logits, enable_force_load_balance,
                        input_ids=None):
        """vllm-ascend main's AscendRoutedExperts._select_experts."""
        return self.router._select_experts(hidden_states=hidden_states,
                                           router_logits=router_logits, input_ids=input_ids)

    def forward_monolithic(self, x, router_logits, input_ids=None):
        w, ids = topk_route(router_logits)  # inside the kernel: nothing visible
        return self.apply(x, w, ids)


class MoERunner(nn.Module):
    """vLLM's MoERunner as `….mlp.experts` (holds the gate, the router, the routed experts)."""

    def __init__(self, gate: GateLinear, g: torch.Generator, variant: str):
        super().__init__()
        self.router = Router()
        self.gate = gate
        self.routed_experts = RoutedExperts(g, self.router)
        self.shared_expert_gate = nn.Parameter(torch.randn(1, HIDDEN, generator=g),
                                               requires_grad=False)
        self.variant = variant

    def forward(self, hidden_states, router_logits=None):
        x, v = hidden_states, self.variant
        if v == "monolithic":
            logits, _ = self.gate(x)
            return self.routed_experts.forward_monolithic(x=x, router_logits=logits)
        if v in ("vllm", "private", "untapped"):
            logits, _ = self.gate(x)
        elif v == "fused_gate":
            logits = F.linear(x, torch.cat([self.gate.weight, self.shared_expert_gate]))
        else:  # flinear, ascend: the gate's forward never runs
            logits = F.linear(x.float(), self.gate.weight.float())
        if v in ("vllm", "flinear", "fused_gate"):
            w, ids = self.router.select_experts(hidden_states=x, router_logits=logits)
        elif v == "private":
            w, ids = self.router._select_experts(x, logits)
        elif v == "ascend":
            w, ids = self.routed_experts._select_experts(hidden_states=x, router_logits=logits,
                                                         enable_force_load_balance=False)
        else:
            w, ids = untapped_route(x, logits)
        return self.routed_experts.apply(x, w, ids)


SELECTOR = "vllm_ascend.ops.fused_moe.experts_selector"
LAYER_MODULE = "vllm_ascend.ops.fused_moe.fused_moe"


def fake_vllm_ascend_023(monkeypatch) -> None:
    """sys.modules holds a vllm_ascend whose experts_selector defines `select_experts` and
    whose fused_moe module imported it by name (v0.23.0)."""
    def select_experts(hidden_states, router_logits, top_k, use_grouped_topk, renormalize,
                       **_kw):
        return topk_route(router_logits, top_k)

    for name in ("vllm_ascend", "vllm_ascend.ops", "vllm_ascend.ops.fused_moe"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sel = types.ModuleType(SELECTOR)
    sel.select_experts = select_experts
    layer_mod = types.ModuleType(LAYER_MODULE)
    layer_mod.select_experts = select_experts
    monkeypatch.setitem(sys.modules, SELECTOR, sel)
    monkeypatch.setitem(sys.modules, LAYER_MODULE, layer_mod)


class AscendFusedMoE(nn.Module):
    """vllm-ascend v0.23's layer: no router, the module-level select_experts."""

    def __init__(self, g: torch.Generator):
        super().__init__()
        self.routed = RoutedExperts(g, Router())

    def forward(self, hidden_states, router_logits):
        w, ids = sys.modules[LAYER_MODULE].select_experts(
            hidden_states=hidden_states, router_logits=router_logits, top_k=TOP_K,
            use_grouped_topk=False, renormalize=True)
        return self.routed.apply(hidden_states, w, ids)


class MoEBlock(nn.Module):
    def __init__(self, g: torch.Generator, variant: str):
        super().__init__()
        self.gate = GateLinear(g)
        self.variant = variant
        self.experts = AscendFusedMoE(g) if variant == "v023" else \
            MoERunner(self.gate, g, variant)

    def forward(self, x):
        if self.variant == "v023":
            logits, _ = self.gate(x)
            return self.experts(x, logits)
        return self.experts(hidden_states=x, router_logits=x)


class Layer(nn.Module):
    def __init__(self, g, variant):
        super().__init__()
        self.mlp = MoEBlock(g, variant)

    def forward(self, x):
        return x + self.mlp(x)


class Inner(nn.Module):
    def __init__(self, variant: str, layers: int = 2):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
        with torch.no_grad():
            self.embed_tokens.weight.copy_(torch.randn(VOCAB, HIDDEN, generator=g))
        self.layers = nn.ModuleList([Layer(g, variant) for _ in range(layers)])

    def forward(self, ids):
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        return x


class MoEModel(nn.Module):
    def __init__(self, variant: str):
        super().__init__()
        self.model = Inner(variant)

    def forward(self, input_ids, positions=None, **_kw):
        return self.model(input_ids)


class Sampler:
    def __init__(self, logprobs_mode: str):
        self.logprobs_mode = logprobs_mode


class AscendSampler(Sampler):
    """vllm-ascend's: built without the engine's logprobs_mode."""


def vllm_config(**compilation):
    parallel = SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1,
                               data_parallel_size=1, prefill_context_parallel_size=1,
                               decode_context_parallel_size=1)
    return SimpleNamespace(parallel_config=parallel,
                           compilation_config=SimpleNamespace(**compilation),
                           model_config=SimpleNamespace(logprobs_mode="raw_logits"))


class Runner:
    """What the plugin's Collector reads of a vLLM model runner."""

    def __init__(self, model: nn.Module, sampler=None, config=None):
        self.model = model
        self.max_num_tokens = 64
        self.device = torch.device("cpu")
        self.sampler = sampler if sampler is not None else Sampler("raw_logits")
        self.vllm_config = config if config is not None else vllm_config(
            mode="NONE", cudagraph_mode="NONE")
        self.input_batch = SimpleNamespace(req_ids=[])
        self.requests: dict = {}

    def execute_model(self, scheduler_output):
        with torch.inference_mode():
            return self.model(scheduler_output.input_ids)

    def _dummy_run(self, num_tokens: int) -> None:
        """vLLM's profiling forward (graph mode's discovery forward falls back to it)."""
        self.model(torch.zeros(num_tokens, dtype=torch.long))


def step(runner: Runner, reqs: list[tuple[str, int, list[int]]], new: dict[str, list[int]]):
    """One engine step: `reqs` (request id, capture index, prompt) all scheduled, each with
    the tokens of `new` (its prompt at the prefill, one token at a decode step)."""
    for rid, index, prompt in reqs:
        if rid not in runner.requests:
            runner.requests[rid] = SimpleNamespace(
                prompt_token_ids=prompt,
                sampling_params=SimpleNamespace(extra_args={"accucheck_req": index}))
    runner.input_batch.req_ids = [rid for rid, _i, _p in reqs]
    ids = [t for rid, _i, _p in reqs for t in new[rid]]
    so = SimpleNamespace(total_num_scheduled_tokens=len(ids),
                         num_scheduled_tokens={rid: len(new[rid]) for rid, _i, _p in reqs},
                         input_ids=torch.tensor(ids, dtype=torch.long))
    return runner.execute_model(so)


def attach(runner: Runner, **cfg):
    """The plugin's Collector on `runner`, as `load_model` attaches it."""
    from accucheck.capture.runners import vllm_plugin as plugin

    runner._accucheck = plugin.Collector(runner, plugin.PluginConfig(**cfg))
    return runner._accucheck



PROMPTS = [[5, 6, 7], [8, 9, 10, 11]]


def prefill_and_decode(runner: Runner, **cfg) -> tuple[dict, list]:
    """PROMPTS' prefill and one decode step through the plugin's Collector attached to
    `runner` with `cfg` (full store): (what it drained, its records), no error."""
    from accucheck.capture.runners import vllm_plugin as plugin

    col = attach(runner, **{"full": True, **cfg})
    reqs = [(f"r{i}", i, p) for i, p in enumerate(PROMPTS)]
    step(runner, reqs, {rid: p for rid, _i, p in reqs})
    step(runner, reqs, {"r0": [3], "r1": [4]})
    out = col.drain()
    assert out["errors"] == []
    return out, [plugin.Record.from_wire(w) for w in out["records"]]

def _flat(rows: list[np.ndarray | None]):
    ids, vals, starts, ends, n = [], [], [], [], 0
    for row in rows:
        starts.append(n)
        if row is not None:
            ids += list(range(row.shape[0]))
            vals += row.tolist()
            n += row.shape[0]
        ends.append(n)
    return SimpleNamespace(token_ids=ids, logprobs=vals, start_indices=starts,
                           end_indices=ends)


def _flat_topk(rows: list[np.ndarray | None], follow: list[int], k: int):
    """vLLM's logprobs=k layout: per position the following token's log-probability, then the
    k largest (v1 Sampler.gather_logprobs), as FlatLogprobs."""
    ids, vals, starts, ends, n = [], [], [], [], 0
    for row, f in zip(rows, follow):
        starts.append(n)
        if row is not None:
            x = row.astype(np.float64)
            lp = x - (x.max() + np.log(np.exp(x - x.max()).sum()))
            sel = [int(f)] + [int(t) for t in np.argsort(-lp, kind="stable")[:k]]
            ids += sel
            vals += [float(lp[t]) for t in sel]
            n += len(sel)
        ends.append(n)
    return SimpleNamespace(token_ids=ids, logprobs=vals, start_indices=starts,
                           end_indices=ends)


class FakeLLM:
    """`vllm.LLM` with one in-process worker: the runner made by `make_runner()` with the
    plugin attached (when the capture's environment asks), raw logits drawn at random."""
    make_runner = staticmethod(lambda: Runner(MoEModel("vllm")))
    started: list = []
    in_worker = False  # True while a worker method runs (the fake device APIs check it)

    def __init__(self, **kwargs):
        from accucheck.capture.runners import vllm_plugin as plugin

        self.kwargs = kwargs
        self.runner = FakeLLM.make_runner()
        if type(self.runner.sampler) is Sampler:  # vLLM's own follows the engine's mode
            self.runner.sampler.logprobs_mode = kwargs.get("logprobs_mode", "raw_logits")
        cfg = plugin.PluginConfig.from_env()
        if cfg is not None:
            self.runner._accucheck = plugin.Collector(self.runner, cfg)
        self.worker = SimpleNamespace(model_runner=self.runner)
        self.llm_engine = SimpleNamespace(engine_core=None)
        self.generated = False
        FakeLLM.started.append(self)

    def collective_rpc(self, name: str):
        from accucheck.capture.runners import vllm_plugin as plugin

        assert name == "accucheck_collect"
        FakeLLM.in_worker = True
        try:
            return [plugin.collect(self.worker)]
        finally:
            FakeLLM.in_worker = False

    def generate(self, prompts, params, use_tqdm=False):
        self.generated = True
        rng = np.random.default_rng(0)
        reqs = [(f"r{i}", i, list(p["prompt_token_ids"])) for i, p in enumerate(prompts)]
        n_out = params[0].max_tokens
        tokens: dict[str, list[int]] = {rid: [] for rid, _i, _p in reqs}
        sampled = {rid: [] for rid, _i, _p in reqs}
        prompt_rows = {rid: [None] + [rng.normal(0, 3, VOCAB).astype(np.float32)
                                      for _ in p[1:]] for rid, _i, p in reqs}
        new = {rid: p for rid, _i, p in reqs}
        for _k in range(n_out):
            step(self.runner, reqs, new)
            for rid, _i, _p in reqs:
                row = rng.normal(0, 3, VOCAB).astype(np.float32)
                sampled[rid].append(row)
                tokens[rid].append(int(row.argmax()))
            new = {rid: [tokens[rid][-1]] for rid, _i, _p in reqs}
        k = params[0].logprobs
        if k is not None and k > 0:   # capture --logits topk:K
            return [SimpleNamespace(
                prompt_token_ids=p, prompt_logprobs=_flat_topk(prompt_rows[rid], p, k),
                outputs=[SimpleNamespace(token_ids=tokens[rid], logprobs=_flat_topk(
                    sampled[rid], tokens[rid], k))]) for rid, _i, p in reqs]
        return [SimpleNamespace(prompt_token_ids=p, prompt_logprobs=_flat(prompt_rows[rid]),
                                outputs=[SimpleNamespace(token_ids=tokens[rid],
                                                         logprobs=_flat(sampled[rid]))])
                for rid, _i, p in reqs]


def install_engine(monkeypatch) -> type[FakeLLM]:
    """vllm.LLM replaced by FakeLLM for the test (vllm_runner's engine shutdown a no-op)."""
    import vllm

    from accucheck.capture.runners import vllm as vllm_runner

    monkeypatch.setattr(vllm, "LLM", FakeLLM)
    monkeypatch.setattr(vllm_runner, "shutdown", lambda llm: None)
    monkeypatch.setattr(FakeLLM, "started", [])
    return FakeLLM
