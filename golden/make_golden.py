"""Regenerate the committed golden captures of the built-in tiny Llama (CPU, float32, eager).

    python golden/make_golden.py            # rewrites golden/tiny-stats.h5 and golden/tiny-full.h5

tests/test_golden.py captures the same thing again and compares it with these files: keys,
kinds, shapes, dtypes and tokens exactly; values within the float32 tolerance of the diff
library (rel_l2 5e-5 per record; CPU kernels may reorder float32 sums differently across
machines and thread counts, which stays below ~2e-6). A failure there means accucheck's schema
or numerics changed (or torch / transformers changed the tiny model): if the change is
intended, run this script and commit the new files with the change that explains them.

The prompts are chosen so that every greedy token wins by a clear logit margin (checked here):
float32 noise cannot flip a token on another machine.
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:  # runnable from a source checkout without installing
    sys.path.insert(0, str(HERE.parent))

REGENERATE = "python golden/make_golden.py"
MIN_MARGIN = 1e-2    # top-1 minus top-2 logit at every generating position (fp32 noise ~1e-5)
MAX_BYTES = 3 << 20  # all golden files together (the default selection reaches the leaves; a
#                      stats record keeps a 1 KiB sketch, schema minor 2)
GOLDEN = {
    # name: (prompts, store, max_new_tokens)
    "tiny-stats.h5": (("The quick brown fox jumps over the lazy dog",
                       "Accuracy of large language models"), "stats", 3),
    "tiny-full.h5": (("The quick brown fox",), "full", 1),
}
SEED = 0


def capture_options(store: str, max_new_tokens: int, *, force: bool = False, **kw):
    from accucheck.capture.options import CaptureOptions

    return CaptureOptions(device="cpu", dtype="float32", mode="eager", store=store,
                          compression="gzip", max_new_tokens=max_new_tokens, seed=SEED,
                          force=force, **kw)


def load_tiny():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from accucheck.capture.tiny import tiny_model_dir

    d = tiny_model_dir(SEED)
    model = AutoModelForCausalLM.from_pretrained(d, local_files_only=True).eval()
    return model, AutoTokenizer.from_pretrained(d, local_files_only=True)


def capture(model, tok, name: str, out: Path, *, force: bool = True) -> Path:
    """Capture golden `name` (its prompts / store / steps) into `out`."""
    from accucheck.capture.runners.hf import capture_model

    prompts, store, steps = GOLDEN[name]
    return capture_model(model, list(prompts), out, tokenizer=tok,
                         opts=capture_options(store, steps, force=force,
                                              meta_extra={"golden": name}))


def check_margins(model, tok, name: str) -> float:
    """Smallest top-1/top-2 logit margin at any generating position of golden `name`."""
    import numpy as np

    from accucheck.store import open_capture

    prompts, _, steps = GOLDEN[name]
    with tempfile.TemporaryDirectory() as tmp:
        p = Path(tmp) / "full.h5"
        from accucheck.capture.runners.hf import capture_model

        capture_model(model, list(prompts), p, tokenizer=tok,
                      opts=capture_options("full", steps))
        smallest = np.inf
        with open_capture(p) as r:
            for row in r.rows:
                if row.key.is_logits:
                    last = r.read(row.key).reshape(-1, row.shape[-1])[-1].astype(np.float64)
                    top = np.sort(last)[-2:]
                    smallest = min(smallest, float(top[1] - top[0]))
    return smallest


def main() -> int:
    model, tok = load_tiny()
    for name in GOLDEN:
        m = check_margins(model, tok, name)
        if m < MIN_MARGIN:
            print(f"{name}: a greedy token wins by only {m:.3g} in logit (< {MIN_MARGIN}): "
                  f"choose other prompts in GOLDEN", file=sys.stderr)
            return 1
        out = capture(model, tok, name, HERE / name)
        print(f"wrote {out} ({out.stat().st_size} bytes, smallest greedy margin {m:.3g})")
    total = sum((HERE / n).stat().st_size for n in GOLDEN)
    if total > MAX_BYTES:
        print(f"golden files take {total} bytes (> {MAX_BYTES}): use shorter prompts or fewer "
              f"steps", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
