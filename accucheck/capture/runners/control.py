"""`capture --control-for REF`: the options of a control run made from a reference capture;
`diff --control auto[:N]` (`auto_control`): that run (or N of them) made here, beside the
candidate. Imports
errors, store and capture.runners.hf (options); torch only through capture.runners.hf.

A control is the reference's code at the candidate's dtype on a trusted device (bf16 on the
CPU; or the GPU itself at another batch size or thread count), forced to the reference's
tokens (accucheck.compare.control). So it takes from REF: the prompts (as token ids: the same
tokenization whatever the tokenizer here), the generated tokens (teacher forcing), the store
mode, the module selection (--include / --exclude / --layers), what is recorded of the run
(--positions, --requests, --logits), --inputs, --level and the number of decode steps; and from the
command line: the device (default cpu), the dtype (default: the reference's, the bf16-vs-bf16
case; give --dtype bfloat16 for a float32 reference), the seed
and --deterministic. It always runs eager (the trusted path).

It is dithered by default (CaptureOptions.dither = the seed: every rounding op's output moved
one ULP on a quarter of its elements): it then stands for a device of the precision that is
correct to one ULP, not for the CPU's round-to-nearest kernels alone. Against a plain CPU
control, a candidate correct to one ULP (the emulated dither device) was flagged at layer 0's
input_layernorm, where the input is exact and an op's rounding shows bare, in every one of 100
clean SmolLM2 pairs, and one with a 10 % dither (the mixed device), mostly at layer 0's q /
k_proj, in 21 of 100 (bench/bench_devices.py, column "plain control"; docs/control.md). Every rate
of the control rule in docs/control.md was measured against dithered controls. `plain` (capture
--plain-control) makes the CPU's own run: stricter, it flags a device that rounds less
carefully than round-to-nearest. Two controls: two seeds (--seed 1, --seed 2).
"""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from accucheck.capture.options import CaptureOptions
from accucheck.errors import UserError
from accucheck.store import open_capture

TAKEN = ("store", "include", "exclude", "record_inputs", "level", "max_new_tokens",
         "positions", "requests", "layers", "logits")


def control_run(ref: str | Path, opts: CaptureOptions, *, dtype_given: bool,
                plain: bool = False) -> tuple[list[list[int]], CaptureOptions]:
    """(prompt token ids, options) of a control of capture `ref`; `opts` holds what the
    command line said (device, dtype when `dtype_given`, seed, determinism, output); dithered
    with the seed unless `plain` (see the module docstring)."""
    with open_capture(ref) as r:
        meta, requests = r.meta, r.requests
    if not requests:
        raise UserError(f"--control-for {ref}: it holds no prompts to follow")
    taken = meta.get("options") if isinstance(meta.get("options"), dict) else {}
    fields = {k: taken[k] for k in TAKEN if k in taken}
    for k in ("include", "exclude", "requests"):
        if k in fields:
            fields[k] = tuple(fields[k] or ())
    fields.setdefault("logits", "full")  # a capture without it holds full logits
    steps = {len(q.generated_ids) for q in requests}
    fields["max_new_tokens"] = min(steps)
    dtype = opts.dtype if dtype_given else (meta.get("dtype") or opts.dtype)
    new = CaptureOptions(**{**asdict(opts), **fields, "dtype": dtype, "mode": "eager",
                            "tokens_from": str(ref), "shadow": None,
                            "dither": None if plain else opts.seed,
                            "meta_extra": {**opts.meta_extra, "control_for": str(ref)}})
    return [[int(t) for t in q.prompt_ids] for q in requests], new


def auto_control(ref: str | Path, cand: str | Path, *, runs: int = 1, force: bool = False,
                 progress=None) -> list[Path]:
    """`diff --control auto[:N]` (N = 2 for `auto`: the CLI's AUTO_CONTROL_RUNS): N controls
    of `ref` at `cand`'s dtype (dithered with seeds 0 .. N-1), made here on the CPU from the
    model directory REF's meta names (hf, eager), written beside CAND as
    CAND-STEM.control.h5, CAND-STEM.control2.h5, ... and reused on the next diff. Two controls measured better than one on the emulated devices (docs/control.md:
    91 % of x2 faults named against 83 %, 1 false alarm in 400 clean pairs against 4). Checked
    before anything is written: the model directory must exist here; an existing file there
    must be a complete control of this REF at that dtype and seed (else a one-line error:
    nothing is overwritten unless `force`). REF may be hf eager on the CPU at that dtype
    itself: the control is dithered, so it still measures what a device correct to one ULP
    differs from it by."""
    from accucheck.capture.runners.hf import capture_dir

    with open_capture(ref) as r:
        model_dir = r.meta.get("model_path")
    with open_capture(cand) as c:
        dtype = c.meta.get("dtype")
    outs = [Path(cand).with_name(Path(cand).stem + (f".control{k + 1}.h5" if k else
                                                    ".control.h5")) for k in range(runs)]
    if not model_dir or not Path(model_dir).is_dir():
        raise UserError(f"--control auto: {ref} names no model directory that exists here "
                        f"({model_dir or 'none recorded'}): make the control where the model "
                        f"is (accucheck capture MODEL --control-for {ref} --dtype {dtype} -o "
                        f"ctl.h5) and pass --control ctl.h5")
    reuse = [out.exists() and not force for out in outs]
    for seed, (out, again) in enumerate(zip(outs, reuse)):  # every clash before any capture
        if again and not _is_control(out, ref, dtype, seed):
            raise UserError(f"--control auto: {out} exists and is not a complete control of "
                            f"{ref} at {dtype} (seed {seed}): remove it, or pass it as "
                            f"--control {out}")
    for seed, (out, again) in enumerate(zip(outs, reuse)):
        if again:
            if progress:
                progress(f"control: using {out} (made earlier for {ref})")
            continue
        plist, opts = control_run(ref, CaptureOptions(dtype=dtype or "float32", force=force,
                                                      seed=seed),
                                  dtype_given=dtype is not None)
        if progress:
            progress(f"control: capturing {model_dir} on cpu ({opts.dtype}, eager, dithered "
                     f"with seed {seed}, store {opts.store}) for {len(plist)} prompt(s) -> {out}")
        capture_dir(model_dir, plist, out, opts, progress=progress)
    return outs


def _is_control(path: Path, ref: str | Path, dtype: str | None, seed: int) -> bool:
    """`path` opens complete as a dithered control of `ref` at `dtype` with `seed`."""
    try:
        with open_capture(path) as o:
            opts = o.meta.get("options") if isinstance(o.meta.get("options"), dict) else {}
            return (o.meta.get("control_for") == str(ref) and o.meta.get("dtype") == dtype
                    and opts.get("dither", seed) == seed)
    except UserError:
        return False
