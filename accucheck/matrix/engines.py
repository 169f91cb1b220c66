"""Running the matrix's runs: the request logits of every run, on vLLM or transformers.

Every run gives, per request of interest, its raw full-vocabulary logits at each generating
position ([steps, vocab]: step 0 = the last prompt position, step k = after the k-th token),
the baseline greedy, every other run teacher-forced to the baseline's tokens. Runs share one
engine where the knob allows it: batch composition runs in the baseline's engine (each request
submitted alone, or with its fillers, in one generate call); `enable_prefix_caching=true` and
`warm` are the first and second pass of the prompts in one engine with the cache. A run whose
settings the engine refuses is reported ("cannot be set on this engine"), the others go on.
Every vLLM engine runs in a process of its own (matrix.vllm_worker: why, there); the HF runner
runs in this process.

Imports capture (vLLM only in the worker); the knobs are matrix.knobs.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from accucheck.capture import device as dev
from accucheck.errors import UserError, one_line
from accucheck.matrix.knobs import ENGINE_PREFIX, ENV_PREFIX, RunSpec

Progress = Callable[[str], None]
# The environment of every vLLM engine the matrix starts (a knob may override it). The engine
# core runs in the engine's process (matrix.vllm_worker), not one of its own: every request of a generate call is then added before the first
# step, so a batch holds exactly the requests the knob says (vLLM's own engine-core process
# starts stepping as soon as the first request arrives: the request could prefill alone).
VLLM_ENV = {"VLLM_USE_V2_MODEL_RUNNER": "0", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
# engine settings of the baseline where the engine's default would hide a knob's effect
_BASELINE_ENGINE = {"enforce_eager": True, "enable_prefix_caching": False,
                    "async_scheduling": False, "tensor_parallel_size": 1}


@dataclass
class RunResult:
    spec: RunSpec
    logits: dict[int, np.ndarray] = field(default_factory=dict)   # request -> [steps, vocab]
    tokens: dict[int, list[int]] = field(default_factory=dict)    # request -> generated ids
    cached: dict[int, int] = field(default_factory=dict)          # request -> cached tokens
    error: str | None = None       # the engine refused the settings (one line)
    engine: int | None = None      # which engine start ran it (index into Matrix.engines)
    seconds: float = 0.0


@dataclass
class EngineStart:
    settings: dict
    env: dict
    seconds: float
    runs: list[str]


def fillers(prompts: Sequence[Sequence[int]], r: int, n: int) -> list[list[int]]:
    """`n` filler requests for request `r`: token ids cycled from all the prompts, of lengths
    other than request r's (len + 3, + 6, ...), so a batch holds ragged rows."""
    pool = [t for p in prompts for t in p] or [0]
    base = len(prompts[r])
    out = []
    for i in range(n):
        length = base + 3 * (i + 1)
        start = (7 * (i + 1) + r) % len(pool)
        out.append([pool[(start + j) % len(pool)] for j in range(length)])
    return out


def split(spec: RunSpec, baseline_dtype: str) -> tuple[dict, dict, int, str | None]:
    """(engine settings, environment, batch size, prefix-cache pass) of one run."""
    settings: dict = {"dtype": baseline_dtype}
    env: dict = {}
    batch, cache_pass = 1, None
    for name, value in spec.flips:
        if name == "batch_size":
            batch = int(value)
        elif name == "enable_prefix_caching":
            settings["enable_prefix_caching"] = value in (True, "warm")
            cache_pass = "warm" if value == "warm" else "cold" if value else None
        elif name.startswith(ENGINE_PREFIX):
            settings[name[len(ENGINE_PREFIX):]] = value
        elif name.startswith(ENV_PREFIX):
            env[name[len(ENV_PREFIX):]] = str(value)
        else:
            settings[name] = value
    return settings, env, batch, cache_pass


def _groups(runs: Sequence[RunSpec], dtype: str) -> list[tuple[dict, dict, list[RunSpec]]]:
    """Runs grouped by the engine they can share, in the order given (the baseline first). An
    engine with the prefix cache is shared only by the cold / warm runs of one batch size."""
    groups: dict[str, tuple[dict, dict, list[RunSpec]]] = {}
    for spec in runs:
        settings, env, batch, cache_pass = split(spec, dtype)
        key = json.dumps([settings, env, batch if cache_pass else None], sort_keys=True,
                         default=str)
        groups.setdefault(key, (settings, env, []))[2].append(spec)
    return list(groups.values())


