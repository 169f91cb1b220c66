"""Patching a module's output with a recorded tensor, and the teacher-forced runs that measure
the output gap. Imports torch, accucheck.keys / store / errors, capture.models (the HF
runner's greedy_run) and impact.gap.

Two ways to patch a site (`Plan.mode`):
- "output": the module's output is replaced by the recorded tensor (attention, MLP, norms, any
  module whose output is not the residual stream itself);
- "update": a decoder layer block (`model.layers.N`), whose output IS the residual stream, keeps
  the candidate's input and gets the recorded block's update added to it:
  out = out_rec + (x_cand - in_rec), i.e. x_cand + (out_rec - in_rec). Replacing the whole
  stream would recover the entire gap at every block after a fault and so name none of them.
  in_rec is the block's recorded input, else the previous block's output, else (the first
  block) the embeddings' output.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np
import torch
from torch import nn

from accucheck.capture.models import greedy_run
from accucheck.errors import UserError
from accucheck.impact.gap import Gap, GapSum, log_softmax
from accucheck.keys import LOGITS_MODULE, RecordKey, split_rank
from accucheck.store import CaptureReader, logits_topk

EMBED_NAMES = ("embed_tokens", "embeddings", "wte", "embed_in")


@dataclass(frozen=True)
class Request:
    prompt_ids: tuple[int, ...]
    generated: tuple[int, ...]

    def steps(self) -> range:
        return range(len(self.generated) + 1)

    def targets(self, step: int) -> np.ndarray:
        """The forced next token of each position of `step`'s logits; -1: none."""
        gen = list(self.generated)
        if step == 0:
            return np.array(list(self.prompt_ids[1:]) + (gen[:1] or [-1]), dtype=np.int64)
        return np.array([gen[step] if step < len(gen) else -1], dtype=np.int64)


def requests_of(reader: CaptureReader) -> list[Request]:
    return [Request(tuple(int(t) for t in q.prompt_ids), tuple(int(t) for t in q.generated_ids))
            for q in reader.requests]


class OutputIndex:
    """A capture's full module records: module -> role -> {(req, step, call): {slot: key}}."""

    def __init__(self, reader: CaptureReader):
        self.by_module: dict[str, dict[str, dict[tuple, dict[str, RecordKey]]]] = {}
        for row in reader.rows:
            k = row.key
            if k.is_op or not row.has_data or split_rank(k.slot)[1] is not None:
                continue
            calls = self.by_module.setdefault(k.module, {}).setdefault(k.role, {})
            calls.setdefault((k.req, k.step, k.call), {})[k.slot] = k

    def records(self, module: str, role: str = "out") -> dict[tuple, dict[str, RecordKey]]:
        return self.by_module.get(module, {}).get(role, {})


def missing_step(index: OutputIndex, module: str, requests: Sequence[Request],
                 role: str = "out") -> str | None:
    """Why `module` cannot be patched from this capture (a step without a full record), or
    None when every request and step has one."""
    recs = index.records(module, role)
    if not recs:
        return f"no full {role}put record in the capture"
    for r, req in enumerate(requests):
        for s in req.steps():
            if (r, s, 0) not in recs:
                return f"no full {role}put record at r{r}.s{s}"
    return None


def logits_keys(reader: CaptureReader, requests: Sequence[Request], flag: str
                ) -> dict[tuple[int, int], RecordKey]:
    """(req, step) -> the capture's full logits record (UserError when one is missing, or the
    capture holds top-k log-probabilities: capture --logits topk:K)."""
    if (k := logits_topk(reader.meta)) is not None:
        raise UserError(f"{flag} {reader.path}: holds its logits as the top-{k} "
                        f"log-probabilities (capture --logits topk:{k}); impact measures the "
                        f"output gap over the whole vocabulary: capture it with --store full "
                        f"and --logits full")
    out = {}
    for r, req in enumerate(requests):
        for s in req.steps():
            key = RecordKey(r, s, LOGITS_MODULE, 0, "out", "0")
            if key not in reader or not reader.row(key).has_data:
                raise UserError(f"{flag} {reader.path}: no full logits record {key}; capture it "
                                f"with --store full (logits are recorded by default)")
            out[(r, s)] = key
    return out


