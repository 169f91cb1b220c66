"""Sign-off scenarios: a typed config loaded from TOML. Imports errors and tolerances; no torch.

A scenario says what to run and how to judge it (see scenarios/*.toml for commented examples):

    name = "tiny-identical"                # default: the file name without .toml
    description = "..."
    model = "@tiny"                         # "@tiny" (built-in tiny Llama) or a model directory
    prompts = ["The quick brown fox"]       # and/or prompts_file = "prompts.txt" (text or JSONL)
    max_new_tokens = 4                      # greedy decode steps after the prefill (step 0)
    # run defaults, shared by every run below unless the run sets its own:
    runner = "hf"                           # "hf" | "vllm"
    device = "cpu"                          # cpu | cuda[:i] | npu[:i]
    dtype = "float32"                       # float32 | float16 | bfloat16 | float64
    mode = "eager"                          # eager | graph
    seed = 0
    store = "full"                          # full (exact metrics, logits) | stats
    deterministic = false
    include = []                            # module globs (default: the capture default set)
    exclude = []
    positions = "all"                       # what is recorded (capture --positions / --requests
    # requests = "0,2-3"; layers = "20-27"  # / --layers); a control takes the reference's,
                                            # the default golden these; not with [impact]
    previous = "reports/1.2/report.json"    # optional: the last release's report.json (or a
                                            # capture of the last release's candidate, .h5)

    [reference]                             # a run (keys as the defaults above), or
    capture = "gpu.h5"                      # an existing capture to use instead of running
    [candidate]                             # same keys, plus
    teacher_forcing = true                  # decode the reference's tokens (default true)
    routing_replay = false                  # MoE: the reference's expert ids in every router
                                            # call (capture --routing-from; hf eager)
    fault = { module = "model.layers.2.mlp", kind = "bf16" }   # TESTING / DEMO ONLY
    [golden]                                # the high-precision referee run (or capture);
    dtype = "float64"                       # by default (no [golden] table, reference run
                                            # here): float64 eager on the CPU, teacher-forced
    # enabled = false                       # no referee (a model too big for float64 on CPU)
    [control]                               # the control run (or capture = "..."): by
                                            # default hf eager on the CPU at the candidate's
                                            # dtype, teacher-forced: it decides "more than
                                            # noise?" (verdict.noise), not the tolerances. Made
                                            # by default for a bfloat16 / float16 candidate run
                                            # here (both runs, no capture = ...), unless the
                                            # reference is that very run (hf eager cpu)
    # enabled = false                       # no default control
    # plain = true                          # without the default one-ULP dither (capture
                                            # --plain-control): for a candidate that rounds to
                                            # nearest, as the CPU does
    dither = 1                              # round like another device of the precision
                                            # (faults.dithered(seed)): TESTING ONLY in the
                                            # candidate; a control is dithered by default
                                            # (its seed), as capture --control-for makes it

    [matrix]                                # optional: a configuration matrix (accucheck
                                            # matrix) on the reference's settings
    knobs = ["batch_size=1,4", "enable_prefix_caching=true,warm"]
    expect_invariant = ["batch_size"]       # a knob here that moves a request fails the
                                            # sign-off (check "matrix invariance")
    # runner / device / dtype / engine_args: the reference's; max_new_tokens: the scenario's;
    # pairs = false; localise = true

    [impact]                                # optional: when the sign-off fails, which module's
                                            # difference explains the output gap (accucheck
                                            # impact: an hf candidate, a full-store reference)
    include = []                            # modules patched (default: the layer blocks)
    bisect = 1                              # then the children of the block recovering most
    # noising = true                        # the reverse: the candidate's tensors into a run
                                            # as the reference (hf reference run, full-store
                                            # candidate): the share each site brings in
    # enabled = false

    [thresholds]                            # every key optional
    rel_l2 = 1e-3                           # per-record tolerance (default: dtype table)
    layer_rel_l2 = 1e-3                     # max rel L2 of decoder-layer outputs
    layer_cosine = 0.9999                   # min cosine of decoder-layer outputs
    logits_kl = 1e-4                        # max KL(ref || cand) at any logits position
    top1_agreement = 1.0                    # min fraction of logits positions with the same top-1
    token_agreement = 1.0                   # min fraction of generated tokens that agree
    near_tie_flips = 0                      # generated-token flips allowed when near-ties
    real_flips = 0                          # generated-token flips allowed that are not
    routing_agreement = 0.99                # MoE: min share of token routings (token x
                                            # router call) whose expert set agrees
    real_routing_flips = 0                  # MoE: routing flips allowed that are not near-ties
    amplification = 4.0                     # locate: "introduced" above this output/input ratio
    regression_margin = 0.25                # vs previous: relative change that counts
    fail_on_regression = true               # "worse than last release" fails the sign-off
    [thresholds.tolerances]                 # per-key overrides (like `accucheck diff --tol`)
    "*.mlp" = "rel_l2:1e-3"

Relative paths (model, prompts_file, capture, previous) are relative to the scenario file.
Unknown keys and wrong types are UserErrors (exit 3) that name the key and the file.

`fault` plants a fault (accucheck.capture.faults) in the candidate run: it exists so that the
shipped demo scenario and the tests can show a failing sign-off with a known culprit. Never use
it in a real sign-off; the report says loudly when a run had a planted fault.
"""
from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from accucheck.errors import UserError
from accucheck.compare.tolerances import ToleranceTable
from accucheck.store import parse_layers, parse_positions, parse_requests
from accucheck.matrix.knobs import parse_knobs

