"""Where a knob's change starts: a module-level capture of the baseline and of the run, on the
request the knob moved most, then accucheck's own diff of the two.

vLLM: `capture_vllm` twice, each in a process of its own (matrix.vllm_worker: the baseline's
settings, then the run's with its environment, forced to the baseline capture's tokens). Batch composition: both captures hold the request and its fillers; the
baseline's engine runs them one at a time (max_num_seqs=1), the run's together. A chunked
prefill is captured with each record joined from its chunks (capture.runners.vllm_plugin).
The prefix cache is captured as it serves (capture.runners.vllm: --positions last:1, the
worker counting a request's tokens from the cache's hits), the run's engine with the cache;
for the warm pass both captures hold the request twice, run one at a time, so the run's second
is served from its cache (its first is the cold one). Async scheduling cannot be captured (a capture
matches records to requests step by step): the row says so. HF: `capture_rows`
(capture.runners.batched) for the batch size, the attention kernel and the dtype; `capture_dir`
in eager against graph
mode for `mode`.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

from accucheck.capture.options import CaptureOptions
from accucheck.errors import UserError, one_line
from accucheck.capture.device import environment
from accucheck.matrix.engines import VLLM_ENV, fillers, run_worker, split
from accucheck.matrix.knobs import RunSpec
from accucheck.report.diff import first_difference_line, verdict_line
from accucheck.verdict.locate import analyze

Progress = Callable[[str], None]
_NOT_CAPTURED = {"async_scheduling": "a module capture needs synchronous scheduling"}


@dataclass(frozen=True)
class Localisation:
    request: int
    base_capture: str | None
    run_capture: str | None
    first_difference: str | None   # key of the first record that differs
    where: str | None              # that record said in words (module, slot, step, made by)
    first_difference_line: str | None
    culprit: str | None            # module (and operator) the diff names, None: none named
    verdict: str | None            # the diff's headline
    error: str | None = None       # why there is no localisation

    def to_json(self) -> dict:
        return asdict(self)

    def line(self) -> str:
        if self.error:
            return f"not localised: {self.error}"
        where = self.where or "no record differs"
        blame = f"; culprit {self.culprit}" if self.culprit else "; no culprit named"
        return f"first difference {where}{blame}"


def _slug(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", label)[:80]


def localise(runner: str, model_dir: Path, prompt_ids: list[list[int]], spec: RunSpec,
             request: int, out_dir: Path, *, dtype: str, n_new: int, seed: int, device: str,
             engine_args: dict, pad_id: int, plant: Callable | None, progress: Progress
             ) -> Localisation:
    settings, env, batch, cache_pass = split(spec, dtype)
    blocked = next((why for name, why in _NOT_CAPTURED.items() if name in settings), None)
    if cache_pass and batch > 1:
        blocked = "the prefix cache's passes are localised at batch size 1"
    if blocked:
        return Localisation(request, None, None, None, None, None, None, None,
                            f"{blocked} ({spec.label})")
    where = out_dir / "localise" / _slug(spec.label)
    where.mkdir(parents=True, exist_ok=True)
    base, run = where / "baseline.h5", where / "run.h5"
    rows = [prompt_ids[request]] + fillers(prompt_ids, request, batch - 1)
    opts = CaptureOptions(device=device, dtype=dtype, store="full", max_new_tokens=n_new,
                          seed=seed, force=True)
    if cache_pass:  # a capture with the cache records the last prompt position only
        opts = replace(opts, positions="last:1")
    if cache_pass == "warm":  # the request twice: the run's second pass is served from its cache
        rows = [prompt_ids[request]] * 2
    progress(f"matrix: localising {spec.label} on request {request}: module captures -> {where}")
    try:
        if runner == "vllm":
            _vllm_pair(model_dir, rows, base, run, opts, settings, env, batch, engine_args)
        else:
            _hf_pair(model_dir, rows, base, run, opts, settings, env, pad_id, plant)
    except UserError as e:
        return Localisation(request, None, None, None, None, None, None, None,
                            one_line(e, 240))
    a = analyze(base, run)
    fd = a.location.first_difference
    if fd is not None:
        key, first_line = fd.key, first_difference_line(fd)
    elif a.diff.records and not a.diff.records[0].identical:
        key = a.diff.records[0].key
        first_line = f"the very first record differs ({key})"
    else:
        key = first_line = None
    c = a.culprit
    culprit = None if c is None else c.module + (f" ({c.op})" if c.op else "") + (
        f", seen at {c.seen_at.module} ({c.seen_at.role}.{c.seen_at.slot})"
        if c.seen_at is not None else "")
    return Localisation(request, str(base), str(run), str(key) if key else None,
                        _where(key), first_line, culprit, verdict_line(a))


def _where(key) -> str | None:
    """'model.layers.0.self_attn.o_proj (in.0) at step 0: made by code of ... that no record
    covers (the attention core)'."""
    if key is None:
        return None
    text = f"{key.module} ({key.role}.{key.slot}) at step {key.step}"
    if key.role == "in" and "." in key.module:
        parent = key.module.rsplit(".", 1)[0]
        core = " (the attention core)" if parent.endswith(("attn", "attention")) else ""
        text += f": made by code of {parent} that no record covers{core}"
    return text


def _vllm_pair(model_dir, rows, base, run, opts, settings, env, batch, engine_args) -> None:
    """Both captures, each in a process of its own (matrix.vllm_worker), the run's with its
    environment; a capture's UserError is raised here."""
    dtype = settings.pop("dtype", opts.dtype)
    mode = "eager" if settings.pop("enforce_eager", True) else "graph"
    cached = settings.get("enable_prefix_caching") is True
    one_by_one = {"max_num_seqs": 1} if batch > 1 or cached else {}
    if cached:
        settings["max_num_seqs"] = 1
    for out, o, engine, extra in (
            (base, opts, {**engine_args, **one_by_one}, {}),
            (run, replace(opts, dtype=dtype, mode=mode, tokens_from=str(base),
                          observer_check=False), {**engine_args, **settings}, env)):
        doc, _ = run_worker({"kind": "capture", "model_dir": str(model_dir), "rows": rows,
                             "out": str(out), "opts": asdict(o), "engine": engine},
                            {**VLLM_ENV, **extra})
        if doc.get("error"):
            raise UserError(doc["error"])


def _hf_pair(model_dir, rows, base, run, opts, settings, env, pad_id, plant) -> None:
    import torch

    from accucheck.capture import device as dev
    from accucheck.capture.runners.hf import capture_model
    from accucheck.capture.runners.batched import capture_rows
    from accucheck.capture.models import load_model_dir, parse_dtype

    tdev = dev.torch_device(dev.parse_device(opts.device))

    def load(dtype, attn):
        model, _ = load_model_dir(model_dir, parse_dtype(dtype), tdev, attn_implementation=attn)
        if plant is not None:
            plant(model)
        return model

    model = load(opts.dtype, "sdpa")
    if settings.get("mode") == "graph":  # the capture's own eager-against-graph path
        capture_model(model, [rows[0]], base, opts=opts)
        torch._dynamo.reset()
        with environment(env):
            capture_model(model, [rows[0]], run, opts=replace(opts, mode="graph",
                                                              tokens_from=str(base)))
        return
    first = capture_rows(model, rows[:1], base, opts, pad_id=pad_id, label="baseline")
    forced = first.generated + [int(first.logits[-1].argmax())]
    with environment(env):
        other = load(settings.get("dtype", opts.dtype),
                     settings.get("attn_implementation", "sdpa"))
        capture_rows(other, rows, run, opts, forced=forced, pad_id=pad_id, label="run")
