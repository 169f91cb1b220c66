"""`accucheck inspect`: describe one capture (meta, environment, records with statistics).

Imports accucheck.store and tabulate; never torch.
"""
from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass

from tabulate import tabulate

from accucheck.compare.observer import describe, observer_effect
from accucheck.coverage import coverage_line
from accucheck.store import CaptureReader, IndexRow, Selection
from accucheck.numbers import number


@dataclass(frozen=True)
class RecordFilter:
    pattern: str | None = None  # glob on the record key, e.g. "*layers.2*" or "r0.s0:*"
    step: int | None = None
    limit: int | None = None

    def select(self, rows: list[IndexRow]) -> list[IndexRow]:
        out = [r for r in rows
               if (self.step is None or r.key.step == self.step)
               and (self.pattern is None or fnmatch.fnmatchcase(str(r.key), self.pattern))]
        return out[: self.limit] if self.limit else out


def summary(reader: CaptureReader) -> dict:
    m = reader.meta
    env = m.get("environment", {})
    steps = sorted({r.key.step for r in reader.rows})
    return {
        "file": str(reader.path),
        "complete": reader.complete,
        "runner": m.get("runner"), "device": m.get("device"), "dtype": m.get("dtype"),
        "mode": m.get("mode"), "compile_backend": m.get("compile_backend"),
        "compile_stats": m.get("compile_stats"),
        "observer_effect": observer_effect(m),
        "coverage": m.get("coverage"), "tensor_parallel": m.get("tensor_parallel"),
        "store": reader.store_mode, "seed": (m.get("seed") or {}).get("seed"),
        "recorded": Selection.of(m).describe(),
        "model": {k: v for k, v in (m.get("model") or {}).items() if k != "config"},
        "model_path": m.get("model_path"),
        "records": len(reader.rows), "requests": len(reader.requests), "steps": len(steps),
        "environment": {"device_name": env.get("device_name"), "python": env.get("python"),
                        "cann": env.get("cann"), **env.get("packages", {}),
                        "env": env.get("env", {})},
        "time": m.get("time"), "tool_version": m.get("tool_version"),
    }


def render(reader: CaptureReader, flt: RecordFilter, fmt: str = "table") -> str:
    info = summary(reader)
    rows = flt.select(reader.rows)
    if fmt == "json":
        info["record_list"] = [{"key": str(r.key), "order": r.order, "kind": r.kind,
                                "dtype": r.dtype, "shape": list(r.shape),
                                "stats": r.stats.as_dict(), "checksum": r.checksum,
                                "has_data": r.has_data} for r in rows]
        return json.dumps(info, indent=1, default=str)
    head = [
        ("complete", "yes" if reader.complete else "NO: INCOMPLETE capture (interrupted, killed "
                                                   "or out of disk space); re-run it before "
                                                   "comparing"),
        ("runner / device", f"{info['runner']} / {info['device']} "
                            f"({info['environment'].get('device_name')})"),
        ("dtype / mode", f"{info['dtype']} / {info['mode']}" + _compiled(info)),
        *([("observer effect", describe(info["observer_effect"]))]
          if info["observer_effect"] is not None else []),
        ("store", info["store"]),
        *([("recorded", info["recorded"])] if info["recorded"] != "everything" else []),
        *([("coverage", coverage_line(info["coverage"]))] if info["coverage"] else []),
        *([("tensor parallel", _tp(info["tensor_parallel"]))]
          if info["tensor_parallel"] else []),
        ("model", f"{info['model'].get('class')} config {info['model'].get('config_hash')} "
                  f"weights {info['model'].get('weight_hash')}"),
        ("records", f"{info['records']} over {info['requests']} prompt(s), {info['steps']} step(s)"),
        ("versions", ", ".join(f"{k} {v}" for k, v in info["environment"].items()
                               if k not in ("env", "device_name") and v)),
        ("numerics env", ", ".join(f"{k}={v}" for k, v in info["environment"]["env"].items())
         or "(none set)"),
        ("captured", f"{info['time']} by accucheck {info['tool_version']}"),
    ]
    table = [[r.order, str(r.key), r.dtype, "x".join(map(str, r.shape)),
              number(r.stats.min), number(r.stats.max), number(r.stats.mean), number(r.stats.std),
              number(r.stats.l2), r.stats.nan + r.stats.inf]
             for r in rows]
    shown = f"{len(rows)} of {len(reader.rows)} records"
    return "\n".join([
        tabulate(head, tablefmt="plain"), "",
        tabulate(table, headers=["#", "key", "dtype", "shape", "min", "max", "mean", "std",
                                 "l2", "nan+inf"], tablefmt="simple"),
        shown,
    ])


def _tp(tp: dict) -> str:
    """Ranks recorded, replicated records verified, each rank disagreement (a finding)."""
    text = (f"size {tp.get('size')}, ranks recorded {tp.get('ranks_recorded')}, "
            f"{tp.get('replicated_verified', 0)} replicated records equal on every rank, "
            f"{len(tp.get('shards') or {})} sharded sites")
    for d in (tp.get("disagreements") or [])[:5]:
        size = "?" if d.get("rel_l2") is None else f"{d['rel_l2']:.3g}"
        text += (f"; RANKS DISAGREE: r{d['request']}.s{d['step']}:{d['module']}#{d['call']}:"
                 f"{d['role']}.{d['slot']} rank {d['ranks'][1]} vs rank {d['ranks'][0]} "
                 f"(rel_l2 {size})")
    more = len(tp.get("disagreements") or []) - 5
    return text + (f"; {more} more disagreements" if more > 0 else "")


def _compiled(info: dict) -> str:
    if not info["compile_backend"]:
        return ""
    cs = info.get("compile_stats") or {}
    stats = (f", {cs['unique_graphs']} graph(s), {cs['graph_breaks']} graph break(s)"
             if "graph_breaks" in cs else "")
    return f" (backend {info['compile_backend']}{stats})"
