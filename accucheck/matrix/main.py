"""The `accucheck matrix` command behind the CLI: check everything, run, write DIR.

Order: the knobs and `--expect-invariant` (usage errors, exit 2), the output directory (an
existing, non-empty one needs --force: exit 3), the model directory and prompts (exit 3), then
the engines start. DIR receives matrix.json, matrix.txt, matrix.html and localise/<run>/ with
the module captures of every localised run.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

from accucheck.errors import UserError
from accucheck.matrix.render import render_html, render_text
from accucheck.matrix.run import Matrix, plan, run_matrix

OUTPUTS = ("matrix.json", "matrix.txt", "matrix.html")


def check_out_dir(out_dir: Path, force: bool) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"-o {out_dir} is a file: give a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not force:
        raise UserError(f"-o {out_dir} exists and is not empty: pass --force to write into it "
                        f"(matrix.* and localise/ are replaced)")


def tokenized(model_dir: Path, prompts: Sequence[str], trust_remote_code: bool
              ) -> tuple[list[list[int]], int]:
    """(prompt ids, pad id) with the model directory's tokenizer."""
    from accucheck.capture.runners.hf import tokenize_prompts
    from accucheck.capture.models import check_model_dir, load_tokenizer

    check_model_dir(model_dir, trust_remote_code=trust_remote_code)
    tok = load_tokenizer(model_dir, trust_remote_code=trust_remote_code)
    ids = tokenize_prompts(list(prompts), tok)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    return ids, int(pad or 0)


def matrix_main(model_dir: Path, runner: str, prompts: Sequence[str], knob_texts: Sequence[str],
                out_dir: Path, *, pairs: bool = False, expect_invariant: Sequence[str] = (),
                dtype: str = "float32", device: str = "cpu", n_new: int = 2, seed: int = 0,
                engine_args: dict | None = None, localise: bool = True, force: bool = False,
                trust_remote_code: bool = False, fmt: str = "text",
                progress: Callable[[str], None] = lambda _m: None,
                echo: Callable[[str], None] = print, **testing) -> Matrix:
    knobs, runs, invariant = plan(knob_texts, runner, dtype, pairs, expect_invariant)
    if n_new < 1:
        raise UserError.usage("--max-new-tokens must be >= 1 (the forced decode steps)")
    if not knobs:
        raise UserError.usage("no --knob: give at least one, e.g. --knob batch_size=1,4")
    if runner == "vllm":
        from accucheck.matrix.engines import check_engine_knobs

        check_engine_knobs([k.name for k in knobs])
    check_out_dir(out_dir, force)
    ids, pad = tokenized(model_dir, prompts, trust_remote_code)
    if trust_remote_code:
        engine_args = {**(engine_args or {}), "trust_remote_code": True}
    progress(f"matrix: {runner}, {len(runs)} run(s) (baseline + {len(runs) - 1}), "
             f"{len(ids)} request(s), {n_new} forced decode step(s) -> {out_dir}")
    out_dir.mkdir(parents=True, exist_ok=True)
    m = run_matrix(runner, model_dir, ids, knobs, runs, out_dir, dtype=dtype, device=device,
                   n_new=n_new, seed=seed, engine_args=engine_args, expect_invariant=invariant,
                   localise_moved=localise, pad_id=pad, progress=progress, **testing)
    m.write_json(out_dir / "matrix.json")
    text = render_text(m)
    (out_dir / "matrix.txt").write_text(text)
    (out_dir / "matrix.html").write_text(render_html(m))
    echo((out_dir / "matrix.json").read_text() if fmt == "json" else text)
    return m
