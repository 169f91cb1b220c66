"""One vLLM engine of the matrix in a process of its own: `python -m accucheck.matrix.vllm_worker
JOB.json OUT_DIR` (started by matrix.engines; never by hand).

Why a process per engine: settings can change process-wide state that outlives an engine
(`VLLM_BATCH_INVARIANT=1` replaces torch operators for the whole process: measured, every
engine started after it in the same process failed), and an environment variable is only
honest when the process starts with it. Inside the process the engine core runs in-process
(matrix.engines.VLLM_ENV), so every request of a generate call is added before the first step.

A job is JSON: kind "runs" (the runs sharing one engine: their logits per request go to
OUT_DIR/logits.npz, the rest to OUT_DIR/result.json) or kind "capture" (a module capture for
the localisation, `capture_vllm`). What went wrong is in result.json ("error"; "user_error"
for bad input), never only in the exit code. No pickle: JSON and numpy's npz
(allow_pickle=False).
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from accucheck.errors import UserError, one_line
from accucheck.capture.runners.vllm_facts import not_in_effect
from accucheck.matrix.engines import RunResult, fillers, passes, split
from accucheck.matrix.knobs import RunSpec


def run_engine(job: dict) -> tuple[dict, dict[str, np.ndarray]]:
    """The runs of one engine: (result document, logits by "<run index>_<request>")."""
    from vllm import LLM, SamplingParams

    from accucheck.capture import device as dev
    from accucheck.capture.runners import vllm_plugin as plugin
    from accucheck.capture.runners.vllm import planted_test_fault, shutdown
    from accucheck.capture.runners.vllm_logits import dense_logits

    specs = [RunSpec(tuple((k, v) for k, v in flips), label) for label, flips in job["specs"]]
    prompt_ids, n_new, dtype = job["prompt_ids"], int(job["n_new"]), job["dtype"]
    baseline = {int(r): t for r, t in job["baseline_tokens"].items()}
    fault = planted_test_fault()
    if fault:  # accucheck's own tests: a planted fault, nothing recorded
        os.environ[plugin.ENV] = plugin.PluginConfig(test_fault=fault, record=False).to_env()
        plugin.install()
    dev.seed_everything(int(job["seed"]), dev.parse_device(job["device"]))
    doc: dict = {"start_s": None, "error": None, "runs": {}}
    t0 = time.monotonic()
    try:
        llm = LLM(**job["engine"])
    except Exception as e:  # the engine refuses these settings
        doc["error"] = f"cannot be set on this engine: {one_line(e, 200)}"
        return doc, {}
    doc["start_s"] = round(time.monotonic() - t0, 2)
    results = {s.label: RunResult(s) for s in specs}
    off = not_in_effect(llm.llm_engine.vllm_config, job.get("checked") or {})  # real vLLM only
    if off:  # the platform overrode a knob: running it would measure the baseline again
        doc["error"] = ("not in effect: this engine runs " + ", ".join(
            f"{k}={got!r} (asked {want!r})" for k, (want, got) in off.items())
            + " whatever is asked; nothing to compare")
        shutdown(llm)
        return doc, {}

    def params(r: int | None, forced: bool):
        follow = baseline.get(r) if forced and r is not None else None
        return SamplingParams(temperature=0.0, max_tokens=n_new + 1, ignore_eos=True,
                              logprobs=-1, detokenize=False, flat_logprobs=True,
                              extra_args={plugin.FORCED_ARG: follow})
    try:
        vocab = int(llm.llm_engine.model_config.get_vocab_size())
        for s, keep in passes(specs, dtype):
            _one_run(llm, s, results[s.label] if keep else RunResult(s), prompt_ids,
                     split(s, dtype)[2], params, baseline, n_new, vocab, dense_logits, keep)
            if keep:
                print(f"matrix: {s.label}: done", file=sys.stderr, flush=True)
    except Exception as e:  # the engine died running these settings
        doc["error"] = f"the engine failed running it: {one_line(e, 200)}"
    finally:
        shutdown(llm)
    doc["baseline_tokens"] = baseline
    arrays = {}
    for i, s in enumerate(specs):
        res = results[s.label]
        complete = len(res.logits) == len(prompt_ids)
        doc["runs"][s.label] = {"tokens": res.tokens, "cached": res.cached,
                                "seconds": res.seconds,
                                "error": None if complete else doc["error"]}
        if complete:
            arrays.update({f"{i}_{r}": lg for r, lg in res.logits.items()})
    return doc, arrays


def _one_run(llm, spec: RunSpec, res: RunResult, prompt_ids, batch: int, params,
             baseline: dict, n_new: int, vocab: int, dense, keep: bool) -> None:
    """Every request of interest once (alone, or with batch - 1 fillers in one generate call);
    kept in `res` when `keep` (a prefix-cache engine's cold pass of a warm run is not)."""
    t0 = time.monotonic()
    forced = spec.label != "baseline"
    for r, ids in enumerate(prompt_ids):
        reqs = [ids] + fillers(prompt_ids, r, batch - 1)
        outs = llm.generate([{"prompt_token_ids": x} for x in reqs],
                            [params(r, forced)] + [params(None, False)] * (batch - 1),
                            use_tqdm=False)
        o = outs[0]
        if list(o.prompt_token_ids) != list(ids):
            raise RuntimeError(f"vLLM output for request {r} belongs to another prompt")
        if not keep:
            continue
        tokens = [int(t) for t in o.outputs[0].token_ids]
        if not forced:
            baseline[r] = tokens
        elif tokens[:n_new] != baseline[r][:n_new]:
            raise RuntimeError(f"{spec.label}: request {r}: teacher forcing did not hold")
        res.logits[r] = dense(o.outputs[0].logprobs, vocab)
        res.tokens[r] = tokens[:n_new]
        res.cached[r] = int(getattr(o, "num_cached_tokens", 0) or 0)
    if keep:
        res.seconds = round(time.monotonic() - t0, 3)


def capture(job: dict) -> dict:
    from accucheck.capture.options import CaptureOptions
    from accucheck.capture.runners.vllm import capture_vllm

    opts = CaptureOptions(**{k: tuple(v) if k in ("include", "exclude", "requests") else v
                             for k, v in job["opts"].items()})
    capture_vllm(job["model_dir"], job["rows"], job["out"], opts, job["engine"])
    return {"error": None}


def main(argv: list[str]) -> int:
    job_path, out_dir = Path(argv[0]), Path(argv[1])
    job = json.loads(job_path.read_text())
    arrays: dict[str, np.ndarray] = {}
    try:
        if job["kind"] == "capture":
            doc = capture(job)
        else:
            doc, arrays = run_engine(job)
    except UserError as e:
        doc = {"error": str(e), "user_error": True}
    np.savez(out_dir / "logits.npz", **arrays)
    (out_dir / "result.json").write_text(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
