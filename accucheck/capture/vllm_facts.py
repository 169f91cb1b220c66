"""What each vLLM worker says about itself, and what the front end does with it: the device it
runs on and its sampler's logprobs mode. Imports accucheck.capture.device and
accucheck.errors; torch lazily (worker side).

Why from the workers: the front end is not where the model runs. vLLM's workers are other
processes (the engine core, one per tensor-parallel rank); asking the device its name in the
front end initialises the device runtime in a process that is no rank (device.fingerprint);
and the platform's sampler may not use the engine's logprobs_mode (vllm-ascend's AscendSampler
is built without it and defaults to raw_logprobs).
"""
from __future__ import annotations

from accucheck.capture import device as dev
from accucheck.errors import UserError

WANTED_LOGPROBS_MODE = "raw_logits"  # what vllm_runner asks the engine for


def _name(value) -> str | int | None:
    """An enum as its name (CompilationMode.VLLM_COMPILE -> "VLLM_COMPILE"), else as is."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(getattr(value, "name", value))


def worker_facts(runner) -> dict:
    """This worker's facts (JSON-ready): "device", "sampler"."""
    device = getattr(runner, "device", None)
    kind = getattr(device, "type", None) or "cpu"
    try:
        facts = dev.device_facts(kind, getattr(device, "index", None))
    except Exception as e:  # a fact, never a reason to lose the records
        facts = {"error": f"{type(e).__name__}: {e}"}
    return {"device": {"device": str(device) if device is not None else None, **facts},
            "sampler": sampler_facts(runner)}








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
