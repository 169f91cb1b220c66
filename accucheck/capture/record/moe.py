"""Mixture of experts at capture time: where the routers are, and routing replay
(`--routing-from REF.h5`). Imports torch, accucheck.store and accucheck.errors.

**Routers.** A transformers 5 MoE block (Mixtral, Qwen2-MoE / Qwen3-MoE, DeepSeek-V2 / V3 and
their kin) holds a router `gate` (`top_k`, `num_experts`) and a fused `experts` module with
3-D weights; `gate(hidden)` returns (router logits [tokens, experts], top-k weights [tokens,
k], top-k expert ids [tokens, k]) and `experts(hidden, ids, weights)` computes every expert on
the tokens routed to it. The capture records the gate's three outputs as `…mlp.gate#c:out.0 /
out.1 / out.2` and keeps their values also in --store stats (routing records: small, and the
diff needs them whole: accucheck.compare.routing); meta "moe" lists the routers found.

**Routing replay.** With `RoutingReplay`, every router call returns the reference's expert ids
for its (request, step, router, call) (teacher forcing for experts), so the candidate's
experts run on the tokens the reference's ran on and every record downstream stays
comparable. The top-k inside the router is forced too (a torch function mode active during the
router's forward answers the top-k over the experts with the reference's ids and the
candidate's own scores at them), so the weights are the candidate's own for the reference's
experts, normalised as the model does; with `weights=True` the reference's weights are used
as well. Eager only. Meta "routing_forced" says what was forced.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import asdict, dataclass
from typing import Iterator

import numpy as np
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from accucheck.errors import UserError
from accucheck.store import open_capture


@dataclass(frozen=True)
class Router:
    """One MoE block's router: module paths and sizes."""
    gate: str                 # "model.layers.3.mlp.gate"
    block: str                # "model.layers.3.mlp"
    experts: str | None       # "model.layers.3.mlp.experts" (None: no fused experts module)
    num_experts: int
    top_k: int


def find_routers(model: nn.Module) -> list[Router]:
    """Every MoE block's router, in `named_modules` order: a module with a child `gate` that
    has integer `top_k` and `num_experts` (transformers 5's TopKRouter classes)."""
    out = []
    for name, mod in model.named_modules():
        gate = getattr(mod, "gate", None)
        if not isinstance(gate, nn.Module):
            continue
        k, n = getattr(gate, "top_k", None), getattr(gate, "num_experts", None)
        if not (isinstance(k, int) and isinstance(n, int) and 0 < k < n):
            continue
        experts = getattr(mod, "experts", None)
        prefix = f"{name}." if name else ""
        out.append(Router(f"{prefix}gate", name, f"{prefix}experts"
                          if isinstance(experts, nn.Module) else None, n, k))
    return out


def moe_meta(routers: list[Router]) -> dict | None:
    """Meta "moe": the routers and what their output slots hold; None for a dense model."""
    if not routers:
        return None
    return {"routers": {r.gate: asdict(r) for r in routers},
            "slots": {"logits": "0", "weights": "1", "ids": "2"}}


class _ForcedTopk(TorchFunctionMode):
    """During one router forward: `topk` over the experts (last dimension == num_experts, k ==
    top_k) returns the reference's ids and the input's values at them."""

    def __init__(self, ids: torch.Tensor, num_experts: int, top_k: int):
        super().__init__()
        self.ids, self.n, self.k = ids, num_experts, top_k
        self.used = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.topk, torch.Tensor.topk) and args:
            x = args[0]
            k = args[1] if len(args) > 1 else kwargs.get("k")
            dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
            if isinstance(x, torch.Tensor) and x.ndim >= 1 and x.shape[-1] == self.n \
                    and k == self.k and dim in (-1, x.ndim - 1) \
                    and x.reshape(-1, self.n).shape[0] == self.ids.shape[0]:
                self.used += 1
                ids = self.ids.to(x.device).reshape(*x.shape[:-1], self.k)
                return torch.return_types.topk((x.gather(-1, ids), ids))
        return func(*args, **kwargs)


