"""Capture API: a model (directory or nn.Module) + prompts on a device -> one HDF5 capture.

Imports torch, transformers (through hf), accucheck.store and the recorder. The CLI's
`capture` command is a thin layer over `capture_dir`; `capture_model` serves models the CLI
cannot load (a custom nn.Module, a model already in memory).
"""
from __future__ import annotations

import contextlib
import copy
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import nn

from accucheck.capture import device as dev
from accucheck.capture.record.compiling import (CompileProgress, backend_for, compile_stats,
                                                dynamo_quiet)
from accucheck.capture.faults import dithered
from accucheck.capture.options import (CaptureOptions, check_requests, parse_layers,
                                       parse_positions, records)
from accucheck.capture.session import (CaptureSession, check_input, check_output_path,
                                       interruptible)
from accucheck.capture.models import (check_model_dir, config_hash, greedy_run, is_causal_lm,
                                      load_model_dir, parse_dtype, weight_hash)
from accucheck.capture.record.graph import (ObserverCheck, boundary_taps, router_taps,
                                            run_unobserved, tapped_modules)
from accucheck.capture.record.moe import RoutingReplay, find_routers, moe_meta
from accucheck.capture.record.recorder import Recorder
from accucheck.capture.record.selection import select_modules, topk_logprobs
from accucheck.capture.record.stats import kernel_status, weight_table
from accucheck.errors import UserError
from accucheck.keys import LOGITS_MODULE
from accucheck.store import CaptureWriter, meta_header, open_capture, parse_logits

def capture_dir(model_dir: str | Path, prompts: Sequence[str], out: str | Path,
                opts: CaptureOptions, *, trust_remote_code: bool = False,
                progress: Callable[[str], None] | None = None, announce: bool = True) -> Path:
    """Load a local Hugging Face model directory on `opts.device` in `opts.dtype` and capture.

    Everything that can be checked before loading the model is (output path, inputs, prompts,
    device, the model directory's files); `progress` then gets one line saying what runs
    (unless not `announce`)."""
    check_output_path(out, opts.force, opts.inputs())
    spec = dev.parse_device(opts.device)
    tdev = dev.torch_device(spec)
    dtype = parse_dtype(opts.dtype or "float32")
    if not prompts:
        raise UserError.usage("no prompts: give --prompt TEXT (repeatable) or --prompts FILE")
    for flag, path in opts.inputs().items():
        check_input(flag, path)
    check_model_dir(model_dir, trust_remote_code=trust_remote_code)
    if progress is not None and announce:
        progress(f"capturing {model_dir} on {opts.device} ({_dtype_name(dtype)}, {opts.mode}, "
                 f"store {opts.store}) for {len(prompts)} prompt(s), {opts.max_new_tokens} "
                 f"decode step(s) -> {out}")
        if dev.transfer_note(spec):
            progress(dev.transfer_note(spec))
    model, tokenizer = load_model_dir(model_dir, dtype, tdev, trust_remote_code=trust_remote_code)
    extra = dict(opts.meta_extra, model_path=str(Path(model_dir).resolve()))
    return capture_model(model, prompts, out, tokenizer=tokenizer, progress=progress,
                         opts=CaptureOptions(**{**asdict(opts), "dtype": _dtype_name(dtype),
                                                "meta_extra": extra}))


