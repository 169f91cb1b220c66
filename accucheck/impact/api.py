"""`accucheck impact`: check every input, run the candidate teacher-forced to the reference's
tokens, patch each site with the reference's tensor (and the control's), and measure the share
of the output gap each recovers. Imports torch, bottom (store, keys, paths, errors) and capture
(the HF loader and runner, faults); the CLI is a thin layer over `impact_dir`.
"""
from __future__ import annotations

import contextlib
import copy
import fnmatch
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

from torch import nn

from accucheck.capture import device as dev
from accucheck.capture.models import check_model_dir, config_hash, load_model_dir, parse_dtype
from accucheck.errors import UserError
from accucheck.impact.answers import judge, read_answers
from accucheck.impact.gap import Gap, introduced, recovered
from accucheck.impact.patch import (EMBED_NAMES, OutputIndex, Plan, StepState, forced_pass,
                                    load_plan, logits_gap, logits_keys, patched, plan_site,
                                    ref_logits, requests_of)
from accucheck.impact.result import ImpactResult, SiteImpact
from accucheck.keys import is_layer_block, layer_of
from accucheck.paths import check_not_input, check_output_file
from accucheck.store import CaptureReader, Selection, open_capture


@dataclass(frozen=True)
class ImpactOptions:
    """device / dtype: where and how the candidate runs (dtype default float32). include:
    globs on module paths (default: the decoder layer blocks). control: a control capture of
    REF (`capture --control-for REF`) whose tensors give each site's noise band. bisect: patch
    the children of the K blocks that recover most. plant: (module, fault) pairs planted in
    the candidate (accucheck.capture.faults; demos and tests). noising: a full capture of the
    candidate, forced to REF's tokens: MODEL then runs as the reference device and each site
    gets the candidate's tensor instead (the share of the candidate's gap it brings in).
    answers: an eval's reference answers (JSONL, impact.answers): the prompts that differ are
    split into those REF answers right (a score drop) and the rest; needs the tokenizer."""
    device: str = "cpu"
    dtype: str | None = None
    include: tuple[str, ...] = ()
    control: str | None = None
    bisect: int = 0
    plant: tuple[tuple[str, str], ...] = ()
    noising: str | None = None
    answers: str | None = None

    def __post_init__(self) -> None:
        if self.bisect < 0:
            raise UserError.usage("--bisect K needs K >= 0")
        if self.dtype is not None:
            parse_dtype(self.dtype)
        dev.parse_device(self.device)


def check_servable(r: CaptureReader, flag: str) -> None:
    """Impact swaps recorded tensors into whole runs: a capture with statistics only, or one
    that recorded part of the run (capture --positions / --requests / --layers), cannot serve
    (UserError, exit 3, one line)."""
    if r.store_mode != "full":
        raise UserError(f"{flag} {r.path}: it holds statistics only; impact swaps recorded "
                        f"tensors in: capture it with --store full")
    sel = Selection.of(r.meta)
    if sel.partial:
        raise UserError(f"{flag} {r.path}: it records part of the run ({sel.describe()}); "
                        f"impact replays every position of every request: capture it without "
                        f"--positions / --requests / --layers")


def check_capture(path: str | Path, flag: str) -> None:
    """A capture that can serve as REF / --control: opens complete, holds tensors, prompts and
    a full logits record at every step (UserError, exit 3, one line)."""
    with open_capture(path) as r:
        check_servable(r, flag)
        if not r.requests:
            raise UserError(f"{flag} {path}: it holds no prompts")
        logits_keys(r, requests_of(r), flag)


def impact_dir(ref: str | Path, model_dir: str | Path, opts: ImpactOptions, *,
               out: str | Path | None = None, force: bool = False,
               trust_remote_code: bool = False,
               progress: Callable[[str], None] | None = None) -> ImpactResult:
    """Check every input (REF, --control, the output path, the model directory), then load
    the model on `opts.device` in `opts.dtype` and measure (`impact_model`)."""
    if out is not None:
        check_not_input(out, {"REF": str(ref), "--control": opts.control,
                              "--noising": opts.noising, "--answers": opts.answers})
        check_output_file(out, force)
    check_capture(ref, "REF")
    for path, flag in ((opts.control, "--control"), (opts.noising, "--noising")):
        if path:
            check_capture(path, flag)
    if opts.answers:
        read_answers(opts.answers)
    check_model_dir(model_dir, trust_remote_code=trust_remote_code)
    dtype = parse_dtype(opts.dtype or "float32")
    tdev = dev.torch_device(dev.parse_device(opts.device))
    model, tok = load_model_dir(model_dir, dtype, tdev, trust_remote_code=trust_remote_code)
    return impact_model(ref, model, opts, progress=progress, tokenizer=tok)


