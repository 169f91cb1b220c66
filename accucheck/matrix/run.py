"""`accucheck matrix`: which knob moves the numbers, for which request, and where it starts.

`run_matrix` runs the baseline and every planned run (matrix.engines), measures each request
against the baseline (matrix.measure), localises every run that moved a request on the request
it moved most (matrix.localise), and judges `expect_invariant`: a knob named there fails the
matrix when one of its runs moved any request or could not be run (the contract unverified).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from accucheck.capture import device as dev
from accucheck.errors import EXIT_DIVERGENCE, EXIT_OK, UserError
from accucheck.matrix.engines import EngineStart, RunResult, hf_runs, vllm_runs
from accucheck.matrix.knobs import Knob, RunSpec, parse_knobs
from accucheck.matrix.localise import Localisation, localise
from accucheck.matrix.measure import RequestDelta, request_delta

Progress = Callable[[str], None]
PROCESSED_NOTE = ("processed logprobs are not compared: every run but the baseline is teacher-"
                  "forced by a logits processor, so its processed logprobs are the forcing's; "
                  "at temperature 0 without penalties they equal the raw ones")


@dataclass
class Row:
    """One run against the baseline."""
    label: str
    flips: dict
    requests: list[RequestDelta]
    error: str | None = None
    engine: int | None = None
    seconds: float = 0.0
    localisation: Localisation | None = None

    @property
    def moved(self) -> list[RequestDelta]:
        return [d for d in self.requests if d.moved]

    def summary(self) -> str:
        if self.error:
            return f"{self.label}: {self.error}"
        if not self.moved:
            return f"{self.label}: bitwise equal on every request"
        worst = max(self.moved, key=lambda d: d.max_dlogprob)
        reqs = ", ".join(str(d.request) for d in self.moved)
        line = (f"{self.label} moves request{'s' if len(self.moved) > 1 else ''} {reqs} "
                f"(request {worst.request} from step {worst.first_step}, max |dlogprob| "
                f"{worst.max_dlogprob:.3g})")
        return line + (f"; {self.localisation.line()}" if self.localisation else "")

    def to_json(self) -> dict:
        return {"label": self.label, "flips": self.flips, "error": self.error,
                "engine": self.engine, "seconds": self.seconds,
                "moved": [d.request for d in self.moved],
                "requests": [d.to_json() for d in self.requests],
                "localisation": self.localisation.to_json() if self.localisation else None}


@dataclass
class Matrix:
    runner: str
    model: str
    dtype: str
    device: str
    max_new_tokens: int
    prompts: list[list[int]]
    knobs: list[Knob]
    rows: list[Row]
    engines: list[EngineStart]
    expect_invariant: tuple[str, ...] = ()
    environment: dict = field(default_factory=dict)

    @property
    def violations(self) -> list[str]:
        """Why the invariance contract fails (one line each): a single-knob run of an expected
        invariant knob that moved a request or could not run."""
        out = []
        for row in self.rows:
            if len(row.flips) != 1 or next(iter(row.flips)) not in self.expect_invariant:
                continue
            if row.error:
                out.append(f"{row.label} could not be run, the invariance is unverified "
                           f"({row.error})")
            elif row.moved:
                out.append(row.summary())
        return out

    @property
    def exit_code(self) -> int:
        return EXIT_DIVERGENCE if self.violations else EXIT_OK

    def to_json(self) -> dict:
        return {
            "runner": self.runner, "model": self.model, "dtype": self.dtype,
            "device": self.device, "max_new_tokens": self.max_new_tokens,
            "prompts": [{"request": i, "tokens": len(p)} for i, p in enumerate(self.prompts)],
            "knobs": [{"name": k.name, "meaning": k.spec.meaning,
                       "baseline": k.spec.baseline if k.name != "dtype" else self.dtype,
                       "values": list(k.values)} for k in self.knobs],
            "rows": [r.to_json() for r in self.rows],
            "engines": [asdict(e) for e in self.engines],
            "expect_invariant": list(self.expect_invariant),
            "violations": self.violations, "exit_code": self.exit_code,
            "logits": "raw full-vocabulary logits; " + PROCESSED_NOTE,
            "environment": self.environment,
        }

    def write_json(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json(), indent=1, default=str) + "\n")


def check_invariant(names: Sequence[str], knobs: list[Knob]) -> tuple[str, ...]:
    given = {k.name for k in knobs}
    for n in names:
        if n not in given:
            raise UserError.usage(f"--expect-invariant {n}: not a --knob of this matrix "
                                  f"(give --knob {n}=V1,V2)")
    return tuple(names)


def plan(knob_texts: Sequence[str], runner: str, dtype: str, pairs: bool,
         expect_invariant: Sequence[str]) -> tuple[list[Knob], list[RunSpec], tuple[str, ...]]:
    """Everything the command line decides, checked before any engine starts (exit 2)."""
    knobs, runs = parse_knobs(list(knob_texts), runner, dtype, pairs)
    return knobs, runs, check_invariant(expect_invariant, knobs)


def run_matrix(runner: str, model_dir: Path, prompt_ids: list[list[int]], knobs: list[Knob],
               runs: list[RunSpec], out_dir: Path, *, dtype: str = "float32",
               device: str = "cpu", n_new: int = 2, seed: int = 0,
               engine_args: dict | None = None, expect_invariant: tuple[str, ...] = (),
               localise_moved: bool = True, pad_id: int = 0, plant: Callable | None = None,
               progress: Progress = lambda _m: None) -> Matrix:
    """Run the matrix (the inputs already checked: `plan`) and localise what moved."""
    if runner == "vllm":
        results, engines = vllm_runs(model_dir, prompt_ids, runs, dtype=dtype, n_new=n_new,
                                     seed=seed, device=device, engine_args=engine_args or {},
                                     progress=progress)
    else:
        results, engines = hf_runs(model_dir, prompt_ids, runs, dtype=dtype, n_new=n_new,
                                   seed=seed, device=device, pad_id=pad_id, plant=plant,
                                   progress=progress)
    base = results[0]
    rows = [_row(r, base) for r in results[1:]]
    for row, res in zip(rows, results[1:]):
        if localise_moved and row.moved and not row.error:
            worst = max(row.moved, key=lambda d: d.max_dlogprob)
            row.localisation = localise(runner, model_dir, prompt_ids, res.spec, worst.request,
                                        out_dir, dtype=dtype, n_new=n_new, seed=seed,
                                        device=device, engine_args=engine_args or {},
                                        pad_id=pad_id, plant=plant, progress=progress)
        progress("matrix: " + row.summary())
    return Matrix(runner, str(model_dir), dtype, device, n_new, prompt_ids, knobs, rows,
                  engines, expect_invariant, dev.fingerprint(dev.parse_device(device)))


def _row(res: RunResult, base: RunResult) -> Row:
    flips = {k: v for k, v in res.spec.flips}
    if res.error:
        return Row(res.spec.label, flips, [], res.error, res.engine)
    deltas = [request_delta(r, base.logits[r], res.logits[r],
                            base.tokens[r] + [int(base.logits[r][-1].argmax())],
                            res.cached.get(r) if "enable_prefix_caching" in flips else None)
              for r in sorted(base.logits)]
    return Row(res.spec.label, flips, deltas, None, res.engine, res.seconds)
