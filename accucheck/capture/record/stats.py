"""Per-record statistics in few kernels: the recorders' statistics engine.

Imports torch, numpy, accucheck.store (SAMPLE_SIZE) and, lazily, the C kernel next to this file
(built with the system C compiler, loaded with ctypes); never h5py.

What a record stores does not change (accucheck.store: /index/stats, /index/checksum, /index/sample;
tensor_stats below is the reference definition): min, max, sum (-> mean),
L2 (-> std), NaN / Inf / zero counts, the bit-pattern checksum and 64 values sampled at fixed
positions. How they are computed:

- CPU tensors (float32, float64, float16, bfloat16): ONE pass of a C kernel
  (stats_kernel.c; built on first use into the accucheck cache, `cc -O3` plus -mavx2 -mfma
  -mf16c where the CPU has them) writes the record's row straight into the step's host array:
  no torch kernel, no copy, no transfer. About 0.2 ns per element on an AVX2 core, against about
  1 ns for the cheapest set of torch reductions and some 30 µs of per-op overhead per record.
- Accelerator tensors, and CPU tensors when no C compiler works (or with
  ACCUCHECK_STATS_KERNEL=torch): the tensor is copied into a row of a staging buffer shared by
  the step's tensors of the same device, dtype and size (one copy kernel per record; the copy is
  what keeps the statistics right when the model changes the tensor in place after the hook).
  `compute()` reduces each buffer row-wise at once (amin, amax, sum, L2, non-zero count,
  bit-pattern sum, the 64-value gather: about a dozen kernels per buffer whatever the number of
  records in it) into one float64 tensor, and moves the whole step to the host in ONE transfer.
  NaN / Inf are counted only in rows whose min or max is not finite (the only rows that can
  hold one), from the staged copy, after that transfer.
- Staging is bounded: past `stage_bytes` per step the staged rows are reduced early; a tensor
  larger than that (on the CPU torch path: larger than STAGE_NUMEL_CPU elements, where the copy
  costs more than the per-op overhead it saves) is reduced at once, on its own.
- Integer, bool, complex, float8 and empty tensors take `tensor_stats` (rare: token ids with
  --inputs).

Sums: the C kernel accumulates sums and sums of squares in float64 lanes (more accurate than
torch's float32 reductions); the torch path in float32 for 16-bit and float32 tensors (float64
for float64), as `tensor_stats` does, in another order. So sum, mean, L2 and std may differ from
`tensor_stats` in the last bits; min, max, the counts, the checksum and the sample are identical
(tests/test_capture_cost.py checks both paths against it).
"""
from __future__ import annotations

import ctypes
import hashlib
import math
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from accucheck.store import SAMPLE_SIZE, SKETCH_FLOOR, SKETCH_WIDTH, sketch_tables

RAW_SIZE = 8 + SAMPLE_SIZE + SKETCH_WIDTH  # min, max, sum, l2, nan, inf, zero, checksum,
                                           # sample..., sketch (exponent, buckets...)
STAGE_BYTES = 256 << 20             # staged bytes per step before an early reduction
STAGE_NUMEL_CPU = 1 << 17           # torch path on the CPU: larger tensors are reduced at once
_MOD52 = 2 ** 52
_ROW_BYTES = RAW_SIZE * 8
_dispatch_depth = torch._C._len_torch_dispatch_stack
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_C_NAMES = {torch.float32: "f32", torch.float64: "f64", torch.float16: "f16",
            torch.bfloat16: "bf16"}
_SOURCE = Path(__file__).with_name("stats_kernel.c")

_kernel_state: dict = {}  # "lib" (a _CKernel or None) and "why" (the reason there is none)


