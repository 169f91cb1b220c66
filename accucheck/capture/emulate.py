"""Emulated correct devices: the HF model computes as another device's kernels would, every
kernel correct, for calibrating verdicts (tests, bench/bench_devices.py). Imports torch.

A real GPU or NPU does not compute like the CPU's decomposed bf16 path: its kernels are fused,
compute in fp32 inside and round once, and reduce in other orders; some of its kernels are
more precise than the CPU's, some less. Two such devices are both right, and accucheck must
not raise an alarm between them. `emulated(model, device)` makes the model run one of:

    gpu     flash-style attention (scores and softmax in fp32, online over blocks of 64 keys,
            the probabilities rounded to bf16 before P @ V), fused RMSNorm and fused SwiGLU
            and fused rotary (fp32 inside, one rounding), GEMMs accumulated in float64 (another
            order; rounded once)
    npu     attention scores rounded to bf16 before an fp32 softmax, P kept in fp32, P @ V over
            blocks of 128 keys in fp32; the norm fused (fp32 inside, one rounding) but SwiGLU
            and rotary as the CPU does (two roundings each); GEMMs with K split into four fp32
            partial sums added in order
    dither  the CPU's own kernels, every rounding op's last bit moved on a quarter of the
            elements (accucheck.capture.faults.dithered: the device a control run is made of)
    mixed   gpu choices in even layers, npu choices in odd ones (attention and norm), fused
            SwiGLU and rotary, split-K GEMMs, and a lighter dither (10 %) on top

Each is as correct as the CPU's bf16 path: it computes the same function, rounding elsewhere.
In float32 runs the same code runs in float32 (a few ULPs from the CPU's). A norm that is not
`weight * x / rms(x)` (Gemma's `1 + weight`) is refused at its first call, never emulated
wrong. `seed` seeds the dither. Composes with planted faults (accucheck.capture.faults): enter
the emulation first, the fault inside it.
"""
from __future__ import annotations

import math
import sys
from contextlib import ExitStack, contextmanager
from typing import Callable, Iterator

import torch
from torch import nn

from accucheck.errors import UserError

DEVICES = ("gpu", "npu", "dither", "mixed")
FLASH_BLOCK = 64   # keys per block of the gpu's online softmax
NPU_BLOCK = 128    # keys per block of the npu's P @ V
SPLIT_K = 4        # the npu's GEMM partial sums


@contextmanager
def emulated(model: nn.Module, device: str, seed: int = 0) -> Iterator[None]:
    """While active, `model` computes as emulated `device` (DEVICES) would."""
    from accucheck.capture.faults import dithered

    if device not in DEVICES:
        raise UserError(f"unknown emulated device {device!r}: use one of {', '.join(DEVICES)}")
    if device == "dither":
        with dithered(seed):
            yield
        return
    odd = {"gpu": lambda layer: False, "npu": lambda layer: True,
           "mixed": lambda layer: layer % 2 == 1}[device]
    with ExitStack() as stack:
        stack.enter_context(_attention(model, lambda layer: "npu" if odd(layer) else "gpu"))
        stack.enter_context(_norms(model))
        if device != "npu":
            stack.enter_context(_rotary(model))
        stack.enter_context(_Kernels(gemm="fp64" if device == "gpu" else "splitk",
                                     swiglu=device != "npu"))
        if device == "mixed":
            stack.enter_context(dithered(seed, p=0.1))
        yield


# ----------------------------------------------------------------------------- attention
def _additive(mask: torch.Tensor | None, lq: int, lk: int, device) -> torch.Tensor | None:
    """The attention mask as an fp32 additive term: a bool mask (sdpa's: True = attend) or a
    float one (eager's), or None: causal, aligned to the last query (sdpa's is_causal)."""
    if mask is not None:
        if mask.dtype == torch.bool:
            return torch.zeros(mask.shape, device=device).masked_fill(~mask, -math.inf)
        return mask.float()[..., :lk]
    if lq == 1:
        return None
    q = torch.arange(lq, device=device).unsqueeze(1) + (lk - lq)
    return torch.zeros(lq, lk, device=device).masked_fill(
        torch.arange(lk, device=device).unsqueeze(0) > q, -math.inf)


