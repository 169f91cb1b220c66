"""MoE routing under vLLM / vllm-ascend (eager): where each fused MoE layer routes, tapped there.

Imports torch only; used by accucheck.capture.runners.vllm_plugin (worker side: `RoutingTaps`) and
accucheck.capture.runners.vllm (front end: `routing_gap`).

The records are the transformers runner's (accucheck.capture.record.moe): the router logits as the
gate's slot "0", the top-k weights "1", the expert ids "2". Where the routing happens is not one
place, and a tap on one of them alone records nothing on the others (read upstream):
- vLLM (GPU / CPU): `MoERunner` calls `router.select_experts`, which calls
  `router._select_experts`; the logits come from the gate module (`router_logits, _ =
  self.gate(x)`), but with a shared-expert gate as well (`_fse_fuse_gate`) from one GEMM over
  both gates' weights ([tokens, experts + shared]); a monolithic quant method
  (`routed_experts.forward_monolithic(x, router_logits)`) routes inside its kernel: neither
  select_experts nor the ids are visible, only the logits it is given.
- vllm-ascend main: `AscendRoutedExperts._select_experts` calls `self.router._select_experts`
  directly, and `AscendMoERunner` computes the logits as `F.linear(x.float(), gate.weight)`,
  so the gate module's forward never runs.
- vllm-ascend v0.23: the layer calls the module-level function `select_experts` of
  `vllm_ascend.ops.fused_moe.experts_selector` (imported by name into the layer and quant
  method modules), with no router object.
So every one of them is wrapped, a call inside another wrapped one (select_experts ->
_select_experts) counts once, and when the gate module did not run for a routing call its
logits are taken from the routing call's `router_logits` argument (the first `num_experts`
columns). A layer the routing call cannot be attributed to records nothing; the front end then
refuses the capture (`routing_gap`) rather than pass a MoE capture without its routing.
"""
from __future__ import annotations

import importlib
import sys
from typing import Any, Callable

import torch

ROUTER_METHODS = ("select_experts", "_select_experts")
# vllm-ascend v0.23's module-level routing functions: (module, function)
SELECTOR_FUNCTIONS = (("vllm_ascend.ops.fused_moe.experts_selector", "select_experts"),
                      ("vllm_ascend._310p.fused_moe.experts_selector", "select_experts"))
MOE_CLASSES = ("FusedMoE", "MoERunner")  # vLLM's / vllm-ascend's fused MoE layer classes
MONOLITHIC = ("monolithic MoE kernel (quant method forward_monolithic): it routes inside the "
              "kernel, the top-k weights and expert ids are not observable")
# the layer whose forward is running, innermost last (module-level selector functions)
_current: list[tuple["RoutingTaps", str]] = []


def router_of(mod: torch.nn.Module):
    """The router object of a fused MoE layer (`mod.router`, or its routed experts'), or None."""
    for owner in (mod, getattr(mod, "routed_experts", None)):
        router = getattr(owner, "router", None)
        if router is not None and any(callable(getattr(router, m, None))
                                      for m in ROUTER_METHODS):
            return router
    return None


def is_moe_layer(mod: torch.nn.Module) -> bool:
    """A vLLM / vllm-ascend fused MoE layer: a router, or a class of the FusedMoE / MoERunner
    family (vllm-ascend v0.23's AscendFusedMoE routes through a function and has no router)."""
    return router_of(mod) is not None or any(
        n in c.__name__ for c in type(mod).__mro__ for n in MOE_CLASSES)


def moe_routers(model: torch.nn.Module, selected: set[str]) -> list[tuple[str, str]]:
    """(experts path, gate path) of every fused MoE layer (a module `….experts`, see
    `is_moe_layer`) whose sibling gate (the router logits) is selected."""
    out = []
    for name, mod in model.named_modules():
        if name.rsplit(".", 1)[-1] == "experts" and is_moe_layer(mod):
            gate = name[: -len("experts")] + "gate"
            if gate in selected:
                out.append((name, gate))
    return out


def _arg(args: tuple, kwargs: dict, name: str, index: int):
    return kwargs[name] if name in kwargs else args[index] if len(args) > index else None


