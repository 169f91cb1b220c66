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

Graded faults (the error grows linearly with D, so a fault can be sized to a multiple of a
record's natural noise; bench/bench_control.py does):

    norm:part:D        recompute an RMSNorm whose variance moves by D toward the variance of
                       the first quarter of the hidden size (a kernel that reduces over part of
                       the row); for RMSNorm modules (weight + variance_epsilon / eps)
    tile:D             recompute a Linear whose first 64 input features (one K tile) add in
                       with weight (1 + D) (a tile accumulated with a wrong scale); nn.Linear
    act:slope:D        recompute SiLU as x * sigmoid((1 + D) x) (a wrong constant inside an
                       activation kernel); for act modules
    attn:scale:F       the attention core's softmax scale times F (a kernel with a wrong scale
                       constant: scores off by a factor, in whatever attention implementation
                       runs, sdpa's fused kernel included); for transformers attention modules
                       (self_attn, whose `scaling` the attention function is called with)

Op-level faults (inside `module`, every call of one operator computes differently; the fault
acts at the dispatcher, below accucheck's op recorder, so an op-level capture sees one op with a
faulty output, exactly like a faulty device kernel):

    op:OP:bf16 / op:OP:fp16   OP runs on its floating inputs rounded to bfloat16 / float16 and
                              its output is cast back (a reduced-precision kernel), e.g.
                              op:aten.silu:fp16, op:aten._softmax:bf16, op:aten.mm:bf16
    op:OP:tanh                OP (aten.gelu) with approximate="tanh" (another GELU approximation)
    op:OP:scale:F             OP's output times F (e.g. a wrong epsilon / scale constant)
    op:OP:inscale:F           OP on its first argument times F: a softmax with a wrong scale
                              (op:aten._softmax:inscale:1.01 inside self_attn: the attention
                              core, which no module record covers; eager attention only, sdpa's
                              fused kernel calls no aten._softmax: attn:scale:F reaches both),
                              rotary angles off by a factor (op:aten.cos|aten.sin:inscale:1.001
                              inside rotary_emb)

OP is the operator with or without overload ("aten.mm" or "aten.mm.default"), or several
joined by "|".

Mixture-of-experts faults (transformers 5 MoE blocks, accucheck.capture.record.moe):

    router:E:D         a router (mlp.gate) whose logit of expert E is off by D for every token
                       (a router kernel with a wrong bias): tokens whose reference margin to E
                       is below D go to other experts
    router:noise:S     every router logit off by seeded Gaussian noise of std S (rounding-like
                       noise: the tokens that flip are near-ties)
    expert:E:scale:F   expert E of a fused experts module (mlp.experts: 3-D gate_up_proj /
                       down_proj) outputs F x what it should on every token routed to it
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from accucheck.errors import UserError

FAULTS = ("bf16", "fp16", "noise:REL", "scale:F", "acc:bf16:K", "act:silu_fast", "act:gelu_tanh",
          "norm:part:D", "tile:D", "act:slope:D", "attn:scale:F",
          "op:OP:bf16", "op:OP:fp16", "op:OP:tanh", "op:OP:scale:F", "op:OP:inscale:F",
          "router:E:D", "router:noise:S", "expert:E:scale:F")
TILE = 64  # input features of the tile `tile:D` mis-scales


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
    if name in ("norm", "tile") or fault.startswith("act:slope:"):
        try:
            d = float(fault.rsplit(":", 1)[1])
        except ValueError:
            raise UserError(f"fault {fault!r}: D must be a number") from None
        if fault.startswith("act:slope:"):
            return lambda x, t: (x * torch.sigmoid((1 + d) * x)).to(t.dtype)
        if fault.startswith("norm:part:") or name == "tile":
            return (name, d)
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
    if fault.startswith("router:"):
        with _planted_router(mods[module], module, fault, seed):
            yield
        return
    if fault.startswith("attn:scale:"):
        with _attention_scale(mods[module], module, fault):
            yield
        return
    if fault.startswith("expert:"):
        handle = mods[module].register_forward_hook(
            _expert_scale(mods[module], module, fault), prepend=True)
        try:
            yield
        finally:
            handle.remove()
        return
    fn = _transform(fault, seed)
    if isinstance(fn, tuple):  # these need the module's weights
        fn = {"acc": _bf16_accumulation, "norm": _partial_norm, "tile": _tile_scale}[fn[0]](
            mods[module], module, fn[1])

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


def _partial_norm(mod: nn.Module, name: str, d: float):
    eps = getattr(mod, "variance_epsilon", getattr(mod, "eps", None))
    if getattr(mod, "weight", None) is None or not isinstance(eps, float):
        raise UserError(f"fault norm:part needs an RMSNorm (weight, variance_epsilon); {name} is "
                        f"{type(mod).__name__}")

    def norm(x, t):
        h = x.float()
        var = h.pow(2).mean(-1, keepdim=True)
        part = h[..., : h.shape[-1] // 4].pow(2).mean(-1, keepdim=True)
        out = h * torch.rsqrt(var + d * (part - var) + eps)
        return (mod.weight * out.to(x.dtype)).to(t.dtype)
    return norm


def _tile_scale(mod: nn.Module, name: str, d: float):
    if not isinstance(mod, nn.Linear):
        raise UserError(f"fault tile needs an nn.Linear; {name} is {type(mod).__name__}")

    def tile(x, t):
        extra = x[..., :TILE].float() @ mod.weight[:, :TILE].float().t()
        return (t.float() + d * extra).to(t.dtype)
    return tile


@contextmanager
def _attention_scale(mod: nn.Module, name: str, fault: str) -> Iterator[None]:
    """attn:scale:F: during each forward of `mod`, its `scaling` (the softmax scale transformers'
    attention modules pass to the attention function) is F x its own, restored on return (hooks:
    they travel with a converted copy of the model)."""
    try:
        f = float(fault.split(":", 2)[2])
    except ValueError:
        raise UserError(f"fault {fault!r}: use attn:scale:F (F a number)") from None
    if not isinstance(getattr(mod, "scaling", None), (int, float)):
        raise UserError(f"cannot plant {fault!r} in {name}: it is not an attention module with "
                        f"a softmax scale (`scaling`)")

    def enter(m, _a):
        m._accucheck_scaling = m.scaling
        m.scaling = m.scaling * f

    def leave(m, _a, _o):
        m.scaling = m.__dict__.pop("_accucheck_scaling", m.scaling)

    handles = [mod.register_forward_pre_hook(enter, prepend=True),
               mod.register_forward_hook(leave, always_call=True)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _numbers(fault: str, first, second) -> tuple:
    parts = fault.split(":")
    try:
        if parts[0] == "expert" and len(parts) == 4 and parts[2] == "scale":
            return first(parts[1]), second(parts[3])
        if parts[0] == "router" and len(parts) == 3:
            return parts[1] if parts[1] == "noise" else first(parts[1]), second(parts[2])
    except ValueError:
        pass
    raise UserError(f"fault {fault!r}: use router:E:D, router:noise:S or expert:E:scale:F "
                    f"(E an expert number, D / S / F numbers)")


@contextmanager
def _planted_router(mod: nn.Module, name: str, fault: str, seed: int) -> Iterator[None]:
    """The router's logits (the first F.linear of its forward) perturbed before it picks the
    top-k. Hooks mark the router's forward (they travel with a converted copy of the model,
    as every fault here does); a torch function mode does the rest."""
    from torch.overrides import TorchFunctionMode

    which, amount = _numbers(fault, int, float)
    n = getattr(mod, "num_experts", None)
    if not isinstance(n, int) or (which != "noise" and not 0 <= which < n):
        raise UserError(f"fault {fault!r}: {name} is not a MoE router with expert {which} "
                        f"(num_experts {n})")
    gen = torch.Generator().manual_seed(seed)
    state = {"depth": 0, "done": False}

    def perturb(logits: torch.Tensor) -> torch.Tensor:
        if which == "noise":
            noise = torch.randn(logits.shape, generator=gen, dtype=torch.float32)
            return logits + (amount * noise).to(logits.device, logits.dtype)
        out = logits.clone()
        out[..., which] += amount
        return out

    class _Logits(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.nn.functional.linear and state["depth"] and not state["done"]:
                state["done"] = True
                return perturb(out)
            return out

    with _inside(mod, state, _Logits()):
        yield


@contextmanager
def _inside(mod: nn.Module, state: dict, mode) -> Iterator[None]:
    """While active, `mode` (a torch function / dispatch mode) is on and state["depth"] counts
    the open forwards of `mod` (hooks: they travel with a converted copy of the model);
    state["done"] is reset at each forward."""
    def enter(_m, _a):
        state["depth"] += 1
        state["done"] = False

    def leave(_m, _a, _o):
        state["depth"] -= 1

    handles = [mod.register_forward_pre_hook(enter, prepend=True),
               mod.register_forward_hook(leave, always_call=True)]
    try:
        with mode:
            yield
    finally:
        for h in handles:
            h.remove()


def _expert_scale(mod: nn.Module, name: str, fault: str):
    """A forward hook: expert E's contribution to the output made F x (see the docstring)."""
    e, f = _numbers(fault, int, float)
    gu, dn = getattr(mod, "gate_up_proj", None), getattr(mod, "down_proj", None)
    if not (isinstance(gu, torch.Tensor) and isinstance(dn, torch.Tensor) and gu.ndim == 3
            and dn.ndim == 3 and isinstance(getattr(mod, "act_fn", None), nn.Module)
            and 0 <= e < gu.shape[0]):
        raise UserError(f"fault {fault!r}: {name} is not a fused experts module with expert "
                        f"{e} (3-D gate_up_proj / down_proj and act_fn)")

    def hook(m, args, out):  # `m`: the module called (a converted copy has its own weights)
        gu, dn, act = m.gate_up_proj, m.down_proj, m.act_fn
        x, idx, w = args[0], args[1], args[2]
        hit = idx == e
        rows = hit.any(-1).nonzero().squeeze(-1)
        if rows.numel() == 0:
            return out
        g, u = torch.nn.functional.linear(x[rows], gu[e]).chunk(2, dim=-1)
        # the act module's class forward: no hook or recorder wrapper sees this call
        y = torch.nn.functional.linear(type(act).forward(act, g) * u, dn[e])
        weight = (w[rows] * hit[rows]).sum(-1, keepdim=True).to(y.dtype)
        out = out.clone()
        out[rows] += ((f - 1.0) * y * weight).to(out.dtype)
        return out
    return hook


def _op_fault(fault: str):
    """(operator name, how) -> a function (func, args, kwargs) -> faulty output."""
    _, op, how = (fault.split(":", 2) + ["", ""])[:3]
    if not op or not how:
        raise UserError(f"op fault {fault!r}: use op:OP:bf16|fp16|tanh|scale:F|inscale:F")
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
    if how.startswith("inscale:"):
        f = float(how.split(":", 1)[1])
        return op, lambda func, args, kwargs: func(args[0] * f, *args[1:], **kwargs)
    raise UserError(f"op fault {fault!r}: use op:OP:bf16|fp16|tanh|scale:F|inscale:F")


@contextmanager
def _planted_op(mod: nn.Module, fault: str) -> Iterator[None]:
    from torch.utils._python_dispatch import TorchDispatchMode

    op, fn = _op_fault(fault)
    state = {"depth": 0, "done": False}

    wanted = set(op.split("|"))

    def matches(func) -> bool:
        name = str(func)
        return name in wanted or name.rsplit(".", 1)[0] in wanted

    class _FaultMode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if state["depth"] and matches(func):
                return fn(func, args, kwargs)
            return func(*args, **kwargs)

    with _inside(mod, state, _FaultMode()):
        yield


# ----------------------------------------------------------------------------- dither
# Rounding ops whose last bit depends on the kernel (accumulation order, fused or not, how an
# exp / rsqrt is approximated): what another device's bf16 kernels change. Views, copies,
# casts, concatenation, indexing and embedding lookups are exact everywhere and left alone.
DITHER_OPS = frozenset({
    "aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten.mul", "aten.add", "aten.sub",
    "aten.div", "aten.rsqrt", "aten.sqrt", "aten.pow", "aten.mean", "aten.sum", "aten.silu",
    "aten.gelu", "aten._softmax", "aten.exp", "aten.cos", "aten.sin", "aten.tanh",
    "aten.sigmoid", "aten._scaled_dot_product_flash_attention_for_cpu",
})
_INT_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


@contextmanager
def dithered(seed: int, p: float = 0.25) -> Iterator[None]:
    """While active, every rounding op (DITHER_OPS) of a bfloat16 / float16 / float32 output
    moves each finite non-zero element of its output by one ULP up or down with probability
    `p` (seeded): the last-bit differences another device's kernels make. Two runs with other
    seeds are two devices of the same precision: what a control run and a clean candidate
    look like to each other (bench/bench_control.py). Acts at the dispatcher, under any planted
    fault and under accucheck's op recorder; statistics are taken outside it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    if not 0 <= p <= 1:
        raise UserError(f"dither probability {p} must be in [0, 1]")
    gen = torch.Generator().manual_seed(seed)

    def flip(t):
        iv = _INT_VIEW.get(t.dtype) if isinstance(t, torch.Tensor) else None
        if iv is None or t.numel() == 0:
            return t
        u = torch.rand(t.shape, generator=gen).to(t.device)
        step = torch.where(u < p / 2, -1, torch.where(u < p, 1, 0)).to(iv)
        step = torch.where(torch.isfinite(t) & (t != 0), step, torch.zeros_like(step))
        return (t.contiguous().view(iv) + step).view(t.dtype).view(t.shape)

    class _Dither(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if str(func.overloadpacket) not in DITHER_OPS:
                return out
            if isinstance(out, tuple):
                return type(out)(flip(o) for o in out)
            return flip(out)

    with _Dither():
        yield