# -- vLLM ---------------------------------------------------------------------------------
def check_engine_knobs(names: Sequence[str]) -> None:
    """`engine:NAME` knobs name vLLM engine arguments (fields of vllm's EngineArgs): a usage
    error (exit 2) before any engine starts; nothing to check when vLLM does not import."""
    wanted = [n[len(ENGINE_PREFIX):] for n in names if n.startswith(ENGINE_PREFIX)]
    if not wanted:
        return
    try:
        from dataclasses import fields

        from vllm.engine.arg_utils import EngineArgs
    except ImportError:
        return
    known = {f.name for f in fields(EngineArgs)}
    for n in wanted:
        if n not in known:
            raise UserError.usage(f"--knob {ENGINE_PREFIX}{n}: not an engine argument of this "
                                  f"vLLM (vllm.engine.arg_utils.EngineArgs)")


def vllm_runs(model_dir: Path, prompt_ids: list[list[int]], runs: Sequence[RunSpec], *,
              dtype: str, n_new: int, seed: int, device: str, engine_args: dict,
              progress: Progress) -> tuple[list[RunResult], list[EngineStart]]:
    """Every engine group in a process of its own (matrix.vllm_worker), the baseline's first."""
    from accucheck.capture.runners.vllm import FORCE_TOKENS, cpu_binding

    spec_dev = dev.parse_device(device)
    batches = [split(s, dtype)[2] for s in runs]
    longest = max(len(p) for p in prompt_ids) + 3 * (max(batches) - 1)
    total = sum(len(p) for p in prompt_ids) + sum(len(f) for r in range(len(prompt_ids))
                                                   for f in fillers(prompt_ids, r,
                                                                    max(batches) - 1))
    base_kw = dict(model=str(model_dir), tokenizer=str(model_dir), seed=seed,
                   max_model_len=longest + n_new + 2, max_logprobs=-1,
                   logprobs_mode="raw_logits", logits_processors=[FORCE_TOKENS],
                   max_num_batched_tokens=max(256, total), **_BASELINE_ENGINE)
    base_kw.update(engine_args)
    results = {s.label: RunResult(s) for s in runs}
    baseline_tokens: dict[int, list[int]] = {}
    starts: list[EngineStart] = []
    for settings, env, specs in _groups(runs, dtype):
        kw = {**base_kw, **settings}
        labels = [s.label for s in specs]
        tp = int(kw.get("tensor_parallel_size", 1) or 1)
        run_env = dict(VLLM_ENV)
        if spec_dev.kind == "cpu" and tp > 1 and not os.environ.get("VLLM_CPU_OMP_THREADS_BIND"):
            run_env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_binding(tp)
        run_env.update(env)
        progress(f"matrix: engine {len(starts) + 1}: starting for {', '.join(labels)}")
        job = {"kind": "runs", "engine": kw, "prompt_ids": prompt_ids, "n_new": n_new,
               "dtype": dtype, "seed": seed, "device": device,
               "specs": [[s.label, [list(f) for f in s.flips]] for s in specs],
               "checked": settings,
               "baseline_tokens": baseline_tokens}
        doc, arrays = run_worker(job, run_env)
        if doc.get("start_s") is not None:
            starts.append(EngineStart({k: v for k, v in kw.items() if k != "logits_processors"},
                                      env, doc["start_s"], labels))
        if "baseline" in labels and (doc.get("error") or doc["runs"]["baseline"]["error"]):
            raise UserError(f"the vLLM engine failed with the baseline settings "
                            f"({doc.get('error')})")
        baseline_tokens.update({int(r): t for r, t in doc.get("baseline_tokens", {}).items()})
        for i, s in enumerate(specs):
            res, got = results[s.label], doc.get("runs", {}).get(s.label)
            res.engine = len(starts) - 1 if doc.get("start_s") is not None else None
            res.error = got["error"] if got else doc.get("error")
            if res.error is None:
                res.tokens = {int(r): t for r, t in got["tokens"].items()}
                res.cached = {int(r): c for r, c in got["cached"].items()}
                res.logits = {r: arrays[f"{i}_{r}"] for r in range(len(prompt_ids))}
                res.seconds = got["seconds"]
        if doc.get("error"):
            progress(f"matrix: {', '.join(labels)}: {doc['error']}")
    return [results[s.label] for s in runs], starts


