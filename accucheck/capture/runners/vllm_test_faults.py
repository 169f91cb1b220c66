"""accucheck's own tests: faults planted inside a vLLM worker (ACCUCHECK_VLLM_TEST_FAULT, see
vllm_plugin.PluginConfig.test_fault), so that the tests can check that a capture, a diff and
the configuration matrix name them. Never active otherwise. Imports torch; no vLLM.
"""
from __future__ import annotations

import torch


def plant_test_fault(runner, by_name: dict, fault: dict) -> None:
    """accucheck's own tests: plant `fault` (this rank's) in the runner's model.
    {"scale": [module, f]} scales the module's output; {"scale_part": [module, a, b, f]} columns
    [a, b) of a fused output (k of q|k|v); ({"swap_kv": module}, a QKV weight's k and v rows
    swapped, is vllm_plugin.plant_faults': it needs the fused layout);
    {"batch_bf16": module}: the module's output is rounded through bfloat16 whenever the engine
    step holds more than one sequence (a kernel whose reduction depends on the batch: the
    batch-invariance bug the configuration matrix must name, tests/test_matrix_vllm.py);
    {"chunk_bf16": module}: the same whenever the step starts a prompt it does not schedule
    whole (a kernel that computes a chunked prefill otherwise)."""
    def on_output(target: str, change) -> None:
        by_name[target].register_forward_hook(
            lambda _m, _a, o: (change(o[0]), *o[1:]) if isinstance(o, tuple) else change(o))

    if fault.get("scale"):
        target, factor = fault["scale"]
        on_output(target, lambda x: x * factor)
    if fault.get("scale_part"):
        target, a, b, factor = fault["scale_part"]

        def part(x, a=int(a), b=int(b), f=float(factor)):
            x = x.clone()
            x[..., a:b] *= f
            return x
        on_output(target, part)
    if fault.get("batch_bf16"):
        seqs = [1]
        orig = runner.execute_model

        def execute_model(scheduler_output, *args, **kwargs):
            seqs[0] = len(getattr(scheduler_output, "num_scheduled_tokens", None) or {}) or 1
            return orig(scheduler_output, *args, **kwargs)
        runner.execute_model = execute_model
        on_output(fault["batch_bf16"],
                  lambda x: x.to(torch.bfloat16).to(x.dtype) if seqs[0] > 1 else x)
    if fault.get("chunk_bf16"):
        chunked = [False]
        orig_chunk = runner.execute_model

        def execute_chunked(scheduler_output, *args, **kwargs):
            counts = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
            chunked[0] = any(counts.get(r.req_id, 0) < len(r.prompt_token_ids or ())
                             for r in getattr(scheduler_output, "scheduled_new_reqs", ()))
            return orig_chunk(scheduler_output, *args, **kwargs)
        runner.execute_model = execute_chunked
        on_output(fault["chunk_bf16"],
                  lambda x: x.to(torch.bfloat16).to(x.dtype) if chunked[0] else x)