def ref_logits(reader: CaptureReader, requests: Sequence[Request], flag: str
               ) -> dict[tuple[int, int], np.ndarray]:
    """(req, step) -> the capture's log-softmax (positions, vocab), float64."""
    out = {}
    for at, key in logits_keys(reader, requests, flag).items():
        arr = reader.read(key)
        out[at] = log_softmax(arr.reshape(-1, arr.shape[-1]))
    return out


def logits_gap(ref: dict, other: dict, requests: Sequence[Request]) -> Gap:
    """The gap between two captures' recorded logits (e.g. the control's own gap)."""
    gs = GapSum()
    for r, req in enumerate(requests):
        for s in req.steps():
            gs.add(ref[(r, s)], other[(r, s)], req.targets(s), r)
    return gs.gap()


@dataclass(frozen=True)
class Plan:
    """What patching one site takes: its module, the mode, and the records to read."""
    site: str
    mode: str  # "output" or "update"
    outputs: dict = field(repr=False, compare=False)  # (req, step, call) -> {slot: key}
    inputs: dict = field(repr=False, compare=False, default_factory=dict)  # (req, step) -> key


def residual_input(index: OutputIndex, site: str, blocks: Sequence[str], embed: str | None,
                   requests: Sequence[Request]) -> tuple[dict | None, str]:
    """(req, step) -> the record holding block `site`'s input, and where it comes from; None
    and why when there is none for every step."""
    own = index.records(site, "in")
    hidden = {(r, s): own.get((r, s, 0), {}).get("0") or own.get((r, s, 0), {})
              .get("hidden_states") for r, req in enumerate(requests) for s in req.steps()}
    if all(k is not None for k in hidden.values()):
        return hidden, f"{site} input"
    i = list(blocks).index(site)
    source = blocks[i - 1] if i > 0 else embed
    if source is None:
        return None, "no record of its input (capture with --inputs)"
    why = missing_step(index, source, requests)
    if why is not None:
        return None, f"its input {source}: {why}"
    recs = index.records(source)
    return {(r, s): recs[(r, s, 0)].get("0") for r, req in enumerate(requests)
            for s in req.steps()}, f"{source} output"


def plan_site(index: OutputIndex, site: str, requests: Sequence[Request], *, block: bool,
              blocks: Sequence[str] = (), embed: str | None = None) -> Plan | str:
    """The plan to patch `site` from this capture, or why it cannot be patched."""
    why = missing_step(index, site, requests)
    if why is not None:
        return why
    outputs = index.records(site)
    if not block:
        return Plan(site, "output", outputs)
    if any("0" not in outputs[(r, s, 0)] for r, req in enumerate(requests) for s in req.steps()):
        return "its output has no slot 0 (the hidden states)"
    inputs, how = residual_input(index, site, blocks, embed, requests)
    if inputs is None or any(v is None for v in inputs.values()):
        return how if inputs is None else f"{how} has no slot 0 (the hidden states)"
    return Plan(site, "update", outputs, inputs)


def load_plan(reader: CaptureReader, plan: Plan, device: torch.device, dtype: torch.dtype
              ) -> dict[tuple, dict[str, torch.Tensor]]:
    """(req, step, call) -> {slot: tensor}: the recorded outputs in the candidate's dtype on its
    device ("output"), or the block's recorded output "0" and input "in" in float32
    ("update")."""
    out = {}
    for (r, s, c), slots in plan.outputs.items():
        if plan.mode == "output":
            out[(r, s, c)] = {slot: _tensor(reader.read(k), device, dtype)
                              for slot, k in slots.items()}
        elif c == 0:
            out[(r, s, c)] = {
                "0": torch.from_numpy(reader.read(slots["0"]).astype(np.float32)).to(device),
                "in": torch.from_numpy(reader.read(plan.inputs[(r, s)]).astype(np.float32))
                .to(device)}
    return out