TINY = "@tiny"
TINY_MODELS = {TINY: "llama", "@tiny-moe": "qwen3_moe"}  # built-in models: name -> tiny arch
RUNNERS = ("hf", "vllm")
STORES = ("stats", "full")
MODES = ("eager", "graph")
ROLES = ("reference", "candidate", "golden", "control")
DTYPES = ("float32", "float16", "bfloat16", "float64")
REDUCED = ("float16", "bfloat16")  # a candidate in these gets a [control] run by default
# control runs a sign-off makes (dithered with the seed, seed + 1, ...): two controls measured
# 1 false alarm in 400 clean pairs and 91 % of x2 faults named, one control 4 and 83 %
# (docs/control.md, emulated devices, stats store)
CONTROL_RUNS = 2
_DTYPE_ALIASES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "fp64": "float64",
                  "half": "float16", "double": "float64", "float": "float32"}


@dataclass(frozen=True)
class Fault:
    """A planted fault (TESTING / DEMO ONLY): `kind` as in accucheck.capture.faults."""
    module: str
    kind: str

    def __str__(self) -> str:
        return f"{self.kind} @ {self.module}"


@dataclass(frozen=True)
class RunSpec:
    """One run of the pair (or the golden referee): how to capture it, or which file to use."""
    role: str
    capture: Path | None = None       # use this capture instead of running
    runner: str = "hf"
    device: str = "cpu"
    dtype: str = "float32"
    mode: str = "eager"
    seed: int = 0
    store: str = "full"
    deterministic: bool = False
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    record_inputs: bool = False
    compile_backend: str | None = None
    engine_args: dict = field(default_factory=dict)   # vLLM engine options
    teacher_forcing: bool = True      # candidate / golden / control: the reference's tokens
    routing_replay: bool = False      # MoE: the reference's routing (capture --routing-from)
    fault: Fault | None = None
    dither: int | None = None         # faults.dithered(seed): another device's rounding (a
                                      # control's default; TESTING ONLY in a candidate)
    positions: str = "all"            # what is recorded (capture --positions / --requests /
    requests: tuple[int, ...] = ()    # --layers): a control takes the reference's, the
    layers: str | None = None         # default golden the run defaults
    runs: int = 1                     # a control: how many, dithered with seed, seed + 1, ...

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(self.role)

    @property
    def label(self) -> str:
        """Short description for reports: "cpu float32 eager (hf)" or the capture file."""
        if self.capture is not None:
            return f"capture {self.capture.name}"
        s = f"{self.device} {self.dtype} {self.mode} ({self.runner})"
        if self.dither is not None:
            s += f" + dither seed {self.dither}" if self.runs == 1 else \
                " + dither seeds " + ", ".join(str(self.dither + i) for i in range(self.runs))
        return s + (f" + planted fault {self.fault}" if self.fault else "")


