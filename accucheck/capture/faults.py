"""Planted faults: make one module compute like a faulty kernel, for demos and tests.

A fault is a forward hook that replaces the module's output (or, for `act:*`, recomputes it from
the module's input), so it is removed cleanly and the weights are untouched. Imports torch.

    bf16 / fp16        round the output through bfloat16 / float16 (a reduced-precision kernel)
    noise:REL          add seeded Gaussian noise of relative size REL
    scale:F            multiply the output by F (a wrong constant, e.g. an epsilon / scale bug)
    acc:bf16:K         recompute a Linear with its partial sums accumulated in bfloat16 over
                       chunks of K input features (a GEMM kernel that keeps its accumulator in
                       the output dtype); for nn.Linear modules
    act:silu_fast      recompute SiLU as x * sigmoid with sigmoid in float16 (an approximate
                       activation kernel); for act modules (mlp.act_fn)
    act:gelu_tanh      recompute GELU with the tanh approximation; for GELU act modules

Op-level faults (inside `module`, every call of one operator computes differently; the fault
acts at the dispatcher, below accucheck's op recorder, so an op-level capture sees one op with a
faulty output, exactly like a faulty device kernel):

    op:OP:bf16 / op:OP:fp16   OP runs on its floating inputs rounded to bfloat16 / float16 and
                              its output is cast back (a reduced-precision kernel), e.g.
                              op:aten.silu:fp16, op:aten._softmax:bf16, op:aten.mm:bf16
    op:OP:tanh                OP (aten.gelu) with approximate="tanh" (another GELU approximation)
    op:OP:scale:F             OP's output times F (e.g. a wrong epsilon / scale constant)

OP is the operator with or without overload ("aten.mm" or "aten.mm.default").
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from accucheck.errors import UserError

FAULTS = ("bf16", "fp16", "noise:REL", "scale:F", "acc:bf16:K", "act:silu_fast", "act:gelu_tanh",
          "op:OP:bf16", "op:OP:fp16", "op:OP:tanh", "op:OP:scale:F")


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
    if name == "acc":
        low, _, k = arg.partition(":")
        if low != "bf16" or not k.isdigit() or int(k) < 1:
            raise UserError(f"fault {fault!r}: use acc:bf16:K (K input features per chunk)")
        return ("acc", int(k))
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
    if fault.startswith("op:"):
        with _planted_op(mods[module], fault):
            yield
        return
    fn = _transform(fault, seed)
    if isinstance(fn, tuple):  # acc:bf16:K needs the module's weights
        fn = _bf16_accumulation(mods[module], module, fn[1])

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


def _bf16_accumulation(mod: nn.Module, name: str, chunk: int):
    if not isinstance(mod, nn.Linear):
        raise UserError(f"fault acc:bf16 needs an nn.Linear; {name} is {type(mod).__name__}")

    def acc(x, t):
        w = mod.weight
        total = torch.zeros(t.shape, dtype=torch.bfloat16, device=t.device)
        for i in range(0, w.shape[1], chunk):
            part = x[..., i:i + chunk].float() @ w[:, i:i + chunk].float().t()
            total = (total.float() + part).to(torch.bfloat16)  # the accumulator is bf16
        if mod.bias is not None:
            total = (total.float() + mod.bias.float()).to(torch.bfloat16)
        return total.to(t.dtype)
    return acc


def _op_fault(fault: str):
    """(operator name, how) -> a function (func, args, kwargs) -> faulty output."""
    _, op, how = (fault.split(":", 2) + ["", ""])[:3]
    if not op or not how:
        raise UserError(f"op fault {fault!r}: use op:OP:bf16|fp16|tanh|scale:F")
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(how)
    if low is not None:
        def reduced(func, args, kwargs):
            dt = [None]

            def down(x):
                if isinstance(x, torch.Tensor) and x.is_floating_point():
                    dt[0] = dt[0] or x.dtype
                    return x.to(low)
                if isinstance(x, (list, tuple)):
                    return type(x)(down(v) for v in x)
                return x
            a = tuple(down(v) for v in args)
            kw = {k: down(v) for k, v in kwargs.items()}
            out = func(*a, **kw)
            back = dt[0] or torch.float32
            if isinstance(out, torch.Tensor):
                return out.to(back) if out.is_floating_point() else out
            return type(out)(o.to(back) if isinstance(o, torch.Tensor) and o.is_floating_point()
                             else o for o in out)
        return op, reduced
    if how == "tanh":
        return op, lambda func, args, kwargs: func(*args, **{**kwargs, "approximate": "tanh"})
    if how.startswith("scale:"):
        f = float(how.split(":", 1)[1])
        return op, lambda func, args, kwargs: func(*args, **kwargs) * f
    raise UserError(f"op fault {fault!r}: use op:OP:bf16|fp16|tanh|scale:F")


@contextmanager
def _planted_op(mod: nn.Module, fault: str) -> Iterator[None]:
    from torch.utils._python_dispatch import TorchDispatchMode

    op, fn = _op_fault(fault)
    depth = [0]

    def matches(func) -> bool:
        name = str(func)
        return name == op or name.rsplit(".", 1)[0] == op

    class _FaultMode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if depth[0] and matches(func):
                return fn(func, args, kwargs)
            return func(*args, **kwargs)

    def enter(_m, _a):
        depth[0] += 1

    def leave(_m, _a, _o):
        depth[0] -= 1

    handles = [mod.register_forward_pre_hook(enter, prepend=True),
               mod.register_forward_hook(leave, always_call=True)]
    try:
        with _FaultMode():
            yield
    finally:
        for h in handles:
            h.remove()
