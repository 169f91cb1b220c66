"""The knobs a configuration matrix flips, what each one means, and the runs they make.

A knob has a baseline value (what the baseline run uses) and the values the user lists after
`--knob NAME=V1,V2`; every listed value other than the baseline's is one run, flipped on its own
from the baseline (`--pairs`: also two knobs at a time). Everything here is checked before any
engine starts: an unknown knob, a knob of the other runner, a value that does not parse is a
usage error (exit 2) in one line. Imports nothing heavy (no torch, no vLLM).
"""
from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass, field
from typing import Callable

from accucheck.errors import UserError

RUNNERS = ("vllm", "hf")
DTYPES = ("float32", "bfloat16", "float16")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _bool(v: str) -> bool:
    low = v.strip().lower()
    if low in ("true", "1", "on", "yes"):
        return True
    if low in ("false", "0", "off", "no"):
        return False
    raise ValueError("use true or false")


def _positive(v: str) -> int:
    n = int(v)
    if n < 1:
        raise ValueError("use an integer >= 1")
    return n


def _choice(*allowed: str) -> Callable[[str], str]:
    def parse(v: str) -> str:
        if v not in allowed:
            raise ValueError(f"use {' or '.join(allowed)}")
        return v
    return parse


def _cache(v: str) -> object:
    return "warm" if v.strip().lower() == "warm" else _bool(v)


def _json(v: str) -> object:
    try:
        return json.loads(v)
    except json.JSONDecodeError:
        return v


@dataclass(frozen=True)
class KnobSpec:
    name: str
    runners: tuple[str, ...]
    baseline: object            # the baseline run's value (None: the engine's own default)
    parse: Callable[[str], object]
    meaning: str
    baseline_text: str | None = None   # how the baseline is said, when not its value


# name -> spec; `engine:NAME` and `env:NAME` are made on the fly (see `spec_of`)
KNOBS: dict[str, KnobSpec] = {s.name: s for s in (
    KnobSpec("batch_size", RUNNERS, 1, _positive,
             "the request alone (1), or submitted together with N-1 filler requests of other "
             "lengths (vLLM: one generate call, one engine; HF: one left-padded batch)"),
    KnobSpec("enable_prefix_caching", ("vllm",), False, _cache,
             "true: an engine with the prefix cache, the prompts run once (cold); warm: the "
             "same prompts a second time in that engine, served from the cache"),
    KnobSpec("enable_chunked_prefill", ("vllm",), None, _bool,
             "vLLM's chunked prefill on / off (the baseline leaves the engine's default)"),
    KnobSpec("max_num_batched_tokens", ("vllm",), None, _positive,
             "tokens per engine step; below a prompt's length its prefill is split in chunks",
             "every prompt's prefill in one step"),
    KnobSpec("enforce_eager", ("vllm",), True, _bool,
             "false: vLLM's graph mode (torch.compile, CUDA / ACL graphs where the device "
             "has them); the baseline is eager"),
    KnobSpec("async_scheduling", ("vllm",), False, _bool,
             "vLLM's asynchronous scheduling (the next step scheduled while one runs)"),
    KnobSpec("tensor_parallel_size", ("vllm",), 1, _positive,
             "tensor parallel ranks (on the CPU: one process each, cores split between them)"),
    KnobSpec("dtype", RUNNERS, None, _choice(*DTYPES), "the compute dtype", "--dtype"),
    KnobSpec("attn_implementation", ("hf",), "sdpa", _choice("eager", "sdpa"),
             "transformers' attention kernel: eager (matmul + softmax) or sdpa "
             "(torch scaled_dot_product_attention, transformers' default)"),
    KnobSpec("mode", ("hf",), "eager", _choice("eager", "graph"),
             "graph: the model's forward under torch.compile (inductor on the CPU)"),
)}
ENGINE_PREFIX, ENV_PREFIX = "engine:", "env:"
# engine arguments a knob of its own sets, or the matrix cannot give up
_RESERVED_ENGINE = {"logprobs_mode", "max_logprobs", "model", "tokenizer", "seed",
                    "worker_extension_cls", "logits_processors", *KNOBS}


