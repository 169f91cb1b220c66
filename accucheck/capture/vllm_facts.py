"""What each vLLM worker says about itself, and what the front end does with it: the device it
runs on, the determinism and the compile / graph state it actually has, its sampler's logprobs
mode. Imports accucheck.capture.device and accucheck.errors; torch lazily (worker side).

Why from the workers: the front end is not where the model runs. vLLM's workers are other
processes (the engine core, one per tensor-parallel rank) with their own environment and torch
state, so a flag the front end set (torch.use_deterministic_algorithms) or saw may not hold
there; asking the device its name in the front end initialises the device runtime in a process
that is no rank (device.fingerprint); and the platform's sampler may not use the engine's
logprobs_mode (vllm-ascend's AscendSampler is built without it and defaults to raw_logprobs).
"""
from __future__ import annotations

import os

from accucheck.capture import device as dev
from accucheck.errors import UserError

# deterministic switches each worker reports as it sees them (cuBLAS workspace, HCCL / LCCL
# reduction order, ATB's shuffled-K matmul and LCOC overlap, vLLM's batch invariance)
DETERMINISM_ENV = ("CUBLAS_WORKSPACE_CONFIG", "HCCL_DETERMINISTIC", "LCCL_DETERMINISTIC",
                   "ATB_MATMUL_SHUFFLE_K_ENABLE", "ATB_LLM_LCOC_ENABLE", "VLLM_BATCH_INVARIANT")
WANTED_LOGPROBS_MODE = "raw_logits"  # what vllm_runner asks the engine for


def _name(value) -> str | int | None:
    """An enum as its name (CompilationMode.VLLM_COMPILE -> "VLLM_COMPILE"), else as is."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(getattr(value, "name", value))


def model_of(runner):
    """The runner's model as the nn.Module whose module tree the taps walk: `get_model()`
    where the runner has it, else `runner.model`. In graph mode `runner.model` can be a
    wrapper that is no nn.Module: vLLM's GPUModelRunner.get_model unwraps CUDAGraphWrapper,
    UBatchWrapper and BreakableCUDAGraphWrapper (vLLM 0.32), vllm-ascend's NPUModelRunner its
    ACLGraphWrapper; CPUModelRunner returns the model as is."""
    get_model = getattr(runner, "get_model", None)
    return get_model() if callable(get_model) else runner.model


def worker_facts(runner) -> dict:
    """This worker's facts (JSON-ready): "device", "determinism", "compilation", "sampler"."""
    device = getattr(runner, "device", None)
    kind = getattr(device, "type", None) or "cpu"
    try:
        facts = dev.device_facts(kind, getattr(device, "index", None))
    except Exception as e:  # a fact, never a reason to lose the records
        facts = {"error": f"{type(e).__name__}: {e}"}
    return {"device": {"device": str(device) if device is not None else None, **facts},
            "determinism": determinism_facts(),
            "compilation": compilation_facts(runner),
            "sampler": sampler_facts(runner)}


def determinism_facts() -> dict:
    """DETERMINISM_ENV as this process has them (absent: not set) and whether torch's
    deterministic algorithms are on here."""
    import torch

    return {"env": {k: os.environ[k] for k in DETERMINISM_ENV if k in os.environ},
            "torch.are_deterministic_algorithms_enabled":
                bool(torch.are_deterministic_algorithms_enabled())}


def compilation_facts(runner) -> dict:
    """The engine's compile / graph state as the runner's vllm_config holds it (vLLM's
    CompilationConfig: `mode`, or `level` before vLLM 0.11; `cudagraph_mode`; `backend`) and
    the attention backend(s) the runner built (None where not reachable)."""
    config = getattr(runner, "vllm_config", None)
    comp = getattr(config, "compilation_config", None)
    out = {k: _name(getattr(comp, k, None)) for k in ("mode", "level", "cudagraph_mode",
                                                       "backend")}
    out["enforce_eager"] = _name(getattr(getattr(config, "model_config", None),
                                         "enforce_eager", None))
    out["attention_backend"] = attention_backends(runner)
    return out


def attention_backends(runner) -> list[str] | None:
    """Names of the attention backends of the runner's KV-cache groups (`attn_groups`, built
    when the KV cache is), else the configured one (attention_config.backend), else None."""
    names = set()
    for groups in getattr(runner, "attn_groups", None) or ():
        for group in groups or ():
            backend = getattr(group, "backend", None)
            try:
                names.add(str(backend.get_name()))
            except Exception:
                if backend is not None:
                    names.add(getattr(backend, "__name__", type(backend).__name__))
    if names:
        return sorted(names)
    configured = getattr(getattr(getattr(runner, "vllm_config", None), "attention_config",
                                 None), "backend", None)
    return [str(_name(configured))] if configured is not None else None


def sampler_facts(runner) -> dict | None:
    """The runner's sampler class and its `logprobs_mode` (None where it has none)."""
    sampler = getattr(runner, "sampler", None)
    if sampler is None:
        return None
    mode = getattr(sampler, "logprobs_mode", None)
    return {"class": type(sampler).__name__,
            "logprobs_mode": None if mode is None else str(_name(mode))}


def refuse_sampler_mode(infos: dict[int, dict], want: str = WANTED_LOGPROBS_MODE) -> None:
    """UserError naming the sampler class when a worker's sampler computes another
    logprobs_mode than `want`: its "logits" would be log-probabilities (or processed
    logits), and a diff would blame the model. Checked before generating; a sampler that
    does not say is left to `vllm_runner.check_raw_logits` on the rows."""
    for rank, info in sorted(infos.items()):
        sampler = (info.get("facts") or {}).get("sampler") or {}
        mode = sampler.get("logprobs_mode")
        if mode is not None and mode != want:
            raise UserError(f"rank {rank}'s sampler {sampler.get('class')} computes "
                            f"logprobs_mode={mode}, not the {want} the capture asked the engine "
                            f"for (vllm-ascend's AscendSampler ignores the engine's "
                            f"logprobs_mode): its logits would not be the model's; refused")


def workers_meta(infos: dict[int, dict]) -> dict:
    """Meta "workers": each attached rank's facts, by rank."""
    return {str(r): info["facts"] for r, info in sorted(infos.items())
            if info.get("attached") and info.get("facts")}


def vllm_environment(environment: dict, infos: dict[int, dict]) -> dict:
    """The front end's fingerprint (made with query_device=False) with the device facts of
    the lowest attached rank that reported them, and where they come from."""
    for r, info in sorted(infos.items()):
        device = (info.get("facts") or {}).get("device")
        if info.get("attached") and device:
            facts = {k: v for k, v in device.items() if k != "device"}
            return {**environment, **facts, "device_source": f"vLLM worker rank {r} "
                                                             f"({device.get('device')})"}
    return environment
