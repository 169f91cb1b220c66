"""A scenario's `[matrix]` in the sign-off: the configuration matrix (accucheck.matrix) run on
the reference's settings into OUT/matrix/, and the check it makes: "matrix invariance" fails
when a knob of `expect_invariant` moved a request (or could not be run)."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from accucheck.matrix.main import matrix_main
from accucheck.report.signoff_result import Check


def scenario_matrix(scn, model_dir: Path, out: Path, log: Callable[[str], None]
                    ) -> tuple[dict, Check]:
    """(matrix.json document, its check) of the scenario's matrix."""
    spec = scn.matrix
    log(f"signoff: configuration matrix ({', '.join(spec.knobs)}) -> {out}")
    m = matrix_main(model_dir, spec.runner, list(scn.prompts), list(spec.knobs), out,
                    pairs=spec.pairs, expect_invariant=spec.expect_invariant, dtype=spec.dtype,
                    device=spec.device, n_new=spec.max_new_tokens, seed=scn.reference.seed,
                    engine_args=dict(spec.engine_args), localise=spec.localise, force=True,
                    trust_remote_code=scn.trust_remote_code, progress=log,
                    echo=lambda _s: None)
    doc = m.to_json()
    doc["summaries"] = [r.summary() for r in m.rows]
    doc["dir"] = str(out)
    bad = m.violations
    moved = sum(1 for r in m.rows if r.moved)
    if spec.expect_invariant:
        detail = "; ".join(bad) if bad else (
            f"{', '.join(spec.expect_invariant)} moved no request ({len(m.rows)} run(s), "
            f"{moved} moved the numbers)")
    else:
        detail = f"no invariance expected ({len(m.rows)} run(s), {moved} moved the numbers)"
    return doc, Check("matrix invariance", not bad, len(bad), 0, "<=", detail)
