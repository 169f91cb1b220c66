#!/usr/bin/env bash
# The prepared device check (issue 34, docs/devices.md): on the built-in tiny model, HF eager and
# graph captures on the device, vLLM eager and graph captures when vLLM for that device imports,
# each diffed against a CPU capture; prints what ran, what was skipped and why, and the
# worker-side facts of each capture.
#   bash scripts/device-check.sh --device cuda|npu|cpu [--out DIR] [--dtype float32|bfloat16]
#                                [--no-vllm] [--no-graph] [--step-timeout S]
# Exit 0: every step that ran passed; 1: a diff found a divergence; 2: bad flags or --out;
# 3: a step crashed or timed out. The logic is scripts/device_check.py.
set -euo pipefail
exec "${PYTHON:-python3}" "$(dirname "$0")/device_check.py" "$@"