def _flash(q, k, v, add, scaling) -> torch.Tensor:
    """Scores and an online softmax in fp32 over blocks of FLASH_BLOCK keys, each block's
    probabilities (against the running max) rounded to the input dtype before P @ V."""
    dt = q.dtype
    s = (q.float() @ k.float().transpose(-1, -2)) * scaling
    if add is not None:
        s = s + add
    o = torch.zeros(*q.shape[:-1], v.shape[-1], device=q.device)
    m = torch.full((*q.shape[:-1], 1), -1e30, device=q.device)
    denom = torch.zeros_like(m)
    for j in range(0, s.shape[-1], FLASH_BLOCK):
        sj = s[..., j:j + FLASH_BLOCK]
        mj = torch.maximum(m, sj.amax(-1, keepdim=True))
        rescale = torch.exp(m - mj)
        p = torch.exp(sj - mj)
        denom = denom * rescale + p.sum(-1, keepdim=True)
        o = o * rescale + p.to(dt).float() @ v[..., j:j + FLASH_BLOCK, :].float()
        m = mj
    return (o / denom).to(dt)


def _npu_attention(q, k, v, add, scaling) -> torch.Tensor:
    """Scores rounded to the input dtype, softmax in fp32, P kept in fp32, P @ V in fp32 over
    blocks of NPU_BLOCK keys."""
    dt = q.dtype
    s = ((q.float() @ k.float().transpose(-1, -2)) * scaling).to(dt).float()
    if add is not None:
        s = s + add
    p = torch.softmax(s, dim=-1)
    o = torch.zeros(*q.shape[:-1], v.shape[-1], device=q.device)
    for j in range(0, s.shape[-1], NPU_BLOCK):
        o = o + p[..., j:j + NPU_BLOCK] @ v[..., j:j + NPU_BLOCK, :].float()
    return o.to(dt)


def _attention_fn(which: Callable[[int], str]):
    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
        if scaling is None:
            scaling = query.shape[-1] ** -0.5
        groups = query.shape[1] // key.shape[1]
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
        add = _additive(attention_mask, query.shape[-2], key.shape[-2], query.device)
        layer = getattr(module, "layer_idx", 0) or 0
        fn = _npu_attention if which(layer) == "npu" else _flash
        out = fn(query, key, value, add, scaling)
        return out.transpose(1, 2).contiguous(), None
    return attention


