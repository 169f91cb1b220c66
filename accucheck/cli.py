"""Command line: argument parsing + one library call + exit-code mapping per command.

Imports click and accucheck stages lazily per command: `accucheck diff` must not import torch.
Payload goes to stdout (or -o), progress and logs to stderr. A UserError becomes one line on
stderr and its exit code; click usage errors become one line too and exit 2; anything else is a
bug and keeps its traceback. Exit codes (accucheck.errors): 0 ok / within tolerance,
1 divergence found, 2 usage error (the command line is wrong), 3 bad input (what the files or
the machine hold does not allow the command). Every command checks its inputs and options
before it creates or touches an output.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from accucheck.capture.tiny import TINY_ARCHS  # no torch: built lazily
from accucheck.errors import EXIT_BAD_INPUT, EXIT_USAGE, UserError, one_line

TINY = "@tiny"
TINY_MOE = "@tiny-moe"  # the built-in tiny Qwen3-MoE
# control runs `diff --control auto` makes: two measured 1 false alarm in 400 clean pairs of
# correct devices and 91 % of x2 faults named, one 4 and 83 % (docs/control.md); the sign-off's
# default too (signoff.scenario.CONTROL_RUNS)
AUTO_CONTROL_RUNS = 2


def err(msg: str) -> None:
    click.echo(msg, err=True)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="accucheck")
def cli() -> None:
    """accucheck: does the NPU produce the same numbers as the GPU?

    capture per-layer activations and logits into HDF5, diff two captures, find where
    divergence starts and who is wrong, sign off a release."""


def _model_dir(model: str) -> Path:
    if model in (TINY, TINY_MOE):
        from accucheck.capture.tiny import tiny_model_dir

        return tiny_model_dir(arch="llama" if model == TINY else "qwen3_moe")
    return Path(model)


def _engine_args(pairs: tuple[str, ...]) -> dict:
    out = {}
    for pair in pairs:
        k, sep, v = pair.partition("=")
        if not sep or not k:
            raise UserError.usage(f"--engine-arg {pair!r}: use KEY=VALUE (VALUE may be JSON)")
        try:
            out[k] = json.loads(v)
        except json.JSONDecodeError:
            out[k] = v
    return out


@cli.command()
@click.argument("model")
@click.option("-o", "--output", "out", type=click.Path(dir_okay=False),
              help="capture file to write (.h5); refused if it exists unless --force "
                   "(required unless --list-modules)")
@click.option("--runner", type=click.Choice(["hf", "vllm"]), default="hf", show_default=True)
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda[:i] or npu[:i]")
@click.option("--dtype", default="float32", show_default=True,
              help="float32, float16, bfloat16 or float64")
@click.option("--mode", default="eager", show_default=True,
              help="eager, or graph (torch.compile; vLLM: compiled + CUDA/ACL graphs)")
@click.option("--store", type=click.Choice(["stats", "full"]), default="stats", show_default=True,
              help="stats: per-tensor statistics only; full: tensors too")
@click.option("--prompt", "prompts", multiple=True, help="a prompt (repeatable)")
@click.option("--prompts", "prompts_file", help="file of prompts: text lines or JSONL")
@click.option("--max-new-tokens", default=0, show_default=True, type=int,
              help="greedy decode steps after the prefill (step 0)")
@click.option("--include", multiple=True, help="glob on module paths (replaces the default set)")
@click.option("--exclude", multiple=True, help="glob on module paths to leave out")
@click.option("--inputs", "record_inputs", is_flag=True,
              help="also record module inputs (and op inputs at --level op)")
@click.option("--positions", default="all", show_default=True,
              help="prefill positions recorded: all, last:N (the last N of each prefill; every "
                   "decode step) or decode (no prefill record)")
@click.option("--requests", "requests_", default=None,
              help="the requests recorded, e.g. 0,2-3 (every request still runs)")
@click.option("--layers", default=None,
              help="the decoder layers recorded, e.g. 0-3,28,29 (modules outside layers stay)")
@click.option("--logits", default="auto", show_default=True,
              help="logits recorded: full (raw, every vocabulary entry), topk:K (per position "
                   "the K largest log-probabilities and the following token's, with ids; kept "
                   "in the stats store too) or auto (full with --store full, else topk:32)")
@click.option("--level", type=click.Choice(["module", "op"]), default="module",
              show_default=True,
              help="op: also every operator inside the selected modules (eager mode only)")
@click.option("--shadow", type=click.Path(dir_okay=False),
              help="reference capture (--store full --inputs): replay every selected module "
                   "(and op) on its recorded inputs here, stored as role 'shadow' (local error); "
                   "implies --tokens-from it")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--deterministic", is_flag=True, help="deterministic algorithms (slower)")
@click.option("--tokens-from", type=click.Path(dir_okay=False),
              help="teacher forcing: follow this reference capture's prompt and generated tokens")
@click.option("--routing-from", type=click.Path(dir_okay=False),
              help="MoE routing replay: every router call uses this reference capture's expert "
                   "ids (teacher forcing for experts; implies --tokens-from it; eager, hf)")
@click.option("--routing-weights", is_flag=True,
              help="with --routing-from: also the reference's routing weights")
@click.option("--control-for", type=click.Path(dir_okay=False),
              help="make a control run of this reference capture: its prompts, tokens, store "
                   "mode, module selection and steps, here at --dtype (default: the "
                   "reference's), eager; for `diff --control`")
@click.option("--plain-control", is_flag=True,
              help="with --control-for: the CPU's own rounding, no one-ULP dither (stricter: "
                   "flags a device that rounds less carefully than round-to-nearest)")
@click.option("--compression", type=click.Choice(["gzip", "lzf"]), default=None)
@click.option("--compile-backend", default=None,
              help="torch.compile backend for --mode graph (default inductor, on NPU too; "
                   "torchair: TorchAir's GE backend)")
@click.option("--observer-check/--no-observer-check", default=True, show_default=True,
              help="--mode graph: also run the compiled model without taps, record its logits "
                   "and measure what the taps change (meta observer_effect); off: one compile "
                   "less, the effect unmeasured")
@click.option("--engine-arg", "engine_args", multiple=True,
              help="vLLM engine option KEY=VALUE (JSON values), e.g. tensor_parallel_size=2")
@click.option("--trust-remote-code", is_flag=True, help="run the model directory's own code")
@click.option("--list-modules", is_flag=True, help="print the module paths that would be hooked")
@click.option("--force", is_flag=True, help="overwrite the output file")
def capture(model, out, runner, device, dtype, mode, store, prompts, prompts_file,
            max_new_tokens, include, exclude, record_inputs, seed, deterministic, tokens_from,
            routing_from, routing_weights, control_for, plain_control, compression,
            compile_backend, observer_check, engine_args, trust_remote_code, list_modules, force,
            level="module", shadow=None, positions="all", requests_=None, layers=None,
            logits="auto"):
    """Run MODEL (a local Hugging Face directory; @tiny for the built-in tiny Llama, @tiny-moe
    for the built-in tiny Qwen3-MoE) on the prompts and write one HDF5 capture."""
    from accucheck.capture.options import CaptureOptions, check_runner, parse_requests

    if not out and not list_modules:
        raise UserError.usage("capture needs -o FILE.h5 (or --list-modules to only list the "
                              "modules that would be hooked)")
    opts = CaptureOptions(device=device, dtype=dtype, mode=mode, store=store,
                          max_new_tokens=max_new_tokens, include=tuple(include),
                          exclude=tuple(exclude), record_inputs=record_inputs, seed=seed,
                          deterministic=deterministic, tokens_from=tokens_from,
                          compression=compression, compile_backend=compile_backend, force=force,
                          level=level, shadow=shadow, observer_check=observer_check,
                          routing_from=routing_from, routing_weights=routing_weights,
                          positions=positions, layers=layers, logits=logits,
                          requests=parse_requests(requests_) if requests_ is not None else ())
    engine = _engine_args(engine_args)
    check_runner(opts, runner, engine)  # every flag clash, exit 2, before anything is read
    if plain_control and not control_for:
        raise UserError.usage("--plain-control goes with --control-for REF")
    model_dir = _model_dir(model)
    if list_modules:
        from accucheck.capture.runners.hf import list_modules as lm
        from accucheck.capture.device import parse_device, torch_device
        from accucheck.capture.models import load_model_dir, parse_dtype

        m, _ = load_model_dir(model_dir, parse_dtype(dtype), torch_device(parse_device(device)),
                              trust_remote_code=trust_remote_code)
        click.echo("\n".join(lm(m, include, exclude, layers)))
        return 0
    if control_for:
        from accucheck.capture.runners.control import control_run

        if prompts or prompts_file or tokens_from or shadow or runner != "hf" \
                or mode != "eager":
            raise UserError.usage("--control-for takes the prompts and tokens from the "
                                  "reference and runs hf eager: leave out --prompt / "
                                  "--prompts / --tokens-from / --shadow / --runner / --mode")
        src = click.get_current_context().get_parameter_source("dtype")
        plist, opts = control_run(control_for, opts, plain=plain_control,
                                  dtype_given=src != click.core.ParameterSource.DEFAULT)
    else:
        from accucheck.prompts import read_prompts

        plist = read_prompts(prompts, prompts_file)
    existed = Path(out).exists()
    try:
        if runner == "vllm":
            from accucheck.capture.session import check_output_path
            from accucheck.capture.device import parse_device, transfer_note
            from accucheck.capture.runners.vllm import capture_vllm

            if trust_remote_code:
                engine["trust_remote_code"] = True
            check_output_path(out, force, opts.inputs())
            err(f"capturing {model_dir} on {device} ({dtype}, {mode}, store {store}, vLLM) "
                f"for {len(plist)} prompt(s), {max_new_tokens} decode step(s) -> {out}")
            if transfer_note(parse_device(device)):
                err(transfer_note(parse_device(device)))
            path = capture_vllm(model_dir, plist, out, opts, engine)
        else:
            from accucheck.capture.runners.hf import capture_dir

            path = capture_dir(model_dir, plist, out, opts, trust_remote_code=trust_remote_code,
                               progress=err)
    except KeyboardInterrupt as e:  # vLLM, or before the capture started (the HF capture
        what = f"interrupted ({e.args[0]})" if e.args else "interrupted"  # says it itself)
        if existed:
            msg = f"{what}: {out} is unchanged"
        elif Path(out).exists():
            msg = f"{what}: {out} is left incomplete; re-run the capture with --force to replace it"
        else:
            msg = f"{what} before anything was written"
        raise UserError(msg) from None
    err(f"wrote {path}")
    return 0


@cli.command()
@click.argument("capture_file", type=click.Path(dir_okay=False))
@click.option("--filter", "pattern", help="glob on record keys, e.g. '*layers.2*'")
@click.option("--step", type=int, help="only this step")
@click.option("--limit", type=int, default=None, help="at most this many records")
@click.option("--format", "fmt", type=click.Choice(["table", "json"]), default="table")
def inspect(capture_file, pattern, step, limit, fmt):
    """Show a capture: meta, environment, records with statistics. Exit 3 if incomplete."""
    from accucheck.report.inspect import RecordFilter, render
    from accucheck.store import open_capture

    with open_capture(capture_file, allow_incomplete=True) as r:
        click.echo(render(r, RecordFilter(pattern, step, limit), fmt))
        if not r.complete:
            raise UserError(f"{capture_file}: incomplete capture (interrupted, killed or out of "
                            f"disk space): the records above are what was flushed; re-run the "
                            f"capture")
    return 0


@cli.command()
@click.argument("ref", type=click.Path())
@click.argument("cand", type=click.Path())
@click.option("--golden", type=click.Path(dir_okay=False),
              help="high-precision capture of the same prompts and tokens (e.g. float64 CPU, "
                   "--tokens-from REF): labels each record cand worse / ref worse / both within "
                   "noise")
@click.option("--control", "controls", multiple=True, type=click.Path(dir_okay=False),
              help="control run: the reference's code at the candidate's dtype on a trusted "
                   "device, forced to REF's tokens (`capture --control-for REF`); the candidate "
                   "is then judged against its noise, record by record (repeatable); `auto`: "
                   "two made here from REF's model directory, beside CAND (CAND.control.h5, "
                   "CAND.control2.h5; dithered with seeds 0 and 1: fewer false alarms and more "
                   "faults named than one, docs/control.md); `auto:1` / `auto:3` one / three")
@click.option("--format", "fmt", type=click.Choice(["table", "json", "csv", "md", "html"]),
              default="table", show_default=True,
              help="html: one self-contained page (heatmap, curves, logits); needs -o")
@click.option("-o", "--output", "out", type=click.Path(dir_okay=False),
              help="write the report here instead of stdout (refused if it exists unless --force)")
@click.option("--force", is_flag=True, help="overwrite -o")
@click.option("--rel-l2", type=float, default=None,
              help="tensor-level tolerance ||ref-cand||/||ref|| for every dtype "
                   "(default: per dtype, e.g. float32 5e-5, bfloat16 5e-2)")
@click.option("--rtol", type=float, default=None, help="elementwise check too (with --atol)")
@click.option("--atol", type=float, default=None, help="elementwise check too (with --rtol)")
@click.option("--tol", "overrides", multiple=True, metavar="PATTERN=SPEC",
              help="per-key tolerance, e.g. '*.mlp=rel_l2:1e-3' or 'logits=rtol:1e-2,atol:1e-3'"
                   " (repeatable, last match wins)")
@click.option("--step", "steps", type=int, multiple=True, help="only this step (repeatable)")
@click.option("--include", multiple=True,
              help="only keys matching this glob (key, site or module path; repeatable)")
@click.option("--transform", "transforms", multiple=True,
              metavar="[ref:|cand:]PATTERN=STEP[+STEP]",
              help="bring one side's records to the other's layout before comparing: "
                   "dequant:KEY, permute:A,B,..., reshape:A,B,..., rotate:KEY (docs/transforms.md; "
                   "repeatable; never applied unless declared)")
@click.option("--amplification", type=click.FloatRange(min=1.0), default=None,
              help="output/input error ratio above which an error is 'introduced' (default 4, "
                   "at least 1)")
@click.option("--allow-incomplete", is_flag=True, help="read interrupted captures too")
@click.option("--allow-model-mismatch", is_flag=True,
              help="compare captures of different model configs (e.g. a checkpoint conversion);"
                   " refused by default")
@click.option("--jobs", type=click.IntRange(min=1), default=None,
              help="processes measuring the records (default: the cores available to this "
                   "process; 1: this process only). Same verdict whatever the number")
@click.option("--ray", "ray_address", metavar="ADDRESS",
              help="measure the records as Ray tasks: 'local' (a Ray on this machine), "
                   "'auto' or HOST:PORT (a cluster whose nodes see the capture paths); --jobs "
                   "then caps the tasks (default: the cluster's CPUs). Same verdict; needs "
                   "pip install 'accucheck[ray]'")
@click.option("--impact", "impact_file", type=click.Path(dir_okay=False),
              help="an `accucheck impact` result (-o JSON): show the share of the logit gap "
                   "the culprit recovers (--format table, md, json or html)")
def diff(ref, cand, golden, controls, fmt, out, force, rel_l2, rtol, atol, overrides, steps,
         include, transforms, amplification, allow_incomplete, allow_model_mismatch, jobs,
         ray_address=None, impact_file=None):
    """Compare CAND against REF: exit 0 within tolerance (with --control: within the
    control's noise), 1 divergence found, 2 usage error, 3 unreadable / incomplete /
    incompatible captures."""
    from accucheck.compare.parallel import available_cores, io_line
    from accucheck.verdict.locate import analyze
    from accucheck.report.diff import flip_context, render, verdict_line
    from accucheck.compare.tolerances import DEFAULT_AMPLIFICATION, ToleranceTable

    for v, flag in ((rel_l2, "--rel-l2"), (rtol, "--rtol"), (atol, "--atol")):
        if v is not None and not v >= 0:
            raise UserError.usage(f"{flag} {v}: a tolerance is a number >= 0")
    tol = ToleranceTable.from_options(rel_l2=rel_l2, rtol=rtol, atol=atol, overrides=overrides)
    from accucheck.compare.transforms import parse_transform

    declared = [parse_transform(t) for t in transforms]
    if fmt == "html" and not out:
        raise UserError.usage("--format html writes a page: give -o FILE.html "
                              "(e.g. -o diff.html)")
    if impact_file and fmt == "csv":
        raise UserError.usage("--impact goes with --format table, md, json or html")
    if impact_file:
        from accucheck.impact.join import read_impact

        impact_data = read_impact(impact_file)
    if out:
        _check_report_output(out, force, {"REF": ref, "CAND": cand, "--golden": golden,
                                          **{f"--control #{i + 1}": c for i, c in enumerate(controls)}})
    from accucheck.importers import capture_path  # msprobe dump directory -> temporary capture
    close = click.get_current_context().call_on_close
    ref, cand = (capture_path(p, progress=err, on_close=close) for p in (ref, cand))
    autos = [c for c in controls if c == "auto" or c.startswith("auto:")]
    if autos:
        runs = _auto_runs(autos[0])
        if len(controls) > 1:
            raise UserError.usage("--control auto makes the control runs: give it alone")
        from accucheck.capture.runners.control import auto_control

        controls = tuple(str(p) for p in auto_control(ref, cand, runs=runs, progress=err))
    head = [f"diff {cand} against {ref}" + (f" (golden {golden})" if golden else "")
            + (f" (control {', '.join(controls)})" if controls else "")]

    def progress(msg: str) -> None:  # the first line once the captures are open and checked
        while head:
            err(head.pop())
        err(msg)

    result = analyze(ref, cand, golden, amplification=amplification or DEFAULT_AMPLIFICATION,
                     tolerances=tol, steps=steps or None, include=include,
                     allow_incomplete=allow_incomplete, progress=progress,
                     allow_model_mismatch=allow_model_mismatch, controls=controls,
                     transforms=declared, ray=ray_address,
                     jobs=jobs or (None if ray_address else available_cores()))
    while head:
        err(head.pop())
    if result.diff.io and result.diff.io["bytes_data"]:
        err(io_line(result.diff.io))
    if fmt == "html":
        from accucheck.impact.join import impact_line
        from accucheck.report.html_diff import to_html

        text = to_html(result, impact_line(
            impact_data, getattr(result.culprit, "module", None), impact_file,
            flip_context(result.diff)) if impact_file else None)
    else:
        text = render(result, fmt)
    if impact_file and fmt != "html":
        from accucheck.impact.join import with_impact

        text = with_impact(text, fmt, impact_data, result.culprit, impact_file,
                           flip_context(result.diff))
    if out:
        from accucheck.paths import write_atomic

        write_atomic(out, text)
        err(f"wrote {out}")
        err(verdict_line(result))
    else:
        click.echo(text, nl=False)
    return result.exit_code


def _check_report_output(out: str, force: bool, inputs: dict) -> None:
    """-o of a text report: not an input (exit 2), writable, not existing without --force."""
    from accucheck.paths import check_not_input, check_output_file

    check_not_input(out, inputs)
    check_output_file(out, force)


@cli.command()
@click.argument("scenario", type=click.Path(dir_okay=False))
@click.option("--ref", type=click.Path(dir_okay=False),
              help="use this reference capture instead of running the scenario's reference")
@click.option("--cand", type=click.Path(dir_okay=False),
              help="use this candidate capture instead of running the scenario's candidate")
@click.option("--golden", type=click.Path(dir_okay=False),
              help="high-precision referee capture (replaces the scenario's [golden])")
@click.option("--control", type=click.Path(dir_okay=False),
              help="control capture (replaces the scenario's [control]): the candidate is "
                   "judged against its noise")
@click.option("--previous", type=click.Path(dir_okay=False),
              help="last release's report.json (or a capture of its candidate): same / better / "
                   "worse")
@click.option("-o", "--out-dir", type=click.Path(file_okay=False), default=None,
              help="report directory (default: reports/<scenario name>)")
@click.option("--capture-only",
              type=click.Choice(["reference", "candidate", "golden", "control"]),
              default=None, help="only capture this run into OUT_DIR/captures/ROLE.h5 (e.g. the "
                                 "reference on the GPU box; then --ref it on the NPU box)")
@click.option("--force", is_flag=True, help="replace the report in a non-empty --out-dir")
@click.option("-q", "--quiet", is_flag=True, help="no progress on stderr")
def signoff(scenario, ref, cand, golden, control, previous, out_dir, capture_only, force,
            quiet):
    """Sign off a release: run (or reuse) the captures SCENARIO describes, diff them, apply its
    thresholds, write report.md / report.html / report.json. Exit 0 pass, 1 fail, 2 usage
    error, 3 bad scenario or captures."""
    from accucheck.signoff.scenario import load_scenario

    scn = load_scenario(scenario)
    out = Path(out_dir) if out_dir else Path("reports") / scn.name
    log = (lambda m: None) if quiet else err
    if capture_only:
        from accucheck.signoff.run import capture_only as run_capture_only

        path = run_capture_only(scn, capture_only, out, ref=ref, force=force, progress=log)
        click.echo(str(path))
        return 0
    from accucheck.signoff.run import signoff as run_signoff

    result = run_signoff(scn, ref=ref, cand=cand, golden=golden, control=control,
                         previous=previous, out_dir=out, force=force, progress=log)
    click.echo(result.summary)
    err(f"report: {out / 'report.md'}, {out / 'report.html'}, {out / 'report.json'}")
    return result.exit_code


@cli.command()
@click.argument("model", required=False)
@click.option("--runner", type=click.Choice(["vllm", "hf"]), default="vllm", show_default=True)
@click.option("--prompt", "prompts", multiple=True, help="a prompt (repeatable)")
@click.option("--prompts", "prompts_file", help="file of prompts: text lines or JSONL")
@click.option("--knob", "knobs", multiple=True, metavar="NAME=V1,V2",
              help="a knob and the values to flip it to, one run each (repeatable); "
                   "`--list-knobs` names them")
@click.option("--pairs", is_flag=True, help="also flip every two knobs together")
@click.option("--expect-invariant", "invariant", default="", metavar="KNOB,KNOB",
              help="exit 1 when one of these knobs moves any request (or cannot be run)")
@click.option("-o", "--output", "out_dir", type=click.Path(file_okay=False),
              help="directory for matrix.json / .txt / .html and the localisation captures")
@click.option("--dtype", default="float32", show_default=True, help="the baseline's dtype")
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda or npu")
@click.option("--max-new-tokens", default=2, show_default=True, type=int,
              help="forced decode steps after the prefill")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--engine-arg", "engine_args", multiple=True,
              help="vLLM engine option KEY=VALUE (JSON values) for every run")
@click.option("--localise/--no-localise", default=True, show_default=True,
              help="capture and diff every run that moved a request (module level)")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text")
@click.option("--force", is_flag=True, help="write into a non-empty -o directory")
@click.option("--trust-remote-code", is_flag=True, help="run the model directory's own code")
@click.option("--list-knobs", is_flag=True, help="print the knobs, their baselines and meaning")
def matrix(model, runner, prompts, prompts_file, knobs, pairs, invariant, out_dir, dtype,
           device, max_new_tokens, seed, engine_args, localise, fmt, force,
           trust_remote_code, list_knobs):
    """Flip configuration knobs one at a time (batch size, prefix cache, chunked prefill, graph
    mode, async scheduling, tensor parallel, dtype, any engine argument or environment
    variable) and say which change the numbers for which request, and where in the model the
    change starts. Every run follows the baseline's tokens. MODEL: a model directory or @tiny.
    Exit 1 when an --expect-invariant knob moved a request."""
    from accucheck.matrix.knobs import knob_table

    if list_knobs:
        from tabulate import tabulate

        click.echo(tabulate(knob_table(), headers=("knob", "runners", "baseline",
                                                         "meaning"), maxcolwidths=[None] * 3 + [70]))
        return 0
    from accucheck.matrix.run import plan

    names = tuple(n.strip() for n in invariant.split(",") if n.strip())
    plan(knobs, runner, dtype, pairs, names)  # exit 2 before anything else
    if model is None or not out_dir:
        raise UserError.usage("give MODEL and -o DIR (or --list-knobs)")
    from accucheck.capture.models import parse_dtype
    from accucheck.matrix.main import matrix_main
    from accucheck.prompts import read_prompts

    parse_dtype(dtype)
    plist = read_prompts(prompts, prompts_file)
    m = matrix_main(_model_dir(model), runner, plist, knobs, Path(out_dir), pairs=pairs,
                    expect_invariant=names, dtype=dtype, device=device, n_new=max_new_tokens,
                    seed=seed, engine_args=_engine_args(engine_args), localise=localise,
                    force=force, trust_remote_code=trust_remote_code, fmt=fmt, progress=err,
                    echo=click.echo)
    return m.exit_code


@cli.command()
@click.argument("ref", type=click.Path(dir_okay=False))
@click.option("--op", "ops", multiple=True, metavar="KEY|GLOB",
              help="op call, record key or glob (e.g. '*layers.1.mlp*/aten.silu*'); repeatable; "
                   "default: every op (up to --limit)")
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda[:i] or npu[:i]")
@click.option("--golden/--no-golden", default=True, show_default=True,
              help="also run each op in float64 on the CPU and referee the two devices")
@click.option("--limit", type=click.IntRange(min=1), default=50, show_default=True,
              help="at most this many ops (at least 1)")
@click.option("--format", "fmt", type=click.Choice(["table", "json"]), default="table")
def replay(ref, ops, device, golden, limit, fmt):
    """Re-run recorded operators of REF (--level op --store full --inputs) on their recorded
    inputs on this device (and in float64): is this device or the reference device further from
    the truth? Exit 1 when an op computes further from float64 here than on REF's device."""
    from accucheck.replay import render, replay_ops

    result = replay_ops(ref, ops, device=device, golden=golden, limit=limit)
    click.echo(render(result, fmt), nl=False)
    return result.exit_code


def _auto_runs(value: str) -> int:
    """N of `--control auto:N` (AUTO_CONTROL_RUNS for `auto`): 1 to 3 control runs."""
    n = value.partition(":")[2] or str(AUTO_CONTROL_RUNS)
    if not n.isdigit() or not 1 <= int(n) <= 3:
        raise UserError.usage(f"--control {value}: use auto (two runs), auto:1, auto:2 or "
                              f"auto:3 (the number of control runs made here)")
    return int(n)


def _plants(pairs: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    out = []
    for pair in pairs:
        module, sep, fault = pair.partition("=")
        if not sep or not module or not fault:
            raise UserError.usage(f"--plant {pair!r}: use MODULE=FAULT, e.g. "
                                  f"model.layers.1.post_attention_layernorm=norm:part:0.3")
        out.append((module, fault))
    return tuple(out)


@cli.command()
@click.argument("ref", type=click.Path(dir_okay=False))
@click.argument("model")
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda[:i] or npu[:i]")
@click.option("--dtype", default="float32", show_default=True,
              help="the candidate's dtype: float32, float16, bfloat16 or float64")
@click.option("--include", multiple=True,
              help="glob on module paths to patch (default: the decoder layer blocks)")
@click.option("--control", type=click.Path(dir_okay=False),
              help="control capture of REF (capture --control-for REF): its tensors patched "
                   "in give each site's noise band")
@click.option("--bisect", type=click.IntRange(min=0), default=0, show_default=True,
              help="then patch the child modules of the K blocks that recover most")
@click.option("--plant", "plants", multiple=True, metavar="MODULE=FAULT",
              help="plant a fault in the candidate (accucheck.capture.faults; demos, tests)")
@click.option("--noising", type=click.Path(dir_okay=False), metavar="CAND.h5",
              help="the reverse: MODEL runs as the reference device and each site gets CAND's "
                   "tensor (a full capture forced to REF's tokens): the share of CAND's gap it "
                   "brings in")
@click.option("--answers", type=click.Path(dir_okay=False), metavar="FILE.jsonl",
              help="the eval's reference answers (JSONL: \"prompt\", \"answer\"): the prompts "
                   "that differ split into score drops (REF right) and the rest")
@click.option("-o", "--output", "out", type=click.Path(dir_okay=False),
              help="write the result as JSON (refused if it exists unless --force)")
@click.option("--force", is_flag=True, help="overwrite -o")
@click.option("--trust-remote-code", is_flag=True, help="run the model directory's own code")
def impact(ref, model, device, dtype, include, control, bisect, plants, noising, answers, out,
           force, trust_remote_code):
    """Which difference matters: run MODEL (a directory, or @tiny) teacher-forced to REF's
    tokens (REF: a --store full capture) with each site's output swapped for REF's recorded
    tensor, and print the share of the logit gap each site recovers (docs/impact.md)."""
    from accucheck.impact.api import ImpactOptions, impact_dir
    from accucheck.impact.result import render

    if noising and plants:
        raise UserError.usage("--plant goes into the candidate run; with --noising MODEL runs "
                              "as the reference device: plant the fault when capturing CAND")
    opts = ImpactOptions(device=device, dtype=dtype, include=tuple(include), control=control,
                         bisect=bisect, plant=_plants(plants), noising=noising,
                         answers=answers)
    res = impact_dir(ref, _model_dir(model), opts, out=out, force=force,
                     trust_remote_code=trust_remote_code, progress=err)
    click.echo(render(res), nl=False)
    if out:
        from accucheck.paths import write_atomic

        write_atomic(out, res.dumps())
        err(f"wrote {out}")
    return 0


@cli.command("tiny-model")
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--arch", type=click.Choice(list(TINY_ARCHS)), default="llama", show_default=True,
              help="llama, or a mixture of experts")
@click.option("--force", is_flag=True, help="write into a non-empty directory")
def tiny_model(directory, seed, arch, force):
    """Write the built-in tiny Llama (or a tiny mixture of experts, --arch) + tokenizer to
    DIRECTORY: the same weights on every machine for a given seed, so GPU and NPU captures
    compare."""
    from accucheck.capture.tiny import write_tiny_model
    from accucheck.paths import check_output_dir

    d = check_output_dir(directory)
    if d.exists() and any(d.iterdir()) and not force:
        raise UserError(f"{d} is not empty: choose another directory or pass --force")
    err(f"wrote {write_tiny_model(d, seed, arch)}")
    return 0


@cli.command()
@click.argument("capture_path", metavar="CAPTURE", type=click.Path())
@click.option("-o", "--output", "out", type=click.Path(dir_okay=False),
              help="write the salvaged capture here (default: CAPTURE, which must hold no "
                   "record)")
@click.option("--force", is_flag=True, help="overwrite the output file")
def salvage(capture_path, out, force):
    """Keep what a killed vLLM capture completed: CAPTURE is the file its front end was writing
    when it was killed (SIGKILL, out of memory), or the spill directory beside it
    (.NAME.ranks-*). Writes the records of the forwards every rank completed, left incomplete
    (`diff --allow-incomplete` compares them), and removes the spill directory."""
    from accucheck.capture.runners.vllm_salvage import salvage as run_salvage

    path, kept = run_salvage(capture_path, out, force)
    steps = ", ".join(f"{r}/{s}" for r, s in kept["steps"]) or "none"
    err(f"salvaged {kept['records']} records (request/step: {steps}); {path} is left "
        f"incomplete: diff --allow-incomplete compares what it holds")
    return 0


@cli.command()
@click.option("--out-dir", default="accucheck-demo", show_default=True,
              type=click.Path(file_okay=False), help="where the demo writes its captures")
@click.option("--force", is_flag=True, help="overwrite earlier demo files")
def demo(out_dir, force):
    """Build the tiny model offline, capture a reference and a candidate with a planted fault,
    and show where they diverge."""
    from accucheck.demo import run_demo
    from accucheck.paths import check_output_dir

    check_output_dir(out_dir)
    return run_demo(Path(out_dir), force=force, echo=click.echo, log=err)


@cli.group("import")
def import_group():
    """Convert another tool's dump into an accucheck capture."""


@import_group.command("msprobe")
@click.argument("dump_dir", type=click.Path())
@click.option("-o", "--output", "out", required=True, type=click.Path(dir_okay=False),
              help="capture file to write (.h5); refused if it exists unless --force")
@click.option("--rank", default=None, help="rank to import (R of rank{R}, or a folder name "
                                           "such as proc1234); default: the first")
@click.option("--step", "steps", type=int, multiple=True, help="only this msprobe step "
                                                               "(repeatable)")
@click.option("--store", type=click.Choice(["stats", "full"]), default=None,
              help="default: full for tensor-mode dumps, stats for statistics dumps")
@click.option("--force", is_flag=True, help="overwrite the output file")
def import_msprobe_cmd(dump_dir, out, rank, steps, store, force):
    """Read an msprobe (MindStudio Probe) PyTorch dump (DUMP_DIR: msprobe's dump_path, a
    step*/ or rank*/ folder, or a dump.json) and write an accucheck capture. See
    docs/msprobe.md for what maps."""
    from accucheck.importers.msprobe import import_msprobe

    r = import_msprobe(dump_dir, out, rank=rank, steps=steps or None, store=store, force=force,
                       progress=err)
    err(f"imported {r.records} records (store {r.store}, steps {list(r.steps)}, "
        f"{r.rank or 'single rank'}, dtype {r.dtype}) from {dump_dir}")
    err(f"wrote {r.path}")
    return 0


def main(argv: list[str] | None = None) -> None:
    try:
        rv = cli.main(args=argv, prog_name="accucheck", standalone_mode=False)
    except UserError as e:
        err(f"accucheck: error: {e}")
        sys.exit(e.exit_code)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.UsageError as e:  # one line, like every other error; exit 2
        cmd = e.ctx.command_path if e.ctx is not None else "accucheck"
        err(f"accucheck: error: {one_line(e.format_message())} (see `{cmd} --help`)")
        sys.exit(EXIT_USAGE)
    except click.ClickException as e:
        err(f"accucheck: error: {one_line(e.format_message())}")
        sys.exit(e.exit_code)
    except (click.exceptions.Abort, KeyboardInterrupt):
        err("accucheck: interrupted")
        sys.exit(EXIT_BAD_INPUT)
    except RuntimeError as e:
        if not str(e).startswith("Failed to load the backend extension"):
            raise  # a bug: keep its traceback
        # `import torch` loads every installed device backend (torch_npu on an Ascend host):
        # without CANN's environment it fails, whatever --device says
        err(f"accucheck: error: importing torch failed: {one_line(str(e).split('.')[0])} "
            f"({type(e.__cause__).__name__}: {one_line(str(e.__cause__))}): on an Ascend host "
            f"source CANN's set_env.sh (e.g. /usr/local/Ascend/ascend-toolkit/set_env.sh), or "
            f"run CPU-only commands with TORCH_DEVICE_BACKEND_AUTOLOAD=0")
        sys.exit(EXIT_BAD_INPUT)
    sys.exit(rv if isinstance(rv, int) else 0)