def spec_of(name: str, runner: str) -> KnobSpec:
    """The spec of knob `name` for `runner`; a usage error for anything else."""
    if name.startswith(ENGINE_PREFIX):
        arg = name[len(ENGINE_PREFIX):]
        if runner != "vllm":
            raise UserError.usage(f"--knob {name}: engine:NAME knobs are vLLM engine arguments "
                                  f"(--runner vllm)")
        if not arg.isidentifier():
            raise UserError.usage(f"--knob {name}: {arg!r} is not an engine argument name")
        if arg in _RESERVED_ENGINE:
            why = "it is a knob of its own: --knob " + arg if arg in KNOBS else \
                "the matrix sets it itself (raw full-vocabulary logits, teacher forcing)"
            raise UserError.usage(f"--knob {name}: {why}")
        return KnobSpec(name, ("vllm",), None, _json, f"the vLLM engine argument {arg}")
    if name.startswith(ENV_PREFIX):
        var = name[len(ENV_PREFIX):]
        if not _ENV_NAME.match(var):
            raise UserError.usage(f"--knob {name}: {var!r} is not an environment variable name")
        return KnobSpec(name, RUNNERS, None, str,
                        f"the environment variable {var}, set while the run's engine starts "
                        f"and runs (the baseline: as this shell has it)")
    spec = KNOBS.get(name)
    if spec is None:
        known = ", ".join(n for n, s in KNOBS.items() if runner in s.runners)
        raise UserError.usage(f"--knob {name}: unknown knob for --runner {runner}; known: "
                              f"{known}, engine:NAME (vLLM), env:NAME")
    if runner not in spec.runners:
        raise UserError.usage(f"--knob {name} is for --runner {' / '.join(spec.runners)}, "
                              f"not {runner}")
    return spec


@dataclass(frozen=True)
class Knob:
    spec: KnobSpec
    values: tuple[object, ...]      # the listed values, baseline's left out

    @property
    def name(self) -> str:
        return self.spec.name


def parse_knob(text: str, runner: str, baseline_dtype: str) -> Knob:
    """`NAME=V1,V2` -> Knob, or a usage error (exit 2) in one line."""
    name, sep, raw = text.partition("=")
    name = name.strip()
    if not sep or not name or not raw.strip():
        raise UserError.usage(f"--knob {text!r}: use NAME=V1,V2 (e.g. batch_size=1,8)")
    spec = spec_of(name, runner)
    values = []
    for v in (x.strip() for x in raw.split(",")):
        if not v:
            raise UserError.usage(f"--knob {text!r}: an empty value")
        try:
            values.append(spec.parse(v))
        except ValueError as e:
            raise UserError.usage(f"--knob {name}={v}: {e}") from None
    base = baseline_dtype if name == "dtype" else spec.baseline
    kept = tuple(dict.fromkeys(v for v in values if v != base))
    return Knob(spec, kept)


@dataclass(frozen=True)
class RunSpec:
    """One run of the matrix: the baseline's settings with `flips` (knob name -> value)."""
    flips: tuple[tuple[str, object], ...] = ()
    label: str = field(default="baseline")

    def get(self, name: str, default=None):
        return dict(self.flips).get(name, default)


def label_of(flips: tuple[tuple[str, object], ...]) -> str:
    return " + ".join(f"{k}={_show(v)}" for k, v in flips) or "baseline"


def _show(v: object) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def plan_runs(knobs: list[Knob], pairs: bool) -> list[RunSpec]:
    """The baseline, one run per knob value, and with `pairs` one per two values of two knobs.
    A knob given twice is a usage error."""
    names = [k.name for k in knobs]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise UserError.usage(f"--knob {sorted(dup)[0]} given twice: list its values once "
                              f"(NAME=V1,V2)")
    runs = [RunSpec()]
    for k in knobs:
        runs += [RunSpec(((k.name, v),), label_of(((k.name, v),))) for v in k.values]
    if pairs:
        for a, b in itertools.combinations(knobs, 2):
            for va, vb in itertools.product(a.values, b.values):
                flips = ((a.name, va), (b.name, vb))
                runs.append(RunSpec(flips, label_of(flips)))
    return runs


def parse_knobs(texts: tuple[str, ...] | list[str], runner: str, baseline_dtype: str,
                pairs: bool = False) -> tuple[list[Knob], list[RunSpec]]:
    if runner not in RUNNERS:
        raise UserError.usage(f"--runner {runner}: use vllm or hf")
    knobs = [parse_knob(t, runner, baseline_dtype) for t in texts]
    return knobs, plan_runs(knobs, pairs)


def knob_table(runner: str | None = None) -> list[tuple[str, str, str, str]]:
    """(name, runners, baseline, meaning) of every built-in knob: `accucheck matrix
    --list-knobs` and docs/matrix.md."""
    rows = [(s.name, "/".join(s.runners), s.baseline_text or (
             "engine default" if s.baseline is None else _show(s.baseline)), s.meaning)
            for s in KNOBS.values() if runner is None or runner in s.runners]
    rows.append(("engine:NAME", "vllm", "engine default", "any vLLM engine argument (JSON "
                 "values), e.g. engine:block_size=16,32"))
    rows.append(("env:NAME", "vllm/hf", "as the shell has it", "any environment variable, "
                 "e.g. env:VLLM_BATCH_INVARIANT=1, env:HCCL_DETERMINISTIC=true"))
    return rows