class RoutingReplay:
    """The reference's routing in every router call (see the module docstring). Open it before
    the capture's output exists (`RoutingReplay(path, routers, weights)` checks the reference),
    wrap the model with `installed(model)` inside which `begin_step(req, step)` starts each
    forward; `close()` at the end. `counts` says how many router calls were forced."""

    def __init__(self, path: str, routers: list[Router], weights: bool = False):
        if not routers:
            raise UserError(f"--routing-from {path}: this model has no MoE router (a module with "
                            f"a `gate` that has top_k and num_experts): nothing to replay")
        self.path, self.routers, self.weights = path, routers, weights
        self.src = open_capture(path)
        try:
            self._check()
        except BaseException:
            self.src.close()
            raise
        self._req = self._step = 0
        self._calls: dict[str, int] = {}
        self.counts = {"calls": 0, "topk_forced": 0}

    def _check(self) -> None:
        slots = ("2", "1") if self.weights else ("2",)
        for r in self.routers:
            for slot in slots:
                key = f"r0.s0:{r.gate}#0:out.{slot}"
                if key not in self.src:
                    raise UserError(f"--routing-from {self.path} has no routing record {key}: "
                                    f"capture the reference of this model with accucheck "
                                    f"(eager), which records every router's ids and weights")
                if not self.src.row(key).has_data:
                    raise UserError(f"--routing-from {self.path}: {key} has statistics only; "
                                    f"re-capture the reference with this accucheck version "
                                    f"(routing records keep their values)")

    def meta(self) -> dict:
        return {"from": str(self.path), "weights": self.weights, **self.counts}

    def begin_step(self, req: int, step: int) -> None:
        self._req, self._step = req, step
        self._calls.clear()

    def _ref(self, gate: str, call: int, slot: str) -> np.ndarray:
        key = f"r{self._req}.s{self._step}:{gate}#{call}:out.{slot}"
        if key not in self.src:
            raise UserError(f"--routing-from {self.path} has no record {key}: the reference ran "
                            f"other prompts, steps or router calls; capture the candidate with "
                            f"the reference's prompts and --max-new-tokens")
        return self.src.read(key)

    def _forward(self, r: Router, forward):
        @functools.wraps(forward)
        def replayed(*args, **kwargs):
            call = self._calls.get(r.gate, 0)
            self._calls[r.gate] = call + 1
            ids = torch.from_numpy(np.ascontiguousarray(self._ref(r.gate, call, "2")))
            mode = _ForcedTopk(ids.reshape(-1, r.top_k), r.num_experts, r.top_k)
            with mode:
                out = forward(*args, **kwargs)
            if not (isinstance(out, tuple) and len(out) == 3):
                raise UserError(f"--routing-from: router {r.gate} returned "
                                f"{type(out).__name__}, not (logits, weights, ids): this router "
                                f"cannot be replayed")
            logits, w, got = out
            if tuple(got.shape) != tuple(ids.shape):
                raise UserError(f"--routing-from: router {r.gate} routes {tuple(got.shape)} "
                                f"(tokens, k) at request {self._req} step {self._step}, the "
                                f"reference {tuple(ids.shape)}: capture with the reference's "
                                f"prompts and --tokens-from")
            self.counts["calls"] += 1
            self.counts["topk_forced"] += mode.used > 0
            if self.weights:
                ref_w = torch.from_numpy(np.ascontiguousarray(self._ref(r.gate, call, "1")))
                w = ref_w.to(device=w.device, dtype=w.dtype).reshape(w.shape)
            return logits, w, ids.to(device=got.device, dtype=got.dtype)
        return replayed

    @contextlib.contextmanager
    def installed(self, model: nn.Module) -> Iterator["RoutingReplay"]:
        """Every router's forward replaced by the replaying one; put back exactly on exit."""
        by_name = dict(model.named_modules())
        saved = []
        try:
            for r in self.routers:
                mod = by_name[r.gate]
                had = "forward" in mod.__dict__
                saved.append((mod, had, mod.__dict__.get("forward")))
                mod.forward = self._forward(r, mod.forward)
            yield self
        finally:
            for mod, had, fwd in reversed(saved):
                if had:
                    mod.forward = fwd
                else:
                    del mod.forward

    def close(self) -> None:
        self.src.close()