@dataclass(frozen=True)
class MatrixSpec:
    """A scenario's `[matrix]`: knobs flipped from the reference's settings (accucheck.matrix)."""
    knobs: tuple[str, ...]
    expect_invariant: tuple[str, ...] = ()
    pairs: bool = False
    localise: bool = True
    runner: str = "hf"
    device: str = "cpu"
    dtype: str = "float32"
    engine_args: dict = field(default_factory=dict)
    max_new_tokens: int = 2


@dataclass(frozen=True)
class ImpactSpec:
    """A scenario's `[impact]`: when the sign-off fails, the reference's tensors are patched
    into the candidate (accucheck impact, docs/impact.md) and the report says beside the
    culprit what share of the logit gap it recovers. include: module globs to patch (default
    the decoder layer blocks); bisect: then patch the children of this many blocks; noising:
    the reverse, the candidate's tensors patched into a run on the reference's device and
    dtype (the share of the candidate's gap each site brings in)."""
    include: tuple[str, ...] = ()
    bisect: int = 1
    noising: bool = False


@dataclass(frozen=True)
class Thresholds:
    """How a sign-off judges the diff. None = not checked (beyond the per-record tolerances)."""
    rel_l2: float | None = None
    tolerances: tuple[tuple[str, str], ...] = ()
    layer_rel_l2: float | None = None
    layer_cosine: float | None = None
    logits_kl: float | None = None
    top1_agreement: float | None = None
    token_agreement: float | None = None
    near_tie_flips: int = 0
    real_flips: int = 0
    routing_agreement: float | None = None
    real_routing_flips: int = 0
    amplification: float | None = None
    regression_margin: float = 0.25
    fail_on_regression: bool = True

    def tolerance_table(self) -> ToleranceTable:
        """The diff's per-record tolerances: dtype defaults (or `rel_l2`) plus overrides."""
        return ToleranceTable.from_options(
            rel_l2=self.rel_l2, overrides=[f"{p}={s}" for p, s in self.tolerances])


@dataclass(frozen=True)
class Scenario:
    path: Path | None
    name: str
    description: str
    model: str                        # "@tiny" or an absolute model directory
    prompts: tuple[str, ...]
    max_new_tokens: int
    reference: RunSpec
    candidate: RunSpec
    golden: RunSpec | None = None
    previous: Path | None = None
    thresholds: Thresholds = field(default_factory=Thresholds)
    trust_remote_code: bool = False
    control: RunSpec | None = None
    matrix: MatrixSpec | None = None
    impact: ImpactSpec | None = None

    def run(self, role: str) -> RunSpec | None:
        return {"reference": self.reference, "candidate": self.candidate,
                "golden": self.golden, "control": self.control}[role]


# ----------------------------------------------------------------------------- loading

_RUN_KEYS = {"runner", "device", "dtype", "mode", "seed", "store", "deterministic", "include",
             "exclude", "record_inputs", "compile_backend", "engine_args", "positions",
             "requests", "layers"}
_SELECTION = ("positions", "requests", "layers")  # what a run records (capture --positions ...)
_RUN_ONLY_KEYS = {"capture", "teacher_forcing", "fault", "dither", "routing_replay"}
_TOP_KEYS = {"name", "description", "model", "prompts", "prompts_file", "max_new_tokens",
             "previous", "trust_remote_code", "reference", "candidate", "golden", "control",
             "thresholds", "matrix", "impact"} | _RUN_KEYS