def impact_model(ref: str | Path, model: nn.Module, opts: ImpactOptions | None = None, *,
                 progress: Callable[[str], None] | None = None,
                 tokenizer=None) -> ImpactResult:
    """Measure on `model` as it is (its device and dtype; not modified: hooks are removed
    afterwards). Raises UserError for inputs that do not fit the model. `tokenizer`: the
    model's, to read REF's answers as text (`opts.answers` needs it)."""
    opts = opts or ImpactOptions()
    table = read_answers(opts.answers) if opts.answers else None
    if table is not None and tokenizer is None:
        raise UserError("--answers needs the model's tokenizer to read REF's answers as text")
    say = progress or (lambda _msg: None)
    if model.training:  # dropout would move every run: an eval copy, the user's untouched
        model = copy.deepcopy(model).eval()
    with contextlib.ExitStack() as stack:
        r = stack.enter_context(open_capture(ref))
        c = stack.enter_context(open_capture(opts.control)) if opts.control else None
        n = stack.enter_context(open_capture(opts.noising)) if opts.noising else None
        for cap, flag in ((r, "REF"), (c, "--control"), (n, "--noising")):
            if cap is not None:
                check_servable(cap, flag)
        requests = requests_of(r)
        _check_model(model, r, requests)
        if c is not None and requests_of(c) != requests:
            raise UserError(f"--control {c.path}: it follows other prompts or tokens than "
                            f"REF; make it with `accucheck capture MODEL --control-for {r.path}`")
        if n is not None and requests_of(n) != requests:
            raise UserError(f"--noising {n.path}: it follows other prompts or tokens than "
                            f"REF; capture the candidate with --tokens-from {r.path}")
        right = ()
        if table is not None:
            texts = [tokenizer.decode(list(q.generated), skip_special_tokens=True)
                     for q in requests]
            right = judge([q.prompt or "" for q in r.requests], texts, table, opts.answers)
        run = _Runs(model, requests, ref_logits(r, requests, "REF"), say, opts.plant)
        res = _measure(run, r, c, model, opts, requests, n)
        return replace(res, ref_right=right, answers_file=opts.answers) if right else res


class _Runs:
    """Counts and times the teacher-forced runs."""

    def __init__(self, model: nn.Module, requests, ref: dict, say: Callable[[str], None],
                 plant: Sequence[tuple[str, str]] = ()):
        self.model, self.requests, self.ref, self.say = model, requests, ref, say
        self.plant = tuple(plant)  # planted afresh for every run: seeded faults repeat
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.count, self.seconds = 0, 0.0
        self.state = StepState()

    def gap(self, patches: Sequence[tuple[Plan, dict]] = (), replay=None) -> Gap:
        """One teacher-forced run with `patches` (and `replay`, a RoutingReplay: REF's expert
        ids in its routers) and its gap to REF."""
        from accucheck.capture.faults import planted

        t = time.perf_counter()
        with contextlib.ExitStack() as stack:
            for module, fault in self.plant:
                stack.enter_context(planted(self.model, module, fault))
            stack.enter_context(patched(self.model, patches, self.state))
            if replay is not None:
                stack.enter_context(replay.installed(self.model))
                h = self.model.register_forward_pre_hook(
                    lambda *_: replay.begin_step(self.state.req, self.state.step))
                stack.callback(h.remove)
            g = forced_pass(self.model, self.requests, self.device, self.ref, self.state)
        self.count += 1
        self.seconds += time.perf_counter() - t
        return g


def _check_model(model: nn.Module, r: CaptureReader, requests) -> None:
    want = r.meta.get("model", {}).get("config_hash")
    if want and config_hash(model) and want != config_hash(model):
        raise UserError(f"REF {r.path}: captured with another model (config hash {want} vs "
                        f"{config_hash(model)}); give the model REF was captured with")
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        raise UserError("impact needs a causal LM (a model with an output head)")
    vocab = head.weight.shape[0]
    if any(t >= vocab for q in requests for t in q.prompt_ids + q.generated):
        raise UserError(f"REF {r.path}: token ids beyond this model's vocabulary ({vocab})")


def select_sites(model: nn.Module, include: Sequence[str]) -> list[str]:
    """Module paths to patch in named_modules order: the decoder layer blocks, or the modules
    matching `include`."""
    names = [n for n, _ in model.named_modules() if n]
    if include:
        return [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in include)]
    return [n for n in names if is_layer_block(n)]


def _plans(model: nn.Module, cap: CaptureReader, requests, sites: Sequence[str]
           ) -> dict[str, Plan | str]:
    index = OutputIndex(cap)
    names = [n for n, _ in model.named_modules() if n]
    blocks = [n for n in names if is_layer_block(n)]
    embed = next((n for n in names if n.split(".")[-1] in EMBED_NAMES and layer_of(n) is None),
                 None)
    return {s: plan_site(index, s, requests, block=s in blocks, blocks=blocks, embed=embed)
            for s in sites}


def _site(run: _Runs, r: CaptureReader, c: CaptureReader | None, plan: Plan,
          cplan: Plan | str | None, base: Gap, level: str, share=recovered) -> SiteImpact:
    """One site patched from `r` (REF; the candidate's capture when noising), and from the
    control `c` for its band; `share(base, gap)`: recovered (denoising) or introduced."""
    run.say(f"impact: patching {plan.site} ({plan.mode}), run {run.count + 1}")
    g = run.gap([(plan, load_plan(r, plan, run.device, run.dtype))])
    band_gap = None
    if isinstance(cplan, Plan):
        band_gap = run.gap([(cplan, load_plan(c, cplan, run.device, run.dtype))])
    return SiteImpact(plan.site, level, plan.mode, g, share(base, g),
                      share(base, band_gap) if band_gap is not None else None,
                      None if c is None or band_gap is not None else str(cplan))