def _tensor(arr: np.ndarray, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A recorded array on the candidate's device; floating ones in its dtype, integer ones
    (MoE expert ids) as they are (bf16 holds integers exactly only up to 256)."""
    t = torch.from_numpy(np.ascontiguousarray(arr))
    return t.to(device, dtype) if t.is_floating_point() else t.to(device)


class StepState:
    """The request and step the running forward belongs to (set by the runner's on_step)."""
    req = 0
    step = 0


def _replace(obj, rec: dict[str, torch.Tensor], site: str, prefix: str = ""):
    if isinstance(obj, torch.Tensor):
        t = rec.get(prefix or "0")
        if t is None:
            return obj
        if tuple(t.shape) != tuple(obj.shape):
            raise UserError(f"{site}: the recorded tensor {prefix or '0'} has shape "
                            f"{list(t.shape)}, the candidate's output {list(obj.shape)}: another "
                            f"model or other prompts than the reference's?")
        return t.to(obj.dtype)
    if isinstance(obj, (tuple, list)) and type(obj) in (tuple, list):
        return type(obj)(_replace(v, rec, site, f"{prefix}.{i}" if prefix else str(i))
                         for i, v in enumerate(obj))
    return obj


def _shape(x) -> str:
    return f"shape {list(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__


def _hook(site: str, mode: str, tensors: dict, state: StepState):
    calls: dict[tuple[int, int], int] = {}

    def hook(_mod, args, kwargs, out):
        at = (state.req, state.step)
        c = calls.get(at, 0)
        calls[at] = c + 1
        rec = tensors.get(at + (c,))
        if rec is None:
            return None
        if mode == "update":
            x = args[0] if args else kwargs.get("hidden_states")
            o, i = rec["0"], rec["in"]
            if not isinstance(x, torch.Tensor) or x.shape != i.shape:
                raise UserError(f"{site}: its input is {_shape(x)}, the recorded input "
                                f"{list(i.shape)}: another model or other prompts than the "
                                f"reference's?")
            # out_REF + (x - in_REF): exactly out_REF where the input is REF's (upstream of
            # any difference), so a block there recovers exactly nothing
            rec = {"0": (o + (x.float() - i)).to(x.dtype)}
        return _replace(out, rec, site)
    return hook


@contextmanager
def patched(model: nn.Module, patches: Sequence[tuple[Plan, dict]], state: StepState
            ) -> Iterator[None]:
    """While active, each plan's module is patched with its loaded tensors; every hook is
    removed on exit, also when the forward raises."""
    mods = dict(model.named_modules())
    handles = []
    try:
        for plan, tensors in patches:
            handles.append(mods[plan.site].register_forward_hook(
                _hook(plan.site, plan.mode, tensors, state), with_kwargs=True))
        yield
    finally:
        for h in handles:
            h.remove()


def forced_pass(model: nn.Module, requests: Sequence[Request], device: torch.device,
                ref: dict[tuple[int, int], np.ndarray], state: StepState) -> Gap:
    """One teacher-forced run of every request (prefill + every decode step) and its gap to
    the reference's logits `ref`."""
    gs = GapSum()
    for r, req in enumerate(requests):
        def on_step(k: int, r=r) -> None:
            state.req, state.step = r, k

        def on_logits(logits, r=r, req=req) -> None:
            lg = logits[0].detach().to("cpu", torch.float64).numpy()
            gs.add(ref[(r, state.step)], lg, req.targets(state.step), r)
        greedy_run(model, req.prompt_ids, device, len(req.generated), forced=req.generated,
                   on_step=on_step, on_logits=on_logits, causal=True, model=model)
    return gs.gap()
