"""Planted faults: make one module compute like a faulty kernel, for demos and tests.

A fault is a forward hook that replaces the module's output (or, for `act:*`, recomputes it from
the module's input), so it is removed cleanly and the weights are untouched. Imports torch.

    bf16 / fp16        round the output through bfloat16 / float16 (a reduced-precision kernel)
    noise:REL          add seeded Gaussian noise of relative size REL
    scale:F            multiply the output by F (a wrong constant, e.g. an epsilon / scale bug)
    act:silu_fast      recompute SiLU as x * sigmoid with sigmoid in float16 (an approximate
                       activation kernel); for act modules (mlp.act_fn)
    act:gelu_tanh      recompute GELU with the tanh approximation; for GELU act modules
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from accucheck.errors import UserError

FAULTS = ("bf16", "fp16", "noise:REL", "scale:F", "act:silu_fast", "act:gelu_tanh")


def _transform(fault: str, seed: int):
    name, _, arg = fault.partition(":")
    if fault == "bf16":
        return lambda x, t: t.to(torch.bfloat16).to(t.dtype)
    if fault == "fp16":
        return lambda x, t: t.to(torch.float16).to(t.dtype)
    if name == "noise":
        rel = float(arg)
        gen = torch.Generator().manual_seed(seed)

        def noise(x, t):
            n = torch.randn(t.shape, generator=gen, dtype=torch.float32).to(t.device, t.dtype)
            return t + n * rel * t.float().pow(2).mean().sqrt().to(t.dtype)
        return noise
    if name == "scale":
        f = float(arg)
        return lambda x, t: t * f
    if fault == "act:silu_fast":
        return lambda x, t: x * torch.sigmoid(x.to(torch.float16)).to(x.dtype)
    if fault == "act:gelu_tanh":
        return lambda x, t: torch.nn.functional.gelu(x, approximate="tanh")
    raise UserError(f"unknown fault {fault!r}: use one of {', '.join(FAULTS)}")


@contextmanager
def planted(model: nn.Module, module: str, fault: str, seed: int = 0) -> Iterator[None]:
    """While active, `module`'s first output tensor is replaced as `fault` says."""
    mods = dict(model.named_modules())
    if module not in mods:
        raise UserError(f"no module {module!r} in the model to plant a fault in")
    fn = _transform(fault, seed)

    def hook(_mod, args, out):
        x = args[0] if args else None
        if isinstance(out, torch.Tensor):
            return fn(x, out)
        if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
            return (fn(x, out[0]),) + tuple(out[1:])
        raise UserError(f"cannot plant a fault in {module}: its output is {type(out).__name__}")

    # registered first, so the recorder's hooks (added later) see the faulty output
    handle = mods[module].register_forward_hook(hook, prepend=True)
    try:
        yield
    finally:
        handle.remove()