def capture_model(model: nn.Module, prompts: Sequence[str] | Sequence[Sequence[int]],
                  out: str | Path, *, tokenizer=None, opts: CaptureOptions | None = None,
                  progress: Callable[[str], None] | None = None, **kwargs) -> Path:
    """Capture `model` on `prompts` (strings, with `tokenizer`; or lists of token ids) into `out`.

    Options come as a CaptureOptions or as its fields in **kwargs. The model is not modified:
    if `opts.dtype` or `opts.device` differ from the model's, a copy is converted; hooks are
    removed afterwards, also on error. `progress` gets a line about every 2 s of a long capture
    (prompt, step, records so far) and, in graph mode, one every 5 s while torch.compile works
    ("capture: compiling (inductor), 65 s"; the total goes into meta "compile_seconds").
    In graph mode the compiled model first runs without taps (the observer check, unless
    `opts.observer_check` is off): the file's logits and tokens are that run's, meta
    "observer_effect" says how far the taps moved the logits. Returns the path of the
    complete capture.

    Every input and option is checked before `out` is created or touched; an existing `out`
    (with force) is replaced only when the new capture is complete. Raises UserError for bad
    input, and for a capture ended by SIGINT / SIGTERM (checked at every step boundary; a
    second signal aborts at once) or a full disk: a new `out` is then left marked incomplete,
    an existing one unchanged.
    """
    opts = opts or CaptureOptions(**kwargs)
    check_output_path(out, opts.force, opts.inputs())
    spec = dev.parse_device(opts.device)
    tdev = dev.torch_device(spec)
    model = _on(model, tdev, parse_dtype(opts.dtype) if opts.dtype else None)
    causal = is_causal_lm(model)
    prompt_ids = tokenize_prompts(prompts, tokenizer)
    tokens_from = opts.tokens_from or opts.shadow or opts.routing_from
    forced = forced_tokens(tokens_from, model, prompt_ids, prompts, tokenizer,
                            opts.max_new_tokens) if tokens_from else None
    if forced is not None:
        prompt_ids = [f[0] for f in forced]
    seeded = dev.seed_everything(opts.seed, spec)
    determinism = dev.set_deterministic(spec) if opts.deterministic else {}
    modules = select_modules(model, opts.include, opts.exclude,
                             parse_layers(opts.layers) if opts.layers else None)
    if not modules:
        raise UserError("no module matches --include/--exclude/--layers: run `accucheck "
                        "capture --list-modules` to see the module paths")
    check_requests(opts, len(prompt_ids))
    routers = find_routers(model)
    taps = None
    if opts.mode == "graph" and not (opts.include or opts.exclude or opts.record_inputs) \
            and opts.level == "module":
        # no Linear layer at all: None, the default selection (its effect is measured)
        taps = boundary_taps(model, modules,
                             lambda: _probe(model, prompt_ids[0], tdev, causal)) or None
        if taps:
            taps += router_taps(routers)
            modules = tapped_modules(taps)
    backend_name, backend = backend_for(spec, opts.compile_backend) if opts.mode == "graph" \
        else (None, None)
    meta = hf_meta(model, spec, opts, modules=modules, routers=routers, causal=causal,
                 backend_name=backend_name, seeded=seeded, determinism=determinism,
                 graph_taps=None if opts.mode != "graph" else "boundaries" if taps
                 else "selection")
    # the shadow reference is opened and checked (full, with inputs) before the output exists
    source = _shadow_source(opts)
    replay = None
    try:
        replay = RoutingReplay(opts.routing_from, routers, opts.routing_weights) \
            if opts.routing_from else None
        with CaptureSession(out, meta, opts, requests=len(prompt_ids),
                            steps=opts.max_new_tokens + 1 if causal else 1,
                            progress=progress) as session:
            recorder = _recorder(model, session.writer, modules, opts, source, taps,
                                 keep=[r.gate for r in routers]
                                 + ([LOGITS_MODULE] if parse_logits(opts.logits) else []))
            with dithered(opts.dither) if opts.dither is not None \
                    else contextlib.nullcontext():
                _generate(session, recorder, model, opts, _Run(
                    prompt_ids, prompts, forced, tdev, causal, backend_name, backend, replay,
                    meta["graph_taps"], progress))
            session.finish()
    finally:
        if source is not None:  # the shadow recorder's reference
            source.close()
        if replay is not None:
            replay.close()
    return Path(out)


@dataclass(frozen=True)
class _Run:
    """What capture_model prepared for the runs (`_generate`)."""
    prompt_ids: list[list[int]]
    prompts: Sequence
    forced: list | None
    device: torch.device
    causal: bool
    backend_name: str | None
    backend: object
    replay: RoutingReplay | None
    graph_taps: str | None
    progress: Callable[[str], None] | None