_THRESHOLD_KEYS = {f.name for f in fields(Thresholds)}


class _Reader:
    """Typed access to one TOML table; every read key is marked, the rest are unknown."""

    def __init__(self, src: str, table: dict, prefix: str = ""):
        self.src, self.table, self.prefix = src, table, prefix

    def fail(self, key: str, what: str) -> UserError:
        return UserError(f"{self.src}: {self.prefix}{key} {what}")

    def check_known(self, known: set[str]) -> None:
        for k in self.table:
            if k not in known:
                near = sorted(known)
                raise UserError(f"{self.src}: unknown key {self.prefix}{k!r} (known keys here: "
                                f"{', '.join(near)})")

    def get(self, key: str, types: type | tuple[type, ...], default: Any = None) -> Any:
        if key not in self.table:
            return default
        v = self.table[key]
        tt = types if isinstance(types, tuple) else (types,)
        if isinstance(v, bool) and bool not in tt:
            raise self.fail(key, f"must be {_tname(tt)}, not a boolean")
        if float in tt and isinstance(v, int) and not isinstance(v, bool):
            v = float(v)
        if not isinstance(v, tt):
            raise self.fail(key, f"must be {_tname(tt)}, got {type(v).__name__} {v!r}")
        return v

    def number(self, key: str, default: float | None = None, *, lo: float = 0.0,
               hi: float = math.inf) -> float | None:
        v = self.get(key, float, default)
        if v is not None and not (lo <= v <= hi and math.isfinite(v)):
            raise self.fail(key, f"must be a number in [{lo:g}, {hi:g}], got {v!r}")
        return v

    def count(self, key: str, default: int = 0) -> int:
        v = self.get(key, int, default)
        if v < 0:
            raise self.fail(key, f"must be >= 0, got {v}")
        return v

    def strings(self, key: str) -> tuple[str, ...]:
        v = self.get(key, list, [])
        if not all(isinstance(x, str) for x in v):
            raise self.fail(key, "must be a list of strings")
        return tuple(v)

    def choice(self, key: str, choices: tuple[str, ...], default: str) -> str:
        v = self.get(key, str, default)
        if v not in choices:
            raise self.fail(key, f"must be one of {', '.join(choices)}, got {v!r}")
        return v


