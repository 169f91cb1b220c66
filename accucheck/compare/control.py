"""Control runs: the reference's code at the candidate's dtype on a trusted device (bf16 on the
CPU, or the GPU itself at another batch size or thread count), forced to the reference's
tokens. Imports errors and compat only; never torch or h5py (readers are passed in).

A control answers "more than noise?": per record, err(CTL, REF) is the error the candidate's
precision makes by itself, so the candidate's error is judged against it (verdict.noise),
not against a fixed dtype tolerance. This module checks that a capture can serve as one;
compare.diff measures it (`RecordDiff.control`).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from accucheck.compare.compat import check_same_model
from accucheck.errors import UserError


def check_control(ref: Any, ctl: Any, cand: Any, *, allow_model_mismatch: bool = False
                  ) -> list[str]:
    """UserError (exit 3) unless `ctl` can be a control of `ref`: the same model, the same
    prompts and the reference's generated tokens (teacher-forced); returns notes for what
    weakens it (a control at another dtype than the candidate's)."""
    check_same_model(ref, ctl, allow_model_mismatch=allow_model_mismatch)
    how = (f"capture it with `accucheck capture MODEL --control-for {ref.path} -o CTL.h5` "
           f"(the reference's prompts and tokens, the candidate's dtype)")
    rr, tr = ref.requests, ctl.requests
    if len(rr) != len(tr):
        raise UserError(f"control {ctl.path} has {len(tr)} prompts, {ref.path} has {len(rr)}: "
                        f"{how}")
    for i, (a, t) in enumerate(zip(rr, tr)):
        if not np.array_equal(np.asarray(a.prompt_ids), np.asarray(t.prompt_ids)):
            raise UserError(f"control {ctl.path} was captured on other prompts than {ref.path} "
                            f"(request {i}): {how}")
        ga, gt = np.asarray(a.generated_ids), np.asarray(t.generated_ids)
        n = min(ga.size, gt.size)
        j = next((k for k in range(n) if ga[k] != gt[k]), None)
        if j is not None:
            raise UserError(f"control {ctl.path} decodes other tokens than {ref.path} (request "
                            f"{i}, step {j}): a control must follow the reference's tokens; "
                            f"{how}")
    notes = []
    c_dtype, t_dtype = _dtype(cand.meta), _dtype(ctl.meta)
    if c_dtype and t_dtype and c_dtype != t_dtype:
        notes.append(f"control {ctl.path} computes in {t_dtype}, the candidate in {c_dtype}: "
                     f"its noise is not the candidate's precision's, so the ratios to it "
                     f"mislead; {how}")
    return notes


def _dtype(meta: dict) -> str | None:
    d = meta.get("dtype")
    return d.replace("torch.", "") if isinstance(d, str) and d else None