def _generate(session: CaptureSession, recorder: Recorder, model: nn.Module,
              opts: CaptureOptions, run: _Run) -> None:
    """Every prompt's greedy (or teacher-forced) run with the recorder's hooks in place; in
    graph mode compiled, after the observer check's untapped run. Writes the requests and the
    run's meta (shadow replay counts, forced routing, compile statistics, observer effect)."""
    writer, forced, replay = session.writer, run.forced, run.replay
    compiling = CompileProgress(run.progress, run.backend_name) if opts.mode == "graph" \
        else None
    check = ObserverCheck(run.graph_taps) if opts.mode == "graph" and opts.observer_check \
        else None

    def compiled():
        return compiling.watch(torch.compile(model, backend=run.backend, dynamic=True))

    def greedy(forward, r, ids, follow, on_step, on_logits):
        return greedy_run(forward, ids, run.device, opts.max_new_tokens, forced=follow,
                          on_step=on_step, on_logits=on_logits, causal=run.causal, model=model)

    with interruptible() as guard, dynamo_quiet(opts.mode), \
            (compiling or contextlib.nullcontext()), \
            (replay.installed(model) if replay else contextlib.nullcontext()):
        if check is not None:  # the untapped run first: its tokens are the run's
            compiling.label = f"{run.backend_name}, untapped run of the observer check"

            def untapped(forward, r, ids, on_step, on_logits):
                def step(k):
                    guard.check()
                    on_step(k)
                return greedy(forward, r, ids, forced[r][1] if forced else None, step,
                              on_logits)
            run_unobserved(compiled(), run.prompt_ids, untapped, check)
            torch._dynamo.reset()  # the tapped model compiles afresh
            compiling.register()
            compiling.label = run.backend_name
        before = compile_stats() if opts.mode == "graph" else {}
        with recorder.hooks():
            # hooks are in place BEFORE compilation: hooks added later never fire in the graph
            forward = compiled() if compiling is not None else model
            if check is not None:
                forward = check.watch(forward)
            for r, ids in enumerate(run.prompt_ids):
                at = [0]

                def on_step(step, r=r, at=at, n=len(ids)):
                    guard.check()
                    session.tick(r, step)
                    recorder.begin_step(r, step, tokens=n if step == 0 else 1,
                                        record=records(opts, r, step))
                    if replay is not None:
                        replay.begin_step(r, step)
                    at[0] = step

                follow = check.tokens[r] if check is not None else \
                    forced[r][1] if forced else None

                def on_logits(logits, r=r, at=at, ids=ids, follow=follow):
                    if check is not None:  # record the untapped logits
                        untapped_logits = check.compare(r, at[0])
                        logits = untapped_logits if logits is not None else None
                    if logits is not None and (k := parse_logits(opts.logits)):
                        recorder.end_step(*topk_logprobs(
                            logits, k, _following(logits, ids, follow, at[0])))
                    else:
                        recorder.end_step(logits)
                gen = greedy(forward, r, ids, follow, on_step, on_logits)
                prompt = run.prompts[r]
                writer.set_request(r, gen.prompt_ids, gen.generated_ids,
                                   prompt if isinstance(prompt, str) else None)
                writer.flush()
    if getattr(recorder, "shadow_counts", None) is not None:
        writer.update_meta(shadow_replay=recorder.shadow_counts)
    if replay is not None:
        writer.update_meta(routing_forced=replay.meta())
    if opts.mode == "graph":
        writer.update_meta(compile_stats=compile_stats(before),
                           compile_seconds=round(compiling.seconds, 3),
                           observer_effect=check.meta() if check is not None else
                           {"measured": False, "taps": run.graph_taps,
                            "why": "observer check off (--no-observer-check)"})


def hf_meta(model: nn.Module, spec: dev.DeviceSpec, opts: CaptureOptions, *, modules: list[str],
            routers: list, causal: bool, backend_name: str | None, seeded: dict,
            determinism: dict, graph_taps: str | None) -> dict:
    """The capture file's meta as the capture starts (accucheck.store; the run adds what it
    measures: coverage, compile statistics, the observer effect, forced routing)."""
    return {
        **meta_header("hf"), "device": str(spec),
        "dtype": _dtype_name(next(model.parameters()).dtype),
        "mode": opts.mode, "compile_backend": backend_name, "seed": seeded,
        "determinism": determinism, "environment": dev.fingerprint(spec),
        "model": {"class": type(model).__name__, "causal_lm": causal,
                  "config_hash": config_hash(model), "weight_hash": weight_hash(model),
                  "config": _config_dict(model),
                  "attn_implementation": getattr(getattr(model, "config", None),
                                                 "_attn_implementation", None)},
        "weights": weight_table(model),  # per weight: checksum + samples (compare.weights)
        "stats_kernel": kernel_status(),
        "modules": modules,
        "graph_taps": graph_taps,
        "moe": moe_meta(routers),
        "logits": {"kind": "raw", "source": "the model's output logits (before any logits "
                                             "processor or sampling transform)"},
        "options": opts.meta(),
        **opts.meta_extra,
    }


def _shadow_source(opts: CaptureOptions):
    """The opened --shadow reference (UserError when it cannot serve), or None."""
    if not opts.shadow:
        return None
    from accucheck.capture.record.shadow import ShadowSource

    return ShadowSource(opts.shadow)


def _following(logits: torch.Tensor, prompt_ids: Sequence[int], follow, step: int
               ) -> torch.Tensor:
    """The token that follows each position of a step's logits [1, positions, vocab] (capture
    --logits topk:K): the next prompt token at the prefill's positions, and at the last one
    the token the step takes (the forced one, else the greedy argmax), as models.greedy_run
    feeds it."""
    taken = int(follow[step]) if follow is not None and step < len(follow) \
        else int(logits[0, -1].argmax())
    nxt = list(prompt_ids[1:]) if step == 0 else []
    return torch.tensor([nxt + [taken]], dtype=torch.long)