def _measure(run: _Runs, r: CaptureReader, c: CaptureReader | None, model: nn.Module,
             opts: ImpactOptions, requests, n: CaptureReader | None = None) -> ImpactResult:
    """Denoising (REF's tensors into the candidate run) or, with `n`, noising (the
    candidate's tensors from `n` into a reference-device run)."""
    sites = select_sites(model, opts.include)
    if not sites:
        raise UserError("no module matches --include: run `accucheck capture MODEL "
                        "--list-modules` to see the module paths")
    src = n if n is not None else r  # whose tensors are patched in
    plans = _plans(model, src, requests, sites)
    cplans = _plans(model, c, requests, sites) if c is not None else {}
    usable = [p for p in plans.values() if isinstance(p, Plan)]
    skipped = tuple((s, p) for s, p in plans.items() if isinstance(p, str))
    if not usable:
        flag = "--noising" if n is not None else "REF"
        raise UserError(f"{flag} {src.path}: no selected site can be patched ({skipped[0][0]}: "
                        f"{skipped[0][1]}); capture it with --store full and the default "
                        f"module selection")
    run.say(f"impact: baseline run ({len(requests)} prompt(s), teacher-forced to REF)")
    base = run.gap()
    ctl_gap = logits_gap(run.ref, ref_logits(c, requests, "--control"), requests) \
        if c is not None else None
    total = logits_gap(run.ref, ref_logits(n, requests, "--noising"), requests) \
        if n is not None else None
    share, against = (introduced, total) if n is not None else (recovered, base)
    result = dict(baseline=base, control_gap=ctl_gap, skipped=skipped, sites=(), together=None,
                  children=(), total=total)
    if not against.is_zero():
        rows = [_site(run, src, c, p, cplans.get(p.site), against, "site", share)
                for p in usable]
        run.say(f"impact: patching all {len(usable)} sites together")
        g = run.gap([(p, load_plan(src, p, run.device, run.dtype)) for p in usable])
        together = SiteImpact(f"all {len(usable)} sites", "all", "-", g, share(against, g),
                              None, None)
        result.update(sites=tuple(rows), together=together,
                      children=_bisect(run, src, c, model, rows, opts.bisect, requests,
                                       against, share),
                      routing=_routing(run, src, c, model, usable, against, share))
    return ImpactResult(ref=str(r.path), control=str(c.path) if c is not None else None,
                        device=str(run.device), dtype=str(run.dtype).replace("torch.", ""),
                        runs=run.count, seconds=run.seconds, bisect=opts.bisect,
                        prompts=tuple(q.prompt or "" for q in r.requests),
                        noising=str(n.path) if n is not None else None, **result)


def _routing(run: _Runs, r: CaptureReader, c: CaptureReader | None, model: nn.Module,
             plans: Sequence[Plan], against: Gap, share=recovered) -> tuple[SiteImpact, ...]:
    """Each patched MoE router (a site patched whole: logits, weights, ids) patched again with
    REF's expert ids alone, its routing weights the candidate's own at those experts
    (RoutingReplay, as capture --routing-from): how much of the gap the routing choice explains
    (the control's ids for the band)."""
    from accucheck.capture.record.moe import RoutingReplay, find_routers

    routers = {x.gate: x for x in find_routers(model)}
    out = []
    for p in plans:
        router = routers.get(p.site)
        if router is None or p.mode != "output":
            continue
        gaps = []
        for cap in (r, c):
            if cap is None:
                gaps.append(None)
                continue
            run.say(f"impact: routing {p.site} as {cap.path} routes, run {run.count + 1}")
            replay = RoutingReplay(str(cap.path), [router])
            try:
                gaps.append(run.gap((), replay))
            finally:
                replay.close()
        out.append(SiteImpact(p.site, "site", "ids", gaps[0], share(against, gaps[0]),
                              share(against, gaps[1]) if gaps[1] is not None else None, None))
    return tuple(out)


def _bisect(run: _Runs, r, c, model: nn.Module, rows: Sequence[SiteImpact], k: int,
            requests, base: Gap, share=recovered) -> tuple[SiteImpact, ...]:
    """Inside the k blocks whose share is largest, patch each direct child module."""
    blocks = [s for s in rows if s.mode == "update"]
    top = sorted(blocks, key=lambda s: -s.score())[:k]
    mods = dict(model.named_modules())
    out = []
    for b in top:
        children = [f"{b.site}.{n}" for n, _ in mods[b.site].named_children()]
        plans = _plans(model, r, requests, children)
        cplans = _plans(model, c, requests, children) if c is not None else {}
        out += [_site(run, r, c, p, cplans.get(p.site), base, "child", share)
                for p in plans.values() if isinstance(p, Plan)]
    return tuple(out)