class RoutingTaps:
    """The routing of every layer in `routers` recorded into `captured` (the plugin's eager
    list of (module, role, call, slot, tensor)) while `active[0]`, with call indices kept in
    `calls` (the plugin's per-forward counters: `(gate, "out")` counts the gate's calls).
    `skipped` receives why a slot cannot be recorded (a monolithic kernel)."""

    def __init__(self, by_name: dict, routers: list[tuple[str, str]], captured: list,
                 active: list, calls: dict, skipped: dict):
        self.by_name, self.routers = by_name, routers
        self.captured, self.active, self.calls, self.skipped = captured, active, calls, skipped
        self.handles: list[Any] = []
        self._depth: dict[str, int] = {}

    def install(self) -> None:
        for experts, gate in self.routers:
            layer = self.by_name[experts]
            self.handles.append(layer.register_forward_pre_hook(
                lambda *_a, _g=gate: _current.append((self, _g))))
            self.handles.append(layer.register_forward_hook(lambda *_a: _pop(self),
                                                            always_call=True))
            router = router_of(layer)
            for method in ROUTER_METHODS if router is not None else ():
                if callable(getattr(router, method, None)):
                    setattr(router, method, self._wrap(getattr(router, method), gate))
            routed = getattr(layer, "routed_experts", layer)
            if callable(getattr(routed, "forward_monolithic", None)):
                routed.forward_monolithic = self._monolithic(routed.forward_monolithic, gate)
        patch_selector_functions()

    def _wrap(self, fn: Callable, gate: str) -> Callable:
        def routed(*args, **kwargs):
            return self.route(gate, fn, args, kwargs)
        routed.__wrapped__ = fn
        return routed

    def route(self, gate: str, fn: Callable, args: tuple, kwargs: dict):
        """`fn(*args, **kwargs)` (a routing call returning (weights, ids)), recorded unless it
        runs inside another routing call of the same layer."""
        depth = self._depth.get(gate, 0)
        self._depth[gate] = depth + 1
        try:
            weights, ids = fn(*args, **kwargs)
        finally:
            self._depth[gate] = depth
        if depth == 0:
            self.record(gate, _arg(args, kwargs, "router_logits", 1), weights, ids)
        return weights, ids

    def _monolithic(self, fn: Callable, gate: str) -> Callable:
        def forward_monolithic(*args, **kwargs):
            self.skipped[f"{gate}:out.1"] = self.skipped[f"{gate}:out.2"] = MONOLITHIC
            self.record(gate, _arg(args, kwargs, "router_logits", 1), None, None)
            return fn(*args, **kwargs)
        forward_monolithic.__wrapped__ = fn
        return forward_monolithic

    def record(self, gate: str, logits, weights, ids) -> None:
        """One routing call of `gate`'s layer, as the gate's call k (the k-th routing call of
        this forward). The gate module's own record is that call's slot "0" when it ran for
        it; otherwise `logits` is (its first num_experts columns)."""
        if not self.active[0]:
            return
        k = self.calls.get((gate, "routing"), 0)
        self.calls[(gate, "routing")] = k + 1
        if self.calls.get((gate, "out"), 0) <= k:  # the gate module did not run for this call
            self.calls[(gate, "out")] = k + 1
            if isinstance(logits, torch.Tensor):
                n = _experts_of(self.by_name.get(gate))
                cut = logits[..., :n] if n and logits.shape[-1] > n else logits
                self.captured.append((gate, "out", k, "0", cut.detach().clone()))
        for slot, t in (("1", weights), ("2", ids)):
            if isinstance(t, torch.Tensor):
                self.captured.append((gate, "out", k, slot, t.detach().clone()))


def _pop(taps: RoutingTaps) -> None:
    if _current and _current[-1][0] is taps:
        _current.pop()


def _experts_of(gate) -> int | None:
    """How many router logits the gate makes (rows of its weight): a fused shared-expert gate
    appends its own columns after them."""
    w = getattr(gate, "weight", None)
    return int(w.shape[0]) if isinstance(w, torch.Tensor) and w.ndim == 2 else None


def patch_selector_functions() -> None:
    """vllm-ascend v0.23's module-level `select_experts`, replaced wherever it was imported
    by name (every loaded vllm_ascend module), by one that records it for the MoE layer whose
    forward is running (`_current`). Idempotent; nothing when vllm_ascend is not loaded."""
    for mod_name, fn_name in SELECTOR_FUNCTIONS:
        if mod_name.split(".")[0] not in sys.modules:
            continue
        try:
            orig = getattr(importlib.import_module(mod_name), fn_name)
        except (ImportError, AttributeError):
            continue
        orig = getattr(orig, "_accucheck_orig", orig)

        def select(*args, _orig=orig, **kwargs):
            if not _current:
                return _orig(*args, **kwargs)
            taps, gate = _current[-1]
            return taps.route(gate, _orig, args, kwargs)
        select._accucheck_orig = orig
        for name, module in list(sys.modules.items()):
            if name.startswith("vllm_ascend") and getattr(module, fn_name, None) is orig:
                setattr(module, fn_name, select)


def routing_gap(routers: list[str], sites: set[str], skipped: dict) -> str | None:
    """The front end's check of an eager capture of a MoE model: one line when a router of
    `routers` (gate paths the workers found) has no expert-ids record among `sites` (record
    sites "module#call:role.slot") and no worker said why (`skipped`, e.g. a monolithic
    kernel); else None. The coverage verdict cannot see this: it expects only what was
    recorded at least once."""
    recorded = {s.split("#", 1)[0] for s in sites if s.endswith(":out.2")}
    missing = [g for g in routers if g not in recorded and f"{g}:out.2" not in skipped]
    if not missing:
        return None
    return (f"routing FAILED: {len(missing)} of {len(routers)} MoE routers recorded no expert "
            f"ids (first: {missing[0]}): this vLLM / vllm-ascend routes outside the calls "
            f"accucheck taps (router.select_experts / _select_experts, vllm-ascend's "
            f"select_experts, forward_monolithic) and a MoE capture without its routing is "
            f"refused: capture with --exclude '*.mlp.gate' to go without routing records")