class _CKernel:
    """The loaded C kernel: one function per dtype, `(data_ptr, numel, out_row_ptr, sketch)
    -> 0` (sketch 0: the sketch row is NaN)."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        self.fns = {}
        for dtype, suffix in _C_NAMES.items():
            fn = getattr(lib, f"accucheck_stats_{suffix}")
            fn.argtypes = (ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int)
            fn.restype = ctypes.c_int
            self.fns[dtype] = fn
        lib.accucheck_sketch_init()  # the sketch's position tables, before any kernel
        if not lib.accucheck_has_f16():
            del self.fns[torch.float16]  # no _Float16 in this compiler: the torch path does it


def _arch_flags() -> list[str]:
    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64"):
        return []  # aarch64: NEON is baseline, -O3 vectorizes
    try:
        flags = next((ln.split(":", 1)[1].split() for ln in
                      Path("/proc/cpuinfo").read_text().splitlines()
                      if ln.startswith("flags")), [])
    except OSError:
        return []
    out = ["-mavx2", "-mfma"] if {"avx2", "fma"} <= set(flags) else []
    return out + (["-mf16c"] if "f16c" in flags else [])


def _cache_dir() -> Path:
    from accucheck.capture.tiny import default_cache_dir

    return default_cache_dir() / "kernels"


def _build() -> _CKernel:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise RuntimeError("no C compiler (cc / gcc) on PATH")
    src = _SOURCE.read_bytes()
    flags = ["-O3", "-shared", "-fPIC", "-fno-math-errno", *_arch_flags()]
    key = hashlib.sha256(src + " ".join([cc, *flags, platform.machine()]).encode()).hexdigest()
    target = _cache_dir() / f"stats-{key[:16]}.so"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            # the sketch's log1p vectorised by glibc's libmvec where it links; else scalar
            for extra in (["-DACCUCHECK_MVEC", "-lmvec", "-lm"], ["-lm"]):
                p = subprocess.run([cc, *flags, "-o", tmp, str(_SOURCE), *extra],
                                   capture_output=True, text=True, timeout=120)
                if not p.returncode:
                    break
            if p.returncode:
                raise RuntimeError(f"{cc} failed: {p.stderr.strip()[-500:]}")
            os.replace(tmp, target)  # atomic: a concurrent build never half-writes it
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return _CKernel(ctypes.CDLL(str(target)))


def c_kernel() -> _CKernel | None:
    """The C kernel, built and loaded once per process; None when it cannot be (no compiler,
    ACCUCHECK_STATS_KERNEL=torch): `kernel_status()` says why."""
    if "lib" not in _kernel_state:
        if os.environ.get("ACCUCHECK_STATS_KERNEL", "").lower() == "torch":
            _kernel_state.update(lib=None, why="ACCUCHECK_STATS_KERNEL=torch")
        else:
            try:
                _kernel_state.update(lib=_build(), why="")
            except Exception as e:  # no compiler, read-only cache, ...: the torch path works
                _kernel_state.update(lib=None, why=f"{type(e).__name__}: {e}"[:300])
    return _kernel_state["lib"]


def kernel_status() -> dict:
    """What the CPU statistics use, for a capture's meta: {"cpu": "c" | "torch", "why": ...}."""
    lib = c_kernel()
    return {"cpu": "c" if lib is not None else "torch",
            **({"why": _kernel_state["why"]} if lib is None else {})}


# -- torch kernels ---------------------------------------------------------------------------
_sample_idx: dict[tuple, torch.Tensor] = {}


def _sample_index(n: int, device: torch.device) -> torch.Tensor:
    key = (n, str(device))
    idx = _sample_idx.get(key)
    if idx is None:
        idx = torch.arange(SAMPLE_SIZE, device=device) * (n - 1) // (SAMPLE_SIZE - 1)
        if len(_sample_idx) > 256:
            _sample_idx.clear()
        _sample_idx[key] = idx
    return idx


