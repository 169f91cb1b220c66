"""`accucheck demo`: the whole story on the built-in tiny model, offline.

A reference run (think: GPU, fp32, eager), a candidate run of the same weights with a planted
fault in one module (think: an NPU kernel computing one RMSNorm in bfloat16) decoding the
reference's tokens, and the diff that finds it. Imports the capture API (torch) lazily.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from accucheck.errors import UserError

DEMO_PROMPTS = ("The quick brown fox jumps over the lazy dog", "Accuracy of large language models")
DEMO_FAULT = ("model.layers.2.post_attention_layernorm", "bf16")
DEMO_STEPS = 4


def run_demo(out_dir: Path, *, force: bool, echo: Callable[[str], None],
             log: Callable[[str], None]) -> int:
    """Write ref.h5 / cand.h5 and the diff as a page (diff.html) into out_dir and echo the
    comparison. Returns 0 when the diff names the planted module as where divergence starts,
    1 otherwise."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from accucheck.capture.runners.hf import capture_model
    from accucheck.capture.faults import planted
    from accucheck.capture.tiny import tiny_model_dir

    out_dir.mkdir(parents=True, exist_ok=True)
    ref, cand, page = out_dir / "ref.h5", out_dir / "cand.h5", out_dir / "diff.html"
    for p in (ref, cand, page):
        if p.exists() and not force:
            raise UserError(f"{p} exists from an earlier demo: pass --force or another --out-dir")
    log("building the tiny model (offline, deterministic) ...")
    mdir = tiny_model_dir()
    model = AutoModelForCausalLM.from_pretrained(mdir, local_files_only=True).eval()
    tok = AutoTokenizer.from_pretrained(mdir, local_files_only=True)
    log(f"reference capture -> {ref}")
    capture_model(model, list(DEMO_PROMPTS), ref, tokenizer=tok, store="full",
                  max_new_tokens=DEMO_STEPS, force=force, meta_extra={"model_path": str(mdir)})
    module, fault = DEMO_FAULT
    log(f"candidate capture with a planted fault ({fault} in {module}), teacher-forced -> {cand}")
    with planted(model, module, fault):
        capture_model(model, list(DEMO_PROMPTS), cand, tokenizer=tok, store="full",
                      max_new_tokens=DEMO_STEPS, tokens_from=str(ref), force=force,
                      meta_extra={"model_path": str(mdir), "planted_fault": f"{fault} @ {module}"})
    from accucheck.verdict.locate import analyze
    from accucheck.paths import write_atomic
    from accucheck.report.diff import render
    from accucheck.report.html_diff import to_html

    log(f"accucheck diff {ref} {cand}")
    analysis = analyze(ref, cand)
    echo(render(analysis, "table"))
    write_atomic(page, to_html(analysis))
    log(f"the same diff as a page (heatmap, curves, logits): {page}  (accucheck diff {ref} "
        f"{cand} --format html -o {page})")
    fd = analysis.location.first_divergence
    found = fd is not None and fd.key.module == module
    log(("PASS demo: " if found else "FAIL demo: ") + f"planted {fault} in {module}; the diff "
        + (f"names {fd.key.module} ({fd.cause})" if fd else "found no divergence"))
    return 0 if found else 1