def _tname(tt: tuple[type, ...]) -> str:
    names = {str: "a string", int: "an integer", float: "a number", bool: "true or false",
             list: "a list", dict: "a table"}
    return " or ".join(names.get(t, t.__name__) for t in tt)


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a scenario file. Raises UserError (exit 3) naming the file and key."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"scenario {p} does not exist (see scenarios/*.toml for examples)")
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise UserError(f"scenario {p} is not UTF-8 text") from None
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"scenario {p} is not valid TOML: {e}") from None
    return scenario_from_dict(data, base=p.parent.resolve(), src=str(p), path=p.resolve())


def scenario_from_dict(data: dict, *, base: Path | None = None, src: str = "<scenario>",
                       path: Path | None = None) -> Scenario:
    """Build a Scenario from parsed TOML (paths relative to `base`, default the cwd)."""
    base = base or Path.cwd()
    top = _Reader(src, data)
    top.check_known(_TOP_KEYS)
    model = top.get("model", str, TINY)
    model = model if model in TINY_MODELS else str(_rel(base, model))
    prompts = list(top.strings("prompts"))
    pf = top.get("prompts_file", str)
    if pf is not None:
        prompts += _read_prompts_file(_rel(base, pf), src)
    mnt = top.count("max_new_tokens", 4)
    runs = _runs(top, data, base, src)
    for role, spec in runs.items():
        if spec is not None and prompts and spec.requests and max(spec.requests) >= len(prompts):
            raise UserError(f"{src}: {role}.requests names request {max(spec.requests)}: the "
                            f"scenario has {len(prompts)} prompt(s), numbered 0 to "
                            f"{len(prompts) - 1}")
    thr = _thresholds(top.get("thresholds", dict, {}), src)
    prev = top.get("previous", str)
    previous = _rel(base, prev)
    if previous is not None and not previous.is_file():
        raise top.fail("previous", f"{previous} does not exist (a report.json of the last "
                                   f"release's sign-off, or a capture of its candidate)")
    name = top.get("name", str) or (path.stem if path is not None else "scenario")
    matrix = _matrix(_Reader(src, top.get("matrix", dict), "matrix."), runs["reference"],
                     mnt) if "matrix" in data else None
    impact = _impact(_Reader(src, top.get("impact", dict), "impact."), runs) \
        if "impact" in data else None
    return Scenario(path, name, top.get("description", str, ""), model, tuple(prompts), mnt,
                    runs["reference"], runs["candidate"], runs["golden"], previous, thr,
                    top.get("trust_remote_code", bool, False), runs["control"], matrix, impact)


def _rel(base: Path, v: str | None) -> Path | None:
    """A scenario path: `~` expanded, relative to `base`, resolved (None stays None)."""
    return None if v is None else (base / Path(v).expanduser()).resolve()


def _runs(top: _Reader, data: dict, base: Path, src: str) -> dict[str, RunSpec | None]:
    """Every role's RunSpec by role (None: no such run): the tables given, the run defaults
    for a missing reference / candidate, and the default golden referee and control."""
    defaults = _run_fields(top, {})
    runs: dict[str, RunSpec | None] = {}
    for role in ROLES:
        if role not in data:
            if role in ("golden", "control"):
                runs[role] = None  # the default referee and control are added below
                continue
            runs[role] = _make_run(role, defaults, {}, src)
            continue
        runs[role] = _role_run(role, top, data, defaults, runs, base, src)
    for role in ("reference", "golden", "control"):
        if runs[role] is not None and runs[role].fault is not None:
            raise UserError(f"{src}: {role}.fault: plant faults in the candidate, the {role} "
                            f"is what is trusted")
    if "golden" not in data and runs["reference"].capture is None:
        runs["golden"] = default_golden(defaults)
    ref, cand = runs["reference"], runs["candidate"]
    if "control" not in data and ref.capture is None and cand.capture is None \
            and cand.dtype in REDUCED and (ref.runner, ref.device, ref.mode, ref.dtype) != \
            ("hf", "cpu", "eager", cand.dtype):
        # a reduced-precision candidate is judged against its dtype's noise by default (not
        # when the reference is hf eager on the CPU at that dtype: a plain control was that
        # very run; the dithered one would measure noise, but that default is not calibrated
        # here: a [control] table asks for it)
        runs["control"] = _make_run("control", {
            **control_defaults(defaults, data, runs), "teacher_forcing": True,
            "routing_replay": runs["candidate"].routing_replay, "runs": CONTROL_RUNS}, {}, src)
    return runs


def _role_run(role: str, top: _Reader, data: dict, defaults: dict,
              runs: dict[str, RunSpec | None], base: Path, src: str) -> RunSpec | None:
    """The run of the table `[role]` (None: a golden or control with `enabled = false`);
    `runs` holds the roles read before it (a control's defaults follow them)."""
    t = top.get(role, dict)
    r = _Reader(src, t, f"{role}.")
    r.check_known(_RUN_KEYS | _RUN_ONLY_KEYS | ({"enabled"} if role in ("golden", "control")
                                               else set()) | ({"plain", "runs"}
                                                              if role == "control" else set()))
    if role in ("golden", "control") and not r.get("enabled", bool, True):
        if set(t) != {"enabled"}:
            raise r.fail("enabled", "= false turns the referee off: give no other key")
        return None
    extra = _run_fields(r, control_defaults(defaults, data, runs) if role == "control"
                        else defaults)
    cap = r.get("capture", str)
    if cap is not None:
        extra["capture"] = _rel(base, cap)
        if not extra["capture"].is_file():
            raise r.fail("capture", f"{extra['capture']} does not exist")
    if role == "reference" and "teacher_forcing" in t:
        raise r.fail("teacher_forcing", "is for the candidate and golden runs (they follow "
                                        "the reference's tokens)")
    extra["teacher_forcing"] = r.get("teacher_forcing", bool, True)
    if "routing_replay" in t:
        if role == "reference":
            raise r.fail("routing_replay", "is for the candidate, golden and control runs "
                                           "(they follow the reference's routing)")
        extra["routing_replay"] = r.get("routing_replay", bool, False)
    f = r.get("fault", dict)
    if f is not None:
        fr = _Reader(src, f, f"{role}.fault.")
        fr.check_known({"module", "kind"})
        mod, kind = fr.get("module", str), fr.get("kind", str)
        if not mod or not kind:
            raise r.fail("fault", "needs module = \"...\" and kind = \"bf16\" (or fp16, "
                                  "noise:REL, scale:F, act:silu_fast, act:gelu_tanh)")
        extra["fault"] = Fault(mod, kind)
    if "dither" in t:
        extra["dither"] = r.count("dither")
    if role == "control" and r.get("plain", bool, False):
        if "dither" in t:
            raise r.fail("plain", "= true is the control without a dither: give no dither")
        extra["dither"] = None  # the CPU's own rounding (capture --plain-control)
    if role == "control":
        extra["runs"] = _control_runs(r, t, extra)
    return _make_run(role, defaults, extra, src)


def _control_runs(r: "_Reader", t: dict, extra: dict) -> int:
    """`[control] runs`: CONTROL_RUNS by default; one for a given capture, a plain control or
    a vLLM one (undithered: a second run is the same run)."""
    one = extra.get("capture") is not None or extra.get("dither") is None \
        or extra.get("runner", "hf") != "hf"
    if "runs" not in t:
        return 1 if one else CONTROL_RUNS
    n = r.count("runs")
    if not 1 <= n <= 3:
        raise r.fail("runs", f"must be 1, 2 or 3, got {n}")
    if n > 1 and one:
        raise r.fail("runs", "> 1 needs dithered control runs made here (a given capture, or "
                             "plain = true, is one run)")
    return n


def _matrix(r: _Reader, ref: RunSpec, max_new_tokens: int) -> MatrixSpec:
    """`[matrix]`: checked here (knob names and values, expect_invariant among them), so a
    bad one stops the sign-off before any run."""
    r.check_known({"knobs", "expect_invariant", "pairs", "localise", "runner", "device",
                   "dtype", "engine_args", "max_new_tokens"})
    runner = r.choice("runner", RUNNERS, ref.runner)
    dtype = r.get("dtype", str, ref.dtype)
    knobs, invariant = r.strings("knobs"), r.strings("expect_invariant")
    if not knobs:
        raise r.fail("knobs", 'needs at least one knob, e.g. knobs = ["batch_size=1,4"]')
    try:
        parsed, _ = parse_knobs(knobs, runner, dtype, r.get("pairs", bool, False))
    except UserError as e:
        raise r.fail("knobs", str(e)) from None
    names = {k.name for k in parsed}
    for n in invariant:
        if n not in names:
            raise r.fail("expect_invariant", f"{n} is not one of the knobs")
    return MatrixSpec(knobs, invariant, r.get("pairs", bool, False), r.get("localise", bool, True),
                      runner, r.get("device", str, ref.device), dtype,
                      dict(r.get("engine_args", dict, ref.engine_args)),
                      max(1, r.count("max_new_tokens", max_new_tokens)))


def _impact(r: _Reader, runs: dict) -> ImpactSpec | None:
    """`[impact]` (None with `enabled = false`): the candidate reruns with transformers and the
    reference's tensors are swapped in, so the candidate must be an hf run and a reference run
    here must store its tensors."""
    r.check_known({"enabled", "include", "bisect", "noising"})
    if not r.get("enabled", bool, True):
        return None
    ref, cand = runs["reference"], runs["candidate"]
    noising = r.get("noising", bool, False)
    if noising and (ref.capture is not None or ref.runner != "hf"):
        raise r.fail("noising", "reruns the model as the reference device with transformers: "
                                "it needs a reference run with runner = \"hf\" here")
    if noising and cand.capture is None and (cand.store != "full" or not cand.teacher_forcing):
        raise r.fail("noising", 'patches the candidate\'s tensors in: the candidate needs '
                                'store = "full" and teacher_forcing = true')
    if cand.runner != "hf":
        raise r.fail("enabled", f'reruns the candidate with transformers: it needs a candidate '
                                f'with runner = "hf", not {cand.runner!r} (or enabled = false)')
    if ref.capture is None and ref.store != "full":
        raise r.fail("enabled", 'swaps the reference\'s tensors in: the reference needs '
                                'store = "full"')
    if ref.capture is None and (ref.positions, ref.requests, ref.layers) != ("all", (), None):
        raise r.fail("enabled", "replays every position of every request: the reference "
                                "cannot set positions / requests / layers")
    return ImpactSpec(r.strings("include"), r.count("bisect", 1), noising)


def control_defaults(defaults: dict, data: dict, runs: dict) -> dict:
    """What a `[control]` run is unless it says otherwise: the reference's code (hf, eager, on
    the CPU: a trusted device) at the candidate's dtype, storing what the reference stores,
    with the reference's module selection (compare.control)."""
    ref, cand = runs["reference"], runs["candidate"]
    return {**defaults, "runner": "hf", "device": "cpu", "mode": "eager", "dtype": cand.dtype,
            "store": ref.store, "include": ref.include, "exclude": ref.exclude,
            "record_inputs": ref.record_inputs, "engine_args": {}, "compile_backend": None,
            **{k: getattr(ref, k) for k in _SELECTION},
            # correct to one ULP, as `capture --control-for` makes it (capture.runners.control)
            "dither": defaults.get("seed", 0)}


def default_golden(defaults: dict) -> RunSpec:
    """The referee a scenario gets unless it says `[golden] enabled = false`: the same model in
    float64, eager, on the CPU (hf runner), every tensor stored, teacher-forced onto the
    reference's tokens. Turn it off for a model too large for a float64 CPU run: the noise
    floor then judges what the tolerances pass."""
    keep = {k: v for k, v in defaults.items()
            if k in ("seed", "include", "exclude", *_SELECTION)}
    return RunSpec("golden", runner="hf", device="cpu", dtype="float64", mode="eager",
                   store="full", teacher_forcing=True, **keep)


def _run_fields(r: _Reader, defaults: dict) -> dict:
    out = dict(defaults)
    if "runner" in r.table:
        out["runner"] = r.choice("runner", RUNNERS, "hf")
    if "device" in r.table:
        out["device"] = r.get("device", str)
    if "dtype" in r.table:
        d = r.get("dtype", str)
        d = _DTYPE_ALIASES.get(d, d)
        if d not in DTYPES:
            raise r.fail("dtype", f"must be one of {', '.join(DTYPES)}, got {d!r}")
        out["dtype"] = d
    if "mode" in r.table:
        out["mode"] = r.choice("mode", MODES, "eager")
    if "seed" in r.table:
        out["seed"] = r.count("seed")
    if "store" in r.table:
        out["store"] = r.choice("store", STORES, "full")
    for b in ("deterministic", "record_inputs"):
        if b in r.table:
            out[b] = r.get(b, bool)
    for s in ("include", "exclude"):
        if s in r.table:
            out[s] = r.strings(s)
    if "compile_backend" in r.table:
        out["compile_backend"] = r.get("compile_backend", str)
    if "engine_args" in r.table:
        out["engine_args"] = dict(r.get("engine_args", dict))
    out.update(_selection(r))
    return out


def _selection(r: _Reader) -> dict:
    """positions / requests / layers, as `accucheck capture` reads them ("last:16", "0,2-3",
    "20-27")."""
    out = {}
    for key, parse in (("positions", parse_positions), ("requests", parse_requests),
                       ("layers", parse_layers)):
        if key in r.table:
            text = r.get(key, str)
            try:
                value = parse(text)
            except UserError as e:
                raise r.fail(key, f"= {text!r}: {str(e).split(': ', 1)[-1]}") from None
            out[key] = value if key == "requests" else text
    return out


def _make_run(role: str, defaults: dict, extra: dict, src: str) -> RunSpec:
    spec = RunSpec(role=role, **{**defaults, **extra})
    if spec.runner == "vllm" and spec.fault is not None:
        raise UserError(f"{src}: {role}.fault: planted faults need runner = \"hf\"")
    if spec.engine_args and spec.runner != "vllm":
        raise UserError(f"{src}: {role}.engine_args: only for runner = \"vllm\"")
    if spec.routing_replay and (spec.runner != "hf" or spec.mode != "eager"
                                or not spec.teacher_forcing):
        raise UserError(f"{src}: {role}.routing_replay: needs runner = \"hf\", mode = "
                        f"\"eager\" and teacher_forcing")
    try:
        from accucheck.capture.device import parse_device  # no torch import

        parse_device(spec.device)
    except UserError as e:
        raise UserError(f"{src}: {role}.device: {e}") from None
    return spec


def _thresholds(t: dict, src: str) -> Thresholds:
    r = _Reader(src, t, "thresholds.")
    r.check_known(_THRESHOLD_KEYS)
    tols = r.get("tolerances", dict, {})
    pairs = []
    for pat, spec in tols.items():
        if isinstance(spec, (int, float)) and not isinstance(spec, bool):
            spec = repr(float(spec))
        if not isinstance(spec, str):
            raise UserError(f"{src}: thresholds.tolerances.{pat!r} must be a number or a string "
                            f"like \"rel_l2:1e-3\" or \"rtol:1e-2,atol:1e-3\"")
        pairs.append((pat, spec))
    thr = Thresholds(
        rel_l2=r.number("rel_l2"), tolerances=tuple(pairs),
        layer_rel_l2=r.number("layer_rel_l2"), layer_cosine=r.number("layer_cosine", lo=-1, hi=1),
        logits_kl=r.number("logits_kl"), top1_agreement=r.number("top1_agreement", hi=1),
        token_agreement=r.number("token_agreement", hi=1),
        near_tie_flips=r.count("near_tie_flips"), real_flips=r.count("real_flips"),
        routing_agreement=r.number("routing_agreement", hi=1),
        real_routing_flips=r.count("real_routing_flips"),
        amplification=r.number("amplification", lo=1),
        regression_margin=r.number("regression_margin", 0.25),
        fail_on_regression=r.get("fail_on_regression", bool, True))
    try:
        thr.tolerance_table()
    except UserError as e:
        raise UserError(f"{src}: thresholds.tolerances: {e}") from None
    return thr


def _read_prompts_file(p: Path, src: str) -> list[str]:
    from accucheck.prompts import read_prompts  # the one prompts-file reader (text or JSONL)

    try:
        return read_prompts((), str(p))
    except UserError as e:
        raise UserError(f"{src}: prompts_file: {e}") from None


def with_captures(s: Scenario, **captures: str | Path | None) -> Scenario:
    """The scenario with some runs replaced by existing captures (reference=..., candidate=...,
    golden=...): what `accucheck signoff --ref/--cand/--golden` do."""
    out = s
    for role, path in captures.items():
        if path is None:
            continue
        p = Path(path).resolve()
        if not p.is_file():
            raise UserError(f"--{_FLAG[role]} {path} does not exist")
        run = s.run(role) or RunSpec(role=role)
        out = replace(out, **{role: replace(run, capture=p, fault=None, runs=1)})
    return out


_FLAG = {"reference": "ref", "candidate": "cand", "golden": "golden", "control": "control"}
