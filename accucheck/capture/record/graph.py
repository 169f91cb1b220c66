"""Graph mode (--mode graph): which tensors to tap, and the observer check that measures what
the taps change. Imports torch and accucheck.capture.record.recorder.

**Taps at kernel boundaries.** A tap (a hook that keeps a copy of a tensor) makes that tensor an
output of the compiled graph. Where the backend would have kept it inside a fused kernel
(inductor's generated CPU and Triton kernels hold the intermediates of a fused region in
float32 and round once, at the end), the extra output forces it into memory in the model's
dtype, and the kernels downstream read the rounded copy: the capture changes what it
measures. Measured on the built-in tiny Llama in bfloat16 with inductor (48-token prompt,
`python bench/bench_observer.py`): taps on every default module move the compiled model's
logits by rel L2 1.8e-2, 85 % of the eager-vs-graph difference (2.1e-2); a tap on the
embedding alone by 8.8e-3, on the decoder-layer outputs by 1.05e-2; taps on the inputs and
outputs of the Linear layers leave them bitwise unchanged. A matmul is a library call (an
extern kernel) whose operands are in memory whether or not anyone looks.

So the default graph selection (no --include / --exclude / --inputs) is `boundary_taps`: every
Linear-like layer's output, and its first input named after the module that produced it,
found in one eager probe forward by storage identity. Records then align with an eager
capture's: q_proj's input is stored as `input_layernorm`'s output, lm_head's as the final
norm's; an input no selected module produced (down_proj's act(gate) * up, o_proj's attention
output) keeps the Linear's own name with role "in", as an eager capture names it. Of several
Linears reading one tensor (q / k / v_proj), the first one's tap records it. What a record of a
graph capture holds is what the compiled program computed up to that boundary: an
`input_layernorm` record is the output of the fused kernel that computes the residual add and
the norm. Modules inside a fused region (the residual stream, activations, rotary embedding)
are not recorded in this mode: record them with --include, at the measured cost.

**The observer check** (`run_unobserved`, `ObserverCheck`): every graph capture first runs the
same compiled model without any tap on the same prompts (greedy, or forced with
--tokens-from), keeps its logits, then runs the tapped one forced to the tokens the untapped one
chose. The file's `logits` records are the untapped run's (token and logits checks judge what
production computes); meta "observer_effect" holds, per request and step, the rel L2 and the
KL divergence of the tapped run's logits from the untapped ones, and whether they are bitwise
equal.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn

from accucheck.capture.record.selection import flatten

# HF GPT-2's Conv1D is an addmm with a transposed weight: a Linear for this purpose
_MATMUL_CLASSES = ("Conv1D",)
_HEAD_NAMES = ("lm_head",)  # its output is the `logits` record


@dataclass(frozen=True)
class Tap:
    """One graph-mode tap: a hook on module `hook` (`where` "in": its first positional input,
    by a forward pre-hook; "out": its output) that stores record (`module`, `role`, `slot`)."""
    hook: str
    where: str
    module: str
    role: str
    slot: str = "0"

    def __post_init__(self) -> None:
        if self.where not in ("in", "out") or self.role not in ("in", "out"):
            raise ValueError(f"bad tap {self}")


def is_matmul_layer(mod: nn.Module) -> bool:
    return isinstance(mod, nn.Linear) or type(mod).__name__ in _MATMUL_CLASSES


def _ident(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(),
            t.dtype, t._version)


def boundary_taps(model: nn.Module, producers: Sequence[str],
                  probe: Callable[[], None]) -> list[Tap]:
    """The kernel-boundary taps of `model` (see the module docstring), in probe execution
    order. `producers`: the module paths an input may be named after (the eager default
    selection); `probe()` runs one eager forward of `model` (a few tokens, no KV cache).

    Every module output of the probe is kept alive until the probe ends, so no storage address
    is reused and an identity match is the very tensor."""
    by_name = dict(model.named_modules())
    layers = [n for n, m in by_name.items() if n and is_matmul_layer(m)]
    produced: dict[tuple, tuple[str, str]] = {}
    alive: list[torch.Tensor] = []
    order: list[str] = []
    source: dict[str, tuple | None] = {}  # layer -> (producer, slot) | ("", "") | None

    def on_out(name: str):
        def hook(_m, _a, out):
            for slot, t in flatten(out):
                alive.append(t)
                produced.setdefault(_ident(t), (name, slot))  # innermost first
        return hook

    def on_in(name: str):
        def hook(_m, args):
            if name in source:
                return
            order.append(name)
            t = args[0] if args and isinstance(args[0], torch.Tensor) else None
            if t is None or not t.is_floating_point():
                source[name] = None
                return
            alive.append(t)
            source[name] = produced.get(_ident(t), ("", "")) + (_ident(t),)
        return hook

    handles = []
    try:
        for name in dict.fromkeys([*producers, *layers]):
            if name in by_name:
                handles.append(by_name[name].register_forward_hook(on_out(name)))
        for name in layers:
            handles.append(by_name[name].register_forward_pre_hook(on_in(name)))
        with torch.no_grad():
            probe()
    finally:
        for h in handles:
            h.remove()
    selected = set(producers)
    seen: set[tuple] = set()
    taps: list[Tap] = []
    for name in order + [n for n in layers if n not in source]:
        src = source.get(name)
        if src is not None:
            prod, slot, ident = src
            if ident not in seen:
                seen.add(ident)
                if prod in selected and not is_matmul_layer(by_name[prod]):
                    taps.append(Tap(name, "in", prod, "out", slot))
                elif not prod:
                    taps.append(Tap(name, "in", name, "in"))
                # else: another Linear's output, tapped there
        if name.split(".")[-1] not in _HEAD_NAMES:
            taps.append(Tap(name, "out", name, "out"))
    return taps


def router_taps(routers: Sequence) -> list[Tap]:
    """Graph mode: the three outputs of every MoE router (accucheck.capture.record.moe.Router:
    logits, top-k weights, top-k ids), so that a graph capture holds the same routing records as an
    eager one. The router's matmul is a library call like a Linear's; its top-k and weights
    are outputs of the router either way."""
    return [Tap(r.gate, "out", r.gate, "out", slot) for r in routers for slot in "012"]


def tapped_modules(taps: Sequence[Tap]) -> list[str]:
    """The record modules of `taps`, once each, in order (the capture's meta "modules")."""
    return list(dict.fromkeys(t.module for t in taps))


class ObserverCheck:
    """The final output of the untapped compiled run, and the taps' effect on it.

    `watch(forward)` wraps a compiled forward so that each call's final output (the logits; an
    encoder's first output) is kept for the step. In the untapped run, `keep(req, step)` stores
    it; in the tapped run, `compare(req, step)` measures the tapped output against the stored
    one and returns the stored one (the logits to record). Runners that get the logits another
    way (vLLM's raw logprobs) pass them as `out`. `meta()` is the capture's meta
    "observer_effect"."""

    def __init__(self, taps: str):
        self.taps = taps
        self.kept: dict[tuple[int, int], torch.Tensor] = {}
        self.tokens: list[list[int]] = []
        self.steps: list[dict] = []
        self.seconds = 0.0
        self._last: torch.Tensor | None = None

    def watch(self, forward: Callable) -> Callable:
        def watched(*args, **kwargs):
            out = forward(*args, **kwargs)
            logits = getattr(out, "logits", None)
            self._last = logits if isinstance(logits, torch.Tensor) else \
                next((t for _, t in flatten(out)), None)
            return out
        watched._orig_mod = getattr(forward, "_orig_mod", forward)  # hf.cache_argument reads it
        return watched

    def keep(self, req: int, step: int, out: torch.Tensor | None = None) -> None:
        """Store the untapped run's output of a step: `out`, else the watched forward's."""
        out = self._last if out is None else out
        if out is not None:
            self.kept[(req, step)] = out.detach().clone()
        self._last = None

    def compare(self, req: int, step: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Measure the tapped run's output of a step (`out`, else the watched forward's)
        against the kept one; returns the kept one."""
        ref, obs = self.kept.pop((req, step), None), self._last if out is None else out
        self._last = None
        if ref is None or obs is None or ref.shape != obs.shape:
            raise RuntimeError(f"observer check: the tapped and the untapped run disagree on "
                               f"the output of request {req} step {step}")
        self.steps.append({"request": req, "step": step, **logits_effect(ref, obs)})
        return ref

    def meta(self) -> dict:
        steps = self.steps
        return {"measured": True, "taps": self.taps, "logits": "unobserved",
                "bitwise": all(s["bitwise"] for s in steps),
                "max_rel_l2": max((s["rel_l2"] for s in steps), default=0.0),
                "max_kl": max((s["kl"] for s in steps), default=0.0),
                "argmax_changed": sum(s["argmax_changed"] for s in steps),
                "seconds": round(self.seconds, 3), "steps": steps}


def logits_effect(ref: torch.Tensor, obs: torch.Tensor) -> dict:
    """rel L2 of `obs` from `ref` (all positions), the mean KL(softmax(ref) || softmax(obs))
    over positions, the positions whose argmax changed, and bitwise equality; float64."""
    a = ref.detach().to(torch.float64).reshape(-1, ref.shape[-1])
    b = obs.detach().to(torch.float64).reshape(-1, obs.shape[-1])
    norm = float(a.norm())
    rel = float((a - b).norm()) / norm if norm > 0 else float((a - b).norm())
    la, lb = torch.log_softmax(a, -1), torch.log_softmax(b, -1)
    kl = float((la.exp() * (la - lb)).sum(-1).mean().clamp_min(0.0))
    return {"rel_l2": rel, "kl": kl,
            "argmax_changed": int((a.argmax(-1) != b.argmax(-1)).sum()),
            "bitwise": bool(torch.equal(ref, obs))}


def run_unobserved(forward: Callable, prompt_ids: Sequence[Sequence[int]], run_one: Callable,
                   check: ObserverCheck) -> None:
    """The untapped pass: `run_one(forward, r, ids, on_step, on_logits)` runs request r
    (greedy_run with the capture's forced tokens) and returns its Generation; the final output
    of every step and the generated tokens go into `check`."""
    t0 = time.monotonic()
    watched = check.watch(forward)
    for r, ids in enumerate(prompt_ids):
        state = {"step": 0}

        def on_step(step, state=state):
            state["step"] = step

        def on_logits(_logits, r=r, state=state):
            check.keep(r, state["step"])

        gen = run_one(watched, r, ids, on_step, on_logits)
        check.tokens.append(list(gen.generated_ids))
    check.seconds = time.monotonic() - t0
