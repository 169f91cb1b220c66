"""`capture --control-for REF`: the options of a control run made from a reference capture.
Imports errors, store and capture.api (options); torch only through capture.api.

A control is the reference's code at the candidate's dtype on a trusted device (bf16 on the
CPU; or the GPU itself at another batch size or thread count), forced to the reference's
tokens (accucheck.compare.control). So it takes from REF: the prompts (as token ids: the same
tokenization whatever the tokenizer here), the generated tokens (teacher forcing), the store
mode, the module selection (--include / --exclude), --inputs, --level and the number of
decode steps; and from the command line: the device (default cpu), the dtype (default: the
reference's, the bf16-vs-bf16 case; give --dtype bfloat16 for a float32 reference), the seed
and --deterministic. It always runs eager (the trusted path).
"""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from accucheck.capture.api import CaptureOptions
from accucheck.errors import UserError
from accucheck.store import open_capture

TAKEN = ("store", "include", "exclude", "record_inputs", "level", "max_new_tokens")


def control_run(ref: str | Path, opts: CaptureOptions, *, dtype_given: bool
                ) -> tuple[list[list[int]], CaptureOptions]:
    """(prompt token ids, options) of a control of capture `ref`; `opts` holds what the
    command line said (device, dtype when `dtype_given`, seed, determinism, output)."""
    with open_capture(ref) as r:
        meta, requests = r.meta, r.requests
    if not requests:
        raise UserError(f"--control-for {ref}: it holds no prompts to follow")
    taken = meta.get("options") if isinstance(meta.get("options"), dict) else {}
    fields = {k: taken[k] for k in TAKEN if k in taken}
    for k in ("include", "exclude"):
        if k in fields:
            fields[k] = tuple(fields[k] or ())
    steps = {len(q.generated_ids) for q in requests}
    fields["max_new_tokens"] = min(steps)
    dtype = opts.dtype if dtype_given else (meta.get("dtype") or opts.dtype)
    new = CaptureOptions(**{**asdict(opts), **fields, "dtype": dtype, "mode": "eager",
                            "tokens_from": str(ref), "shadow": None,
                            "meta_extra": {**opts.meta_extra, "control_for": str(ref)}})
    return [[int(t) for t in q.prompt_ids] for q in requests], new
