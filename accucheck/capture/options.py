"""What shapes a capture, and every clash between its flags, checked in one place.

`CaptureOptions` is stored in the file's meta under `options`; its own checks run when it is
made. `check_runner(opts, runner, engine_kwargs)` adds the clashes of a runner (hf, vllm) with
the options and the engine arguments. Both raise UserError.usage (exit 2): what is wrong here
is wrong whatever the files hold, and nothing has been read or written yet. The CLI calls
`check_runner` before loading anything; each runner calls it again at its entry, for library
callers.

Imports torch only through capture.models.parse_dtype (for the dtype names).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from accucheck.capture import device as dev
from accucheck.capture.models import parse_dtype
from accucheck.errors import UserError
from accucheck.store import (parse_layers, parse_logits, parse_positions,  # noqa: F401
                             parse_requests)

MODES = ("eager", "graph")
# logits a stats capture keeps by default (--logits auto): each position's 32 largest
# log-probabilities, the span compare.metrics.logit_noise measures a near-tie flip's noise on
DEFAULT_TOPK = 32
LEVELS = ("module", "op")


@dataclass(frozen=True)
class CaptureOptions:
    """Everything that shapes a capture; stored in the file's meta under `options`.

    store: "stats" (index only, cheap) or "full" (tensors too).
    include / exclude: glob patterns on module paths (include replaces the default selection).
    In mode "graph" without include / exclude / record_inputs, the default is the kernel-
    boundary taps (accucheck.capture.record.graph: every Linear's input and output, which leave the
    compiled program unchanged).
    record_inputs: record every module input (role "in"), needed for shadow replay. Without
    it, eager captures still record the floating-point inputs that no producer link explains
    (accucheck.capture.record.recorder); graph captures record none.
    tokens_from: a reference capture whose prompt and generated token ids this run must follow.
    compile_backend: torch.compile backend for mode "graph" (default: inductor on every device,
    torch_npu's NPU inductor on NPU; "torchair": TorchAir's GE backend, only when asked;
    accucheck.capture.record.compiling.backend_for).
    level: "module" (forward hooks) or "op" (also every operator inside the selected modules,
    accucheck.capture.record.ops; eager mode only).
    shadow: a reference capture (--store full --inputs) whose recorded inputs every selected
    module (and op, at level op) is replayed on; results are role "shadow"
    (accucheck.capture.record.shadow). Implies tokens_from = shadow unless tokens_from is given.
    observer_check: mode "graph": also run the compiled model without taps and record its
    logits, with the taps' effect on them in meta "observer_effect"
    (accucheck.capture.record.graph); off, the file's logits are the tapped run's and the effect is
    not measured (one compile less).
    routing_from: a reference capture whose MoE routing (every router call's expert ids) this
    run must follow (accucheck.capture.record.moe); implies tokens_from. routing_weights: also the
    reference's routing weights. Eager only.
    dither: a seed: every rounding op's output moved one ULP on a quarter of its elements
    (accucheck.capture.faults.dithered): a device of this precision that is correct to one
    ULP, not only round-to-nearest. What a control run is made with by default
    (capture.runners.control); eager, hf runner only.
    positions / requests / layers: capture less, on purpose (store.Selection): "all",
    "last:N" (the last N positions of each prefill; every decode step) or "decode" (no record
    of the prefill); the request numbers recorded (all run; empty: every one); the decoder
    layers recorded ("0-3,28-29"; modules outside layers are kept). Each is in meta `options`
    so a diff says what was compared.
    logits: "full" (raw logits over the whole vocabulary), "topk:K" (per position the K
    largest log-probabilities and the following token's, with their ids: store.logits_topk;
    kept in every store mode) or "auto" (the default): full in the full store, topk:32
    (DEFAULT_TOPK) in the stats store, which keeps no tensor of full logits, so that a diff of
    two stats captures still sees token flips and their margins. Resolved when made.
    """
    device: str = "cpu"
    dtype: str | None = None
    mode: str = "eager"
    store: str = "stats"
    max_new_tokens: int = 0
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    record_inputs: bool = False
    seed: int = 0
    deterministic: bool = False
    tokens_from: str | None = None
    compression: str | None = None
    compile_backend: str | None = None
    force: bool = False
    level: str = "module"
    shadow: str | None = None
    observer_check: bool = True
    routing_from: str | None = None
    routing_weights: bool = False
    dither: int | None = None
    positions: str = "all"
    requests: tuple[int, ...] = ()
    layers: str | None = None
    logits: str = "auto"
    meta_extra: dict = field(default_factory=dict)

    def meta(self) -> dict:
        """The options as a capture's meta "options" holds them: without meta_extra and force,
        and without dither, positions, requests or layers where they have their default (the
        run was not dithered, records everything: store.Selection reads them so)."""
        unset = {"dither": None, "positions": "all", "requests": (), "layers": None,
                 "logits": "full"}
        return {k: v for k, v in asdict(self).items()
                if k not in ("meta_extra", "force") and not (k in unset and v == unset[k])}

    def __post_init__(self) -> None:
        """Usage errors (exit 2): what is wrong here is wrong whatever the files hold."""
        if self.mode not in MODES:
            raise UserError.usage(f"unknown mode {self.mode!r}: use eager or graph")
        if self.level not in LEVELS:
            raise UserError.usage(f"unknown level {self.level!r}: use module or op")
        if self.dither is not None and self.mode != "eager":
            raise UserError.usage("a dithered run (a control's rounding) is eager only")
        if self.mode == "graph" and (self.level == "op" or self.shadow):
            raise UserError.usage("--level op and --shadow need --mode eager (a compiled graph "
                                  "runs neither ops one by one nor module replays)")
        if self.routing_weights and not self.routing_from:
            raise UserError.usage("--routing-weights goes with --routing-from REF.h5")
        if self.routing_from and self.mode == "graph":
            raise UserError.usage("--routing-from needs --mode eager (the router's top-k runs "
                                  "inside the compiled graph, where it cannot be replaced)")
        if self.compile_backend and self.mode != "graph":
            raise UserError.usage("--compile-backend is for --mode graph")
        if self.max_new_tokens < 0:
            raise UserError.usage("--max-new-tokens must be >= 0")
        if self.store not in ("stats", "full"):
            raise UserError.usage(f"unknown store mode {self.store!r}: use stats or full")
        if self.compression not in (None, "gzip", "lzf"):
            raise UserError.usage(f"unknown compression {self.compression!r}: use gzip or lzf")
        if self.dtype is not None:
            parse_dtype(self.dtype)
        dev.parse_device(self.device)
        parse_positions(self.positions)
        if self.logits == "auto":
            object.__setattr__(self, "logits", "full" if self.store == "full"
                               else f"topk:{DEFAULT_TOPK}")
        parse_logits(self.logits)
        if self.layers is not None:
            parse_layers(self.layers)
        if any(type(r) is not int or r < 0 for r in self.requests):
            raise UserError.usage(f"--requests: request numbers are integers >= 0, not "
                                  f"{list(self.requests)}")
        if self.positions != "all" and self.shadow:
            raise UserError.usage(f"--positions {self.positions} records part of the prefill; "
                                  f"--shadow replays modules on whole inputs: drop one")

    def inputs(self) -> dict[str, str]:
        """The capture files this capture reads, by flag."""
        return {flag: path for flag, path in (("--tokens-from", self.tokens_from),
                                              ("--shadow", self.shadow),
                                              ("--routing-from", self.routing_from)) if path}


def check_requests(opts: CaptureOptions, n: int) -> None:
    """--requests naming a request the run does not have: UserError (exit 3: the prompts are
    input)."""
    beyond = [r for r in opts.requests if r >= n]
    if beyond:
        raise UserError(f"--requests {beyond[0]}: the run has {n} request(s), numbered 0 to "
                        f"{n - 1}")


def records(opts: CaptureOptions, req: int, step: int) -> bool:
    """Whether the selection records request `req` at step `step` (--requests, --positions
    decode)."""
    return (not opts.requests or req in opts.requests) and \
        not (step == 0 and opts.positions == "decode")


RUNNERS = ("hf", "vllm")
VLLM_DTYPES = ("float32", "float16", "bfloat16")
# engine options a vLLM capture needs: raw logits for every position, no reuse of another
# request's KV cache, no scheduling ahead of the collector
VLLM_FORCED_ENGINE = {"max_logprobs": -1, "logprobs_mode": "raw_logits",
                      "enable_prefix_caching": False, "async_scheduling": False}


def check_runner(opts: CaptureOptions, runner: str, engine_kwargs: dict | None = None) -> None:
    """Every clash of `runner` with the options and the engine arguments: UserError.usage."""
    if runner not in RUNNERS:
        raise UserError.usage(f"unknown runner {runner!r}: use {' or '.join(RUNNERS)}")
    engine_kwargs = engine_kwargs or {}
    if runner == "hf":
        if engine_kwargs:
            raise UserError.usage("--engine-arg is for --runner vllm")
        return
    if opts.dither is not None:
        raise UserError.usage("a dithered run (a control's rounding) is for --runner hf")
    if opts.routing_from:
        raise UserError.usage("--routing-from is for --runner hf (vLLM's fused MoE router is "
                              "not replayed by accucheck)")
    if opts.level != "module" or opts.shadow:
        raise UserError.usage("--level op and --shadow are not available with --runner vllm "
                              "(the engine's fused kernels run outside Python): use --runner hf "
                              "for them")
    if opts.compile_backend:
        raise UserError.usage("--compile-backend is for --runner hf; vLLM's graph mode is "
                              "chosen with --engine-arg compilation_config="
                              "'{\"cudagraph_mode\": \"PIECEWISE\"}'")
    vllm_dtype(opts.dtype)
    eager = opts.mode == "eager"
    if "enforce_eager" in engine_kwargs and bool(engine_kwargs["enforce_eager"]) != eager:
        raise UserError.usage(f"enforce_eager={engine_kwargs['enforce_eager']} contradicts "
                              f"--mode {opts.mode}: drop enforce_eager, --mode sets it")
    for key, want in dict(VLLM_FORCED_ENGINE, logprobs_mode=logprobs_mode(opts)).items():
        if key == "enable_prefix_caching" and engine_kwargs.get(key) is True:
            if parse_positions(opts.positions) in (0, 1):
                continue  # no prompt logits asked: vLLM reads the cache (vllm.prefix_cached)
            raise UserError.usage("enable_prefix_caching=True needs --positions last:1 or "
                                  "decode: vLLM skips the prefix cache for a request that asks "
                                  "for prompt logits (SamplingParams.skip_reading_prefix_"
                                  "cache), which recording more prompt positions needs")
        if key in engine_kwargs and engine_kwargs[key] != want:
            raise UserError.usage(f"engine option {key}={engine_kwargs[key]!r} cannot be used "
                                  f"for a capture (it needs {key}={want!r}): drop it")


def logprobs_mode(opts: CaptureOptions) -> str:
    """The vLLM engine's logprobs_mode for a capture: raw logits for full-vocabulary ones, raw
    log-probabilities for top-k ones (--logits topk:K)."""
    return "raw_logprobs" if parse_logits(opts.logits) else "raw_logits"


def vllm_dtype(name: str | None) -> str:
    """The vLLM dtype name of --dtype (default float32); float64 is refused (exit 2)."""
    dtype = str(parse_dtype(name or "float32")).replace("torch.", "")
    if dtype not in VLLM_DTYPES:
        raise UserError.usage(f"vLLM does not run {dtype}: use --dtype float32, bfloat16 or "
                              f"float16 (a float64 reference needs --runner hf)")
    return dtype