def _packed_rows(x: torch.Tensor, exact: bool, sketch: bool = True) -> torch.Tensor:
    """Statistics of each row of the 2-D tensor `x` as a float64 [rows, RAW_SIZE] tensor on its
    device, "packed": column 6 holds the NON-zero count and column 7 the raw int64 bit-pattern
    sum (its bits, `.view(int64)`), so both stay exact; `_unpack` makes the stored row. Without
    `exact`, NaN / Inf counts are 0 and the non-zero count is NaN-poisoned (sign trick): valid
    for rows whose min and max are finite, the others are recounted (`_recount`). About 15
    kernels, whatever the number of rows."""
    r, n = x.shape
    f64 = torch.float64
    acc = torch.float32 if x.element_size() == 2 else x.dtype
    vals = torch.stack([x.amin(1).to(acc), x.amax(1).to(acc), x.sum(1, dtype=acc),
                        torch.linalg.vector_norm(x, dim=1, dtype=acc)], 1)
    if exact:
        counts = torch.stack([torch.isnan(x).sum(1), torch.isinf(x).sum(1),
                              torch.count_nonzero(x, dim=1)], 1).to(f64)
    else:
        nonzero = torch.sgn(x).abs_().sum(1, dtype=acc) \
            if n < (1 << 24) or acc == f64 else torch.count_nonzero(x, dim=1)  # exact sums
        counts = torch.cat([vals.new_zeros((r, 2), dtype=f64), nonzero.to(f64)[:, None]], 1)
    bits = x.view(_BITS[x.element_size()]).sum(1).view(f64)[:, None]
    if n >= SAMPLE_SIZE:
        sample = x.index_select(1, _sample_index(n, x.device)).to(f64)
    else:
        sample = torch.cat([x.to(f64), x.new_full((r, SAMPLE_SIZE - n), float("nan"),
                                                  dtype=f64)], 1)
    sk = _sketch_rows(x) if sketch else x.new_full((r, SKETCH_WIDTH), float("nan"), dtype=f64)
    return torch.cat([vals.to(f64), counts, bits, sample, sk], 1)


_sketch_tables: dict[str, tuple[torch.Tensor, ...]] = {}
_sketch_pos: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
SKETCH_CHUNK = 1 << 22  # float64 elements per piece of the sketch's computation


