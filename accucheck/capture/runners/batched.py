"""Batched Hugging Face runs for the configuration matrix (accucheck.matrix): one request of
interest (row 0) among filler requests of other lengths, left-padded into one batch, row 0
teacher-forced, and, for localisation, row 0 recorded at module level into a capture file.

The same loop runs the request alone (a batch of one) and among fillers, so the two differ by
the batch alone. Positions are counted per row (left padding does not shift them) and the
attention mask hides the pads. A capture here is a plain one: module outputs (and Linear
inputs: o_proj's input is the attention core's output) of row 0 with the pads cut off, keys
and schema as `accucheck capture` writes them, so `accucheck diff` compares two of them.
Imports torch.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
from torch import nn

from accucheck.capture import device as dev
from accucheck.capture.options import CaptureOptions
from accucheck.capture.runners.hf import hf_meta
from accucheck.capture.session import CaptureSession, check_output_path
from accucheck.capture.models import cache_argument, _cache_of
from accucheck.capture.record.recorder import dtype_name, stats_rows
from accucheck.capture.record.selection import flatten, select_modules
from accucheck.capture.record.stats import to_host
from accucheck.keys import LOGITS_MODULE, RecordKey


@dataclass(frozen=True)
class RowRun:
    logits: np.ndarray          # [steps, vocab] float32: row 0's last-position logits per step
    generated: list[int]        # row 0's tokens fed at steps 1..N (forced or greedy)
    prompt_logits: np.ndarray   # [prompt length, vocab] float32: row 0's step-0 logits


def batched_run(forward: Callable, rows: Sequence[Sequence[int]], device: torch.device,
                n_new: int, *, forced: Sequence[int] | None = None, pad_id: int = 0,
                on_step: Callable[[int, int, int], None] | None = None,
                model: object | None = None) -> RowRun:
    """Greedy / forced decoding of every row at once; row 0 follows `forced` when given.
    `on_step(step, pad0, width)` runs before each forward (pad0: row 0's left pads in this
    forward's input, width: the input's length). `model`: the module `forward` runs, for its
    cache argument's name (hf.cache_argument)."""
    longest = max(len(r) for r in rows)
    ids = torch.full((len(rows), longest), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((len(rows), longest), dtype=torch.long, device=device)
    for i, r in enumerate(rows):
        ids[i, longest - len(r):] = torch.tensor(list(r), dtype=torch.long)
        mask[i, longest - len(r):] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    cache_arg, past, generated, steps = cache_argument(forward, model), None, [], []
    prompt_logits = None
    with torch.no_grad():
        for k in range(n_new + 1):
            if on_step is not None:
                on_step(k, longest - len(rows[0]) if k == 0 else 0, ids.shape[1])
            kw = {cache_arg: past} if past is not None else {}
            out = forward(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                          **kw)
            logits = out.logits.float()
            if k == 0:
                prompt_logits = logits[0, longest - len(rows[0]):].cpu().numpy()
            steps.append(logits[0, -1].cpu().numpy())
            past = _cache_of(out)
            nxt = logits[:, -1].argmax(-1)
            if forced is not None and k < len(forced):
                nxt[0] = int(forced[k])
            if k < n_new:
                generated.append(int(nxt[0]))
            ids = nxt[:, None]
            mask = torch.cat([mask, torch.ones_like(ids)], dim=1)
            pos = pos[:, -1:] + 1
    return RowRun(np.stack(steps), generated, prompt_logits)


def capture_rows(model: nn.Module, rows: Sequence[Sequence[int]], out: str | Path,
                 opts: CaptureOptions, *, forced: Sequence[int] | None = None,
                 pad_id: int = 0, label: str = "") -> RowRun:
    """Run `rows` as one batch (`batched_run`) with module-level records of row 0 written to
    `out` (request 0; the fillers are not recorded). `opts`: store, include / exclude, seed,
    device, force; eager only; the logits are full ones. `label` goes into meta "matrix_run"."""
    opts = replace(opts, logits="full")  # what this writer records, whatever the store
    check_output_path(out, opts.force)
    spec = dev.parse_device(opts.device)
    device = next(model.parameters()).device
    modules = select_modules(model, opts.include, opts.exclude)
    seeded = dev.seed_everything(opts.seed, spec)
    meta = hf_meta(model, spec, opts, modules=modules, routers=[], causal=True,
                 backend_name=None, seeded=seeded, determinism={}, graph_taps=None)
    meta["matrix_run"] = {"label": label, "batch": len(rows),
                          "row_lengths": [len(r) for r in rows],
                          "note": "row 0 of a left-padded batch, pads cut off"}
    at = {"step": 0, "pad0": 0, "width": 0, "calls": {}}
    pending: list[tuple[RecordKey, torch.Tensor]] = []
    batch = len(rows)

    def row0(t: torch.Tensor) -> torch.Tensor | None:
        if not t.is_floating_point() or t.dim() < 2 or t.shape[0] != batch:
            return None
        t = t[:1]
        if at["pad0"] and t.dim() >= 3 and t.shape[1] == at["width"]:
            t = t[:, at["pad0"]:]
        return t.detach().clone()

    def hook(name: str, linear: bool):
        def post(_m, args, output):
            call = at["calls"].get(name, 0)
            at["calls"][name] = call + 1
            slots = ([("in", "0", args[0])] if linear and args and
                     isinstance(args[0], torch.Tensor) else [])
            slots += [("out", s, t) for s, t in flatten(output)]
            for role, slot, t in slots:
                r = row0(t)
                if r is not None:
                    pending.append((RecordKey(0, at["step"], name, call, role, slot), r))
        return post

    by_name = dict(model.named_modules())
    session = CaptureSession(out, meta, opts, requests=1, steps=opts.max_new_tokens + 1,
                             require=False)
    writer = session.writer
    with session:
        handles = [by_name[n].register_forward_hook(hook(n, isinstance(by_name[n], nn.Linear)))
                   for n in modules]
        try:
            def on_step(step: int, pad0: int, width: int) -> None:
                flush()
                at.update(step=step, pad0=pad0, width=width, calls={})

            def flush() -> None:
                if not pending:
                    return
                hosts = [to_host(t)[0] for _, t in pending]
                for (key, t), host, (stats, checksum) in zip(
                        pending, hosts, stats_rows([t for _, t in pending], hosts)):
                    writer.add(key, "module", dtype_name(t), tuple(t.shape), stats, checksum,
                               host if writer.store == "full" else None)
                pending.clear()

            run = batched_run(model, rows, device, opts.max_new_tokens, forced=forced,
                              pad_id=pad_id, on_step=on_step)
            flush()
            for step in range(opts.max_new_tokens + 1):
                lg = run.prompt_logits[None] if step == 0 else run.logits[step:step + 1][None]
                lg = np.ascontiguousarray(lg, dtype=np.float32)
                [(stats, checksum)] = stats_rows([torch.from_numpy(lg)], [lg])
                writer.add(RecordKey(0, step, LOGITS_MODULE, 0, "out", "0"), "logits", "float32",
                           lg.shape, stats, checksum, lg if writer.store == "full" else None)
            writer.set_request(0, list(rows[0]), run.generated, None)
            session.finish()
            return run
        finally:
            for h in handles:
                h.remove()