def _recorder(model: nn.Module, writer: CaptureWriter, modules: list[str],
              opts: CaptureOptions, source=None, taps=None, keep=()) -> Recorder:
    """The plain module recorder, or (level op / shadow) the op and shadow recorders.
    `source`: the opened --shadow reference (closed by the caller on failure); `taps`: graph
    mode's kernel-boundary taps (accucheck.capture.record.graph), None for the module selection;
    `keep`: modules whose outputs keep their values in --store stats (MoE routers)."""
    last = parse_positions(opts.positions) or None  # "decode": no prefill step is recorded
    if opts.level == "module" and not opts.shadow:
        return Recorder(model, writer, modules, record_inputs=opts.record_inputs,
                        graph=opts.mode == "graph", taps=taps, keep=keep, last_positions=last)
    from accucheck.capture.record.ops import OpRecorder
    from accucheck.capture.record.shadow import ShadowRecorder

    cls = OpRecorder if opts.level == "op" else ShadowRecorder
    return cls(model, writer, modules, record_inputs=opts.record_inputs,
               graph=opts.mode == "graph", shadow=source, keep=keep, last_positions=last)


def _probe(model: nn.Module, ids: Sequence[int], device: torch.device, causal: bool) -> None:
    """One eager forward on the first tokens of a prompt (graph.boundary_taps' probe)."""
    x = torch.tensor([list(ids)[:8]], dtype=torch.long, device=device)
    model(input_ids=x, use_cache=False) if causal else model(input_ids=x)


def list_modules(model: nn.Module, include=(), exclude=(), layers: str | None = None
                 ) -> list[str]:
    return select_modules(model, include, exclude, parse_layers(layers) if layers else None)


# -- helpers -------------------------------------------------------------------------------
def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _on(model: nn.Module, device: torch.device, dtype: torch.dtype | None) -> nn.Module:
    """The model on `device` / `dtype`, converting a copy when needed (never the user's)."""
    p = next(model.parameters(), None)
    if p is None:
        raise UserError("the model has no parameters")
    if p.device == device and (dtype is None or p.dtype == dtype):
        return copy.deepcopy(model).eval() if model.training else model
    m = copy.deepcopy(model)
    return m.to(device=device, dtype=dtype).eval() if dtype else m.to(device).eval()


def tokenize_prompts(prompts, tokenizer) -> list[list[int]]:
    if not prompts:
        raise UserError.usage("no prompts: give --prompt TEXT (repeatable) or --prompts FILE")
    out = []
    for p in prompts:
        if isinstance(p, str):
            if tokenizer is None:
                raise UserError("text prompts need a tokenizer (or pass token id lists)")
            ids = tokenizer(p, add_special_tokens=True)["input_ids"]
        else:
            ids = [int(i) for i in p]
        if not ids:
            raise UserError(f"prompt {p!r} tokenizes to nothing")
        out.append(list(ids))
    return out


def forced_tokens(path, model, prompt_ids, prompts, tokenizer, max_new_tokens):
    """(prompt_ids, generated_ids) per request from a reference capture, after checking it
    was made with the same model architecture and tokenizer."""
    with open_capture(path) as ref:
        ref_model = ref.meta.get("model", {})
        requests = ref.requests
    if ref_model.get("config_hash") and ref_model["config_hash"] != config_hash(model):
        raise UserError(f"--tokens-from {path}: captured with another model (config hash "
                        f"{ref_model['config_hash']} vs {config_hash(model)}); use a capture of "
                        f"the same model")
    if len(requests) != len(prompt_ids):
        raise UserError(f"--tokens-from {path}: it has {len(requests)} prompts, this run "
                        f"{len(prompt_ids)}; pass the same prompts")
    out = []
    for i, (req, ids) in enumerate(zip(requests, prompt_ids)):
        ref_ids = [int(x) for x in req.prompt_ids]
        if ref_ids != list(ids):
            raise UserError(f"--tokens-from {path}: prompt {i} tokenizes differently here "
                            f"({len(ids)} vs {len(ref_ids)} ids; another tokenizer or prompt?)")
        gen = [int(x) for x in req.generated_ids]
        if len(gen) < max_new_tokens:
            raise UserError(f"--tokens-from {path}: prompt {i} has {len(gen)} generated tokens, "
                            f"fewer than --max-new-tokens {max_new_tokens}")
        vocab = model.get_output_embeddings().weight.shape[0] \
            if model.get_output_embeddings() is not None else None
        if vocab is not None and any(t >= vocab for t in ref_ids + gen):
            raise UserError(f"--tokens-from {path}: token ids beyond this model's vocabulary "
                            f"({vocab}); another tokenizer?")
        out.append((ref_ids, gen[:max_new_tokens]))
    return out


def _config_dict(model: nn.Module) -> dict | None:
    cfg = getattr(model, "config", None)
    if cfg is None:
        return None
    return json.loads(json.dumps(cfg.to_dict(), default=str))