def _sketch_positions(c: int, m: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Bucket (int64) and sign (float64) of flat positions c..c+m-1 on `device` (cached for
    the first SKETCH_CHUNK positions: every tensor's first piece)."""
    key = (m, str(device))
    got = _sketch_pos.get(key) if c == 0 else None
    if got is not None:
        return got
    t = _sketch_tables.get(str(device))
    if t is None:
        t = _sketch_tables[str(device)] = tuple(torch.as_tensor(a, device=device)
                                                for a in sketch_tables())
    g, h, sl, sh = t
    i = torch.arange(c, c + m, device=device)
    hi = (i >> 16) & 65535
    got = ((i & 127) ^ g[(i >> 7) & 511] ^ h[hi], sl[i & 65535] * sh[hi])
    if c == 0:
        if len(_sketch_pos) > 64:
            _sketch_pos.clear()
        _sketch_pos[key] = got
    return got


_sketch_on_host: set[str] = set()  # device types whose float64 kernels failed: sketch on the CPU


def _sketch_rows(x: torch.Tensor) -> torch.Tensor:
    """The sketch rows (accucheck.store.sketch) of each row of the 2-D float tensor `x`, as a
    float64 [rows, SKETCH_WIDTH] tensor on its device: in float64 (a float32 sketch would be
    noisier than two float32 runs' difference), in pieces of SKETCH_CHUNK elements, about ten
    kernels per piece. A row holding a NaN or an Inf comes out NaN. A device whose float64
    kernels fail (an NPU without one of them) has its rows copied to the CPU for the sketch,
    from the first failure on: slower, never a failed capture."""
    kind = x.device.type
    if kind != "cpu" and kind not in _sketch_on_host:
        try:
            return _sketch_device(x)
        except (RuntimeError, TypeError, NotImplementedError):
            _sketch_on_host.add(kind)
    if kind != "cpu":
        return _sketch_device(x.cpu()).to(x.device)
    return _sketch_device(x)


def _sketch_device(x: torch.Tensor) -> torch.Tensor:
    r, n = x.shape
    f64 = torch.float64
    cols = max(1, min(n, SKETCH_CHUNK))
    rows = max(1, SKETCH_CHUNK // cols)
    out = torch.empty((r, SKETCH_WIDTH), dtype=f64, device=x.device)
    for a in range(0, r, rows):
        xa = x[a:a + rows]
        rms = torch.linalg.vector_norm(xa, dim=1, dtype=f64) / math.sqrt(n)
        ok = rms > 0
        e = torch.where(ok, torch.floor(torch.log2(SKETCH_FLOOR * rms)), 0.0)
        inv = torch.where(ok, torch.exp2(-e), 0.0)[:, None]
        acc = torch.zeros((len(xa), SKETCH_WIDTH - 1), dtype=f64, device=x.device)
        for c in range(0, n, cols):
            v = xa[:, c:c + cols].to(f64)
            bucket, sign = _sketch_positions(c, v.shape[1], x.device)
            z = torch.log1p_(v.abs().mul_(inv)).copysign_(v).mul_(sign)
            acc.index_add_(1, bucket, z)
        out[a:a + rows, 0] = e
        out[a:a + rows, 1:] = torch.where(torch.isfinite(rms)[:, None], acc, float("nan"))
    return out


def _unpack(packed: np.ndarray, n: int) -> np.ndarray:
    """Stored raw rows (recorder.tensor_stats layout) from packed host rows of n-element tensors."""
    raw = packed.copy()
    raw[:, 6] = n - packed[:, 6]
    raw[:, 7] = np.mod(packed.view(np.int64)[:, 7], _MOD52).astype(np.float64)
    return raw


def _bad(raw: np.ndarray) -> np.ndarray:
    """Rows that may hold a NaN or an Inf: min or max not finite."""
    return ~(np.isfinite(raw[:, 0]) & np.isfinite(raw[:, 1]))


def _recount(x: torch.Tensor) -> torch.Tensor:
    """Exact NaN, Inf and zero counts of each row of `x` (the rows `_bad` flags)."""
    return torch.stack([torch.isnan(x).sum(1), torch.isinf(x).sum(1), (x == 0).sum(1)], 1)


def _no_modes():
    """Statistics are not ops of the model: run them below any Python dispatch mode (the op
    recorder's, a planted op fault's)."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


class _Chunk:
    """A staging buffer: `used` rows of `numel` elements, each a recorded tensor's copy."""

    __slots__ = ("buf", "rows", "used", "index", "shapes")

    def __init__(self, cap: int, numel: int, dtype: torch.dtype, device: torch.device):
        with torch.inference_mode(False):
            self.buf = torch.empty((cap, numel), dtype=dtype, device=device)
        self.rows = self.buf.unbind(0)
        self.used = 0
        self.index: list[int] = []
        self.shapes: list[tuple[int, ...]] = []


class StepStats:
    """Statistics of one step's tensors (see the module docstring). Per step: `add` each tensor
    (returns its row number), then `compute()` once: the raw rows (recorder.tensor_stats
    layout) in `add` order and, with `keep`, each tensor's host copy in its stored
    representation (recorder.to_host), then the engine is ready for the next step.

    keep: full mode: every tensor's values are kept (CPU: a copy at `add`; accelerators: the
    staged copies, moved to the host with the statistics).
    kernel: "c" or "torch" for CPU tensors (default: "c" when the C kernel builds).
    sketch: compute each tensor's sketch row (accucheck.store.sketch; default: in stats mode,
    not with `keep`, where the tensors themselves are stored); else it is NaN.
    """

    def __init__(self, *, keep: bool = False, kernel: str | None = None,
                 stage_bytes: int = STAGE_BYTES, stage_numel_cpu: int = STAGE_NUMEL_CPU,
                 sketch: bool | None = None):
        if kernel not in (None, "c", "torch"):
            raise ValueError(f"kernel must be 'c' or 'torch', not {kernel!r}")
        lib = c_kernel() if kernel != "torch" else None
        if kernel == "c" and lib is None:
            raise RuntimeError(f"no C statistics kernel: {kernel_status().get('why')}")
        self._c = lib.fns if lib is not None else {}
        self.kernel = "c" if lib is not None else "torch"
        self.keep = keep
        self.sketch = not keep if sketch is None else sketch
        self.stage_bytes = stage_bytes
        self.stage_numel_cpu = stage_numel_cpu
        self._raw = np.empty((0, RAW_SIZE))
        self._cap = 0
        self._base = 0
        self._n = 0
        self._hosts: list = []
        self._groups: dict[tuple, list[_Chunk]] = {}
        self._staged = 0
        self._direct: list[tuple[int, int, torch.Tensor, bool]] = []  # index, numel, packed, exact

    # -- adding --------------------------------------------------------------------------
    def _grow(self) -> None:
        grown = np.empty((max(64, 2 * self._cap), RAW_SIZE))
        grown[:self._n] = self._raw[:self._n]
        self._raw = grown
        self._cap = len(grown)
        self._base = grown.__array_interface__["data"][0]

    def _row(self) -> int:
        i = self._n
        if i == self._cap:
            self._grow()
        self._n = i + 1
        if self.keep:
            self._hosts.append(None)
        return i

    def add(self, t: torch.Tensor) -> int:
        """Take `t` into this step's statistics; returns its row number. `t` may change after
        this call (what was taken is a copy, or already reduced)."""
        if _dispatch_depth():
            with _no_modes():
                return self._add(t)
        # the common case first: a CPU tensor the C kernel reduces in place (stats mode)
        fn = self._c.get(t.dtype) if t.is_cpu and not self.keep else None
        if fn is not None:
            n = t.numel()
            if n:
                i = self._n
                if i == self._cap:
                    self._grow()
                self._n = i + 1
                if not t.is_contiguous():
                    t = t.contiguous()
                fn(t.data_ptr(), n, self._base + i * _ROW_BYTES, self.sketch)
                return i
        return self._add(t)

    def _add(self, t: torch.Tensor) -> int:
        if t.requires_grad:
            t = t.detach()
        i = self._row()
        n = t.numel()
        dtype = t.dtype
        if n == 0 or dtype not in _FLOATS:
            self._raw[i] = _legacy_row(t)
            if self.keep:
                self._hosts[i] = _to_host(t)
            return i
        cpu = t.is_cpu
        fn = self._c.get(dtype) if cpu else None
        if fn is not None:
            if self.keep:
                host = _to_host(t)
                self._hosts[i] = host
                src = host.ctypes.data
            else:
                if not t.is_contiguous():
                    t = t.contiguous()
                src = t.data_ptr()
            fn(src, n, self._base + i * _ROW_BYTES, self.sketch)
            return i
        nbytes = n * t.element_size()
        if nbytes > self.stage_bytes or (cpu and n > self.stage_numel_cpu):
            self._reduce_now(i, t, cpu)
            return i
        if self._staged + nbytes > self.stage_bytes:
            self._reduce_staged()
        key = (t.device, dtype, n)
        chunks = self._groups.get(key)
        if chunks is None:
            chunks = self._groups[key] = [_Chunk(8, n, dtype, t.device)]
        c = chunks[-1]
        if c.used == len(c.rows):
            c = _Chunk(2 * len(c.rows), n, dtype, t.device)
            chunks.append(c)
        c.rows[c.used].view(t.shape).copy_(t)
        c.used += 1
        c.index.append(i)
        if self.keep:
            c.shapes.append(tuple(t.shape))
        self._staged += nbytes
        return i

    def _reduce_now(self, i: int, t: torch.Tensor, cpu: bool) -> None:
        """A tensor too large to stage: reduced on its own now (exact counts right away on the
        CPU, where reading the result costs nothing; unconditionally elsewhere)."""
        x = t.reshape(1, -1)
        n = x.shape[1]
        if self.keep:
            self._hosts[i] = _to_host(t)
        if not cpu:
            self._direct.append((i, n, _packed_rows(x, True, self.sketch), True))
            return
        raw = _unpack(_packed_rows(x, False, self.sketch).numpy(), n)
        if _bad(raw)[0]:
            raw[0, 4:7] = _recount(x)[0].numpy()
        self._raw[i] = raw[0]

    def now(self, t: torch.Tensor) -> np.ndarray:
        """The raw row of one tensor, computed and moved to the host at once (weights: once
        per capture; no sketch). Does not touch the step's rows."""
        with _no_modes():
            t = t.detach()
            if t.numel() == 0 or t.dtype not in _FLOATS:
                return _legacy_row(t)
            fn = self._c.get(t.dtype) if t.is_cpu else None
            if fn is not None:
                row = np.empty(RAW_SIZE)
                fn(t.contiguous().data_ptr(), t.numel(), row.ctypes.data, 0)
                return row
            x = t.reshape(1, -1)
            return _unpack(_packed_rows(x, True, False).cpu().numpy(), x.shape[1])[0]

    # -- computing -----------------------------------------------------------------------
    def _reduce_staged(self) -> None:
        """Reduce every staged row and pending large tensor: one transfer to the host (plus a
        small one when some rows hold NaN / Inf), then the staging buffers are free again."""
        parts: list[tuple[list[int], int, torch.Tensor, bool, _Chunk | None]] = []
        for chunks in self._groups.values():
            for c in chunks:
                if c.used:
                    parts.append((c.index, c.buf.shape[1],
                                  _packed_rows(c.buf[:c.used], False, self.sketch),
                                  False, c))
        for i, n, packed, exact in self._direct:
            parts.append(([i], n, packed, exact, None))
        self._direct = []
        if not parts:
            return
        host = _transfer(torch.cat([p[2] for p in parts]))  # the one transfer
        at = 0
        recount = []
        for index, n, packed, exact, c in parts:
            raw = _unpack(host[at:at + len(index)], n)
            at += len(index)
            if not exact:
                bad = np.flatnonzero(_bad(raw))
                if bad.size:
                    recount.append((raw, bad, c))
            self._raw[index] = raw
        for raw, bad, c in recount:  # rare: rows holding NaN / Inf
            counts = _transfer(_recount(c.buf[torch.as_tensor(bad, device=c.buf.device)]))
            rows = np.asarray(c.index)[bad]
            self._raw[rows, 4:7] = counts
        for chunks in self._groups.values():
            for c in chunks:
                if c.used and self.keep:
                    hb = c.buf[:c.used].cpu()  # the CPU buffer itself on the CPU
                    for j, (i, shape) in enumerate(zip(c.index, c.shapes)):
                        self._hosts[i] = _host_view(hb[j].view(shape))
                c.used = 0
                c.index = []
                c.shapes = []
            if self.keep and chunks and chunks[0].buf.device.type == "cpu":
                # the host copies ARE these buffers: never reused; fresh ones, as large
                cap = sum(len(c.rows) for c in chunks)
                c0 = chunks[0]
                chunks[:] = [_Chunk(cap, c0.buf.shape[1], c0.buf.dtype, c0.buf.device)]
        self._staged = 0

    def compute(self) -> tuple[np.ndarray, list]:
        """This step's raw rows ([n, RAW_SIZE] float64, `add` order) and host copies (with
        `keep`; else an empty list). Resets for the next step."""
        with _no_modes():
            self._reduce_staged()
        raw = self._raw[:self._n].copy()
        hosts = self._hosts
        self._n = 0
        self._hosts = []
        for key, chunks in list(self._groups.items()):
            if len(chunks) > 1:  # next step: one buffer as large as this step needed
                cap = sum(len(c.rows) for c in chunks)
                n = chunks[0].buf.shape[1]
                self._groups[key] = [_Chunk(cap, n, key[1], key[0])]
            elif not chunks:
                del self._groups[key]
        return raw, hosts


def tensor_stats(t: torch.Tensor) -> torch.Tensor:
    """Raw statistics [min, max, sum, l2, nan, inf, zero, checksum] followed by SAMPLE_SIZE
    values at fixed positions (accucheck.store, /index/sample), as one float64 tensor on t's device: a
    few fused reductions and one gather, no host sync. `finish_stats` turns the row into the
    stored one on the host. With NaN/Inf present, min..l2 are NaN-poisoned here (the counts are
    exact); `finish_stats` recomputes them over the finite values when the tensor is at hand."""
    x = t.detach()
    xf = x if x.dtype in (torch.float32, torch.float64) else x.to(torch.float32)
    n = xf.numel()
    if n:
        mn, mx = torch.aminmax(xf)
    else:
        mn = mx = xf.sum()
    bits = x.view(_BITS[x.element_size()]) if x.is_floating_point() else x
    vals = torch.stack([mn, mx, xf.sum(), torch.linalg.vector_norm(xf)]).to(torch.float64)
    counts = torch.stack([torch.isnan(xf).sum(), torch.isinf(xf).sum(), (xf == 0).sum(),
                          torch.remainder(bits.sum(), 2**52)]).to(torch.float64)
    flat = xf.reshape(-1)
    if n >= SAMPLE_SIZE:
        idx = torch.arange(SAMPLE_SIZE, device=xf.device) * (n - 1) // (SAMPLE_SIZE - 1)
        sample = flat[idx].to(torch.float64)
    else:
        sample = torch.cat([flat.to(torch.float64),
                            torch.full((SAMPLE_SIZE - n,), float("nan"), dtype=torch.float64,
                                       device=xf.device)])
    if x.is_floating_point() and n:
        sketch = _sketch_rows(xf.reshape(1, -1))[0]
    else:  # integers, bool, empty: no sketch (their errors are not relative ones)
        sketch = torch.full((SKETCH_WIDTH,), float("nan"), dtype=torch.float64,
                            device=xf.device)
    return torch.cat([vals, counts, sample, sketch])


def to_host(t: torch.Tensor) -> tuple[np.ndarray, str]:
    """Copy to a numpy array in the stored representation (bfloat16 -> uint16 bits)."""
    x = t.detach().to("cpu", copy=True).contiguous()
    dtype = str(x.dtype).replace("torch.", "")
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16).numpy().view(np.uint16), dtype
    return x.numpy(), dtype


def _transfer(x: torch.Tensor) -> np.ndarray:
    """Device -> host (nothing to move on the CPU): the step's statistics, once."""
    return x.cpu().numpy()


def _legacy_row(t: torch.Tensor) -> np.ndarray:
    return tensor_stats(t).cpu().numpy()


def _host_view(x: torch.Tensor) -> np.ndarray:
    """A CPU tensor as numpy in the stored representation (bfloat16 -> uint16 bits), no copy."""
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16).numpy().view(np.uint16)
    return x.numpy()


_NUMPY = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16,
          torch.bfloat16: np.uint16}