@contextmanager
def _attention(model: nn.Module, which: Callable[[int], str]) -> Iterator[None]:
    """The model's attention implementation (eager or sdpa) replaced in transformers' registry
    for as long as the context lasts."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = getattr(getattr(model, "config", None), "_attn_implementation", None) or "eager"
    if name not in ("eager", "sdpa"):
        raise UserError(f"emulated attention replaces eager or sdpa attention; the model runs "
                        f"{name!r}")
    local = ALL_ATTENTION_FUNCTIONS._local_mapping
    had, old = name in local, local.get(name)
    ALL_ATTENTION_FUNCTIONS[name] = _attention_fn(which)
    try:
        yield
    finally:
        if had:
            local[name] = old
        else:
            del local[name]


# ----------------------------------------------------------------------------- norms, rotary
@contextmanager
def _norms(model: nn.Module) -> Iterator[None]:
    """Every RMSNorm computed fused: fp32 inside, one rounding (a forward hook replacing its
    output; checked against the module's own output, so a norm of another formula is refused)."""
    handles = []

    def hook(mod, args, out):
        x = args[0]
        eps = getattr(mod, "variance_epsilon", getattr(mod, "eps", 1e-6))
        h = x.float()
        y = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * mod.weight.float()
             ).to(out.dtype)
        err = (y.float() - out.float()).detach().norm() / max(out.float().norm().item(), 1e-30)
        if err > 0.05:  # far over any rounding: another formula
            raise UserError(f"emulated fused RMSNorm does not compute {type(mod).__name__} "
                            f"(rel_l2 {float(err):.2g} against its own output)")
        return y

    for _, mod in model.named_modules():
        if type(mod).__name__.endswith("RMSNorm") and isinstance(
                getattr(mod, "weight", None), torch.Tensor):
            handles.append(mod.register_forward_hook(hook, prepend=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextmanager
def _rotary(model: nn.Module) -> Iterator[None]:
    """`apply_rotary_pos_emb` of the model's modeling modules computed in fp32, rounded once."""
    patched = []
    for mod in {type(m).__module__ for m in model.modules()}:
        ns = sys.modules.get(mod)
        fn = getattr(ns, "apply_rotary_pos_emb", None)
        if fn is None or getattr(fn, "_accucheck_fused", False):
            continue

        def fused(q, k, cos, sin, *a, _orig=fn, **kw):
            qe, ke = _orig(q.float(), k.float(), cos.float(), sin.float(), *a, **kw)
            return qe.to(q.dtype), ke.to(k.dtype)
        fused._accucheck_fused = True
        setattr(ns, "apply_rotary_pos_emb", fused)
        patched.append((ns, fn))
    try:
        yield
    finally:
        for ns, fn in patched:
            setattr(ns, "apply_rotary_pos_emb", fn)


# ----------------------------------------------------------------------------- GEMMs, SwiGLU
_GEMMS = {"aten.mm": lambda a, b: a @ b, "aten.bmm": lambda a, b: a @ b}


class _Kernels:
    """A dispatch mode: GEMMs of reduced-precision inputs in another accumulation order
    ("fp64": float64, "splitk": SPLIT_K fp32 partial sums), rounded once; with `swiglu`, the
    product silu(gate) * up computed from the fp32 silu (one rounding instead of two)."""

    def __init__(self, gemm: str, swiglu: bool):
        from torch.utils._python_dispatch import TorchDispatchMode

        outer = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                return outer.dispatch(func, args, kwargs or {})
        self.mode = _Mode()
        self.gemm, self.swiglu = gemm, swiglu
        self.silu: tuple[torch.Tensor, torch.Tensor] | None = None  # (output, fp32 value)

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.silu = None
        return self.mode.__exit__(*exc)

    def _matmul(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if self.gemm == "fp64":
            return a.double() @ b.double()
        k = a.shape[-1]
        step = max(1, -(-k // SPLIT_K))
        out = None
        for i in range(0, k, step):
            part = a[..., i:i + step].float() @ b[..., i:i + step, :].float()
            out = part if out is None else out + part
        return out

    def dispatch(self, func, args, kwargs):
        name = str(func.overloadpacket)
        low = (torch.bfloat16, torch.float16)
        if name in _GEMMS and args[0].dtype in low and not kwargs:
            return self._matmul(args[0], args[1]).to(args[0].dtype)
        if name == "aten.addmm" and args[1].dtype in low and not kwargs:
            return (self._matmul(args[1], args[2]) + args[0].double()).to(args[1].dtype)
        if self.swiglu and name == "aten.silu" and args[0].dtype in low:
            exact = torch.nn.functional.silu(args[0].float())
            out = exact.to(args[0].dtype)
            self.silu = (out, exact)
            return out
        if self.swiglu and name == "aten.mul" and self.silu is not None and len(args) == 2 \
                and all(isinstance(a, torch.Tensor) for a in args):
            out, exact = self.silu
            other = args[1] if args[0] is out else args[0] if args[1] is out else None
            if other is not None and other.shape == out.shape:
                self.silu = None
                return (exact * other.float()).to(out.dtype)
        return func(*args, **kwargs)