def run_worker(job: dict, env: dict) -> tuple[dict, dict[str, np.ndarray]]:
    """`job` in a fresh Python process (matrix.vllm_worker) with `env` added to this one's
    environment: (its result document, its arrays). A UserError of the job is raised here; a
    process that ended without a result is an error in the document."""
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory(prefix="accucheck-matrix-") as tmp:
        tmpd = Path(tmp)
        (tmpd / "job.json").write_text(json.dumps(job, default=str))
        proc = subprocess.run([sys.executable, "-m", "accucheck.matrix.vllm_worker",
                               str(tmpd / "job.json"), str(tmpd)],
                              env={**os.environ, **env}, stdin=subprocess.DEVNULL)
        if not (tmpd / "result.json").is_file():
            return {"error": f"the engine's process ended with exit code {proc.returncode} "
                             f"and no result (vLLM's log above says why)", "runs": {}}, {}
        doc = json.loads((tmpd / "result.json").read_text())
        with np.load(tmpd / "logits.npz", allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    if doc.get("user_error"):
        raise UserError(doc["error"])
    return doc, arrays


def passes(specs: list[RunSpec], dtype: str) -> list[tuple[RunSpec, bool]]:
    """The generate passes of one engine, in order, and whether each is kept: every run once;
    with the prefix cache, the prompts' first pass (kept for the cold run) then their second
    (kept for the warm run)."""
    by_pass = {split(s, dtype)[3]: s for s in specs}
    if set(by_pass) == {None}:
        return [(s, True) for s in specs]
    cold, warm = by_pass.get("cold"), by_pass.get("warm")
    out = [(cold or warm, cold is not None)]
    return out + [(warm, True)] if warm is not None else out


# -- transformers -------------------------------------------------------------------------
def hf_runs(model_dir: Path, prompt_ids: list[list[int]], runs: Sequence[RunSpec], *,
            dtype: str, n_new: int, seed: int, device: str, pad_id: int,
            plant: Callable | None, progress: Progress) -> tuple[list[RunResult],
                                                                list[EngineStart]]:
    """The HF runner: one model load per (dtype, attn_implementation, environment); `mode`
    graph runs the same weights under torch.compile; `plant(model)` (accucheck's own tests)
    may change the loaded model."""
    from accucheck.capture.models import load_model_dir, parse_dtype

    spec_dev = dev.parse_device(device)
    tdev = dev.torch_device(spec_dev)
    results = {s.label: RunResult(s) for s in runs}
    starts: list[EngineStart] = []
    baseline_tokens: dict[int, list[int]] = {}
    loads: dict[str, tuple[dict, dict, list[RunSpec]]] = {}
    for spec in runs:
        settings, env, _batch, _ = split(spec, dtype)
        load = {"dtype": settings.get("dtype", dtype),
                "attn_implementation": settings.get("attn_implementation", "sdpa")}
        key = json.dumps([load, env], sort_keys=True)
        loads.setdefault(key, (load, env, []))[2].append(spec)
    for load, env, specs in loads.values():
        labels = [s.label for s in specs]
        progress(f"matrix: model load {len(starts) + 1}: {load['dtype']}, "
                 f"{load['attn_implementation']} attention, for {', '.join(labels)}")
        t0 = time.monotonic()
        with dev.environment(env):
            dev.seed_everything(seed, spec_dev)
            model, _tok = load_model_dir(model_dir, parse_dtype(load["dtype"]), tdev,
                                         attn_implementation=load["attn_implementation"])
            if plant is not None:
                plant(model)
            starts.append(EngineStart(load, env, round(time.monotonic() - t0, 2), labels))
            for s in specs:
                res = results[s.label]
                res.engine = len(starts) - 1
                try:
                    _hf_one_run(model, s, res, prompt_ids, dtype, n_new, tdev, pad_id,
                                baseline_tokens)
                except Exception as e:  # e.g. torch.compile fails: say so, go on
                    if s.label == "baseline":
                        raise
                    res.error = f"could not be run: {one_line(e, 200)}"
                    res.logits.clear()
                progress(f"matrix: {s.label}: " + (res.error or "done"))
    return [results[s.label] for s in runs], starts


def _hf_one_run(model, spec: RunSpec, res: RunResult, prompt_ids, dtype: str, n_new: int, tdev,
                pad_id: int, baseline_tokens: dict) -> None:
    """Every request of interest once, alone or among its fillers; graph mode compiles."""
    import torch

    from accucheck.capture.runners.batched import batched_run

    settings, _env, batch, _ = split(spec, dtype)
    forward = model
    if settings.get("mode") == "graph":
        torch._dynamo.reset()
        forward = torch.compile(model, dynamic=True)
    t1 = time.monotonic()
    for r, ids in enumerate(prompt_ids):
        rows = [ids] + fillers(prompt_ids, r, batch - 1)
        forced = baseline_tokens.get(r) if spec.label != "baseline" else None
        run = batched_run(forward, rows, tdev, n_new, forced=forced, pad_id=pad_id,
                          model=model)
        if spec.label == "baseline":
            baseline_tokens[r] = run.generated + [int(run.logits[-1].argmax())]
        res.logits[r] = run.logits
        res.tokens[r] = run.generated
    res.seconds = round(time.monotonic() - t1, 3)