def _to_host(t: torch.Tensor) -> np.ndarray:
    """A copy of `t` in the stored representation (recorder.to_host): for a CPU float tensor
    one copy kernel into a new numpy array."""
    np_dtype = _NUMPY.get(t.dtype) if t.is_cpu else None
    if np_dtype is None:
        return to_host(t)[0]
    arr = np.empty(tuple(t.shape), dtype=np_dtype)
    dst = torch.from_numpy(arr)
    (dst.view(torch.bfloat16) if t.dtype == torch.bfloat16 else dst).copy_(t)
    return arr


def tensor_rows(tensors: Sequence[torch.Tensor], **kw) -> np.ndarray:
    """Raw rows of several tensors at once (one step of their own)."""
    eng = StepStats(**kw)
    for t in tensors:
        eng.add(t)
    return eng.compute()[0]


WEIGHT_SAMPLES = 8  # values per weight in a capture's meta "weights" (every 8th statistics sample)
_CASTS = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def weight_table(model: torch.nn.Module) -> dict:
    """The capture's meta "weights": for every parameter and buffer (tied ones once, under
    their first name) {"dtype", "shape", "checksum": the bit-pattern sum mod 2**52 (exact, like
    a record's), "cast": {"bfloat16": ..., "float16": ...} the checksums of the weight cast to
    those dtypes (float weights of another dtype; how a float32 and a bfloat16 copy of one
    checkpoint are compared exactly), "sample": WEIGHT_SAMPLES values at fixed flat positions
    (null past the end and for NaN / Inf)}. A few statistics passes per weight, once per
    capture. accucheck.compare.weights compares two tables by name: a candidate that runs other
    weights than the reference is said so by `diff`."""
    return weight_entries((*model.named_parameters(), *model.named_buffers()))


def weight_entries(named, samples: bool = True) -> dict:
    """`weight_table` of (name, tensor) pairs (a vLLM worker's parts of its fused weights under
    transformers' names, accucheck.capture.runners.vllm_plugin); `samples` False: "sample" left out
    (a tensor-parallel rank's part samples other positions than the whole weight)."""
    eng = StepStats()
    out: dict[str, dict] = {}
    with torch.no_grad():
        for name, t in named:
            if t.numel() == 0 or name in out:
                continue
            raw = eng.now(t.contiguous())
            sample = raw[8::SAMPLE_SIZE // WEIGHT_SAMPLES][:WEIGHT_SAMPLES]
            entry = {"dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape),
                     "checksum": int(raw[7])}
            if samples:
                entry["sample"] = [float(v) if np.isfinite(v) else None for v in sample]
            if t.is_floating_point():
                entry["cast"] = {k: int(raw[7]) if t.dtype == dt else
                                 int(eng.now(t.contiguous().to(dt))[7])
                                 for k, dt in _CASTS.items()}
            out[name] = entry
    return out
