"""Graph mode's compilation: the torch.compile backend, progress lines while it compiles,
dynamo's counters of graphs and breaks, and quiet side-effect replay.

Imports torch (dynamo lazily) and accucheck.capture.device. Used by accucheck.capture.runners.hf.
"""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator

from accucheck.capture import device as dev
from accucheck.errors import UserError, one_line


class CompileProgress:
    """Graph mode: while torch.compile and its backend compile (minutes on a real model, at the
    first forward and at a recompilation), a background thread says so every `every`
    seconds to the progress callback: "capture: compiling (inductor), 12 s". `seconds` adds up
    the time spent compiling (the capture's meta "compile_seconds").

    Compilations are seen through dynamo's compile callbacks (torch._dynamo.callback, where
    this torch has them); without them, the first call of the watched forward counts as the
    compilation. Use as a context manager around the capture (starts / stops the thread and
    the callbacks) and `watch` the compiled forward. `clock` is injectable; `tick()` is one
    poll of the thread (tests call it directly)."""

    every = 5.0

    def __init__(self, out: Callable[[str], None] | None, label: str | None,
                 clock: Callable[[], float] = time.monotonic):
        self.out, self.label, self.clock = out, label or "torch.compile", clock
        self.seconds = 0.0
        self._started: float | None = None
        self._depth = 0
        self._lock = threading.Lock()
        self._begun = threading.Event()
        self._halt = threading.Event()
        self._thread: threading.Thread | None = None
        self._callbacks = False
        self._calls = 0

    # compilation boundaries (dynamo's callbacks, or the first forward)
    def start(self, _args=None) -> None:
        with self._lock:
            self._depth += 1
            if self._depth == 1:
                self._started = self.clock()
                self._begun.set()

    def end(self, _args=None) -> None:
        with self._lock:
            if self._depth == 0:
                return
            self._depth -= 1
            if self._depth == 0 and self._started is not None:
                self.seconds += self.clock() - self._started
                self._started = None

    def tick(self) -> bool:
        """One progress line if a compilation is running; False when none is."""
        with self._lock:
            started = self._started
            if started is None:
                self._begun.clear()
                return False
        if self.out is not None:
            self.out(f"capture: compiling ({self.label}), {self.clock() - started:.0f} s")
        return True

    def _run(self) -> None:
        while not self._halt.is_set():
            self._begun.wait()
            while not self._halt.wait(self.every):
                if not self.tick():
                    break

    def watch(self, forward: Callable) -> Callable:
        """`forward`, whose first call is timed as the compilation when dynamo has no compile
        callbacks."""
        if self._callbacks:
            return forward

        def first_call_compiles(*args, **kwargs):
            self._calls += 1
            if self._calls > 1:
                return forward(*args, **kwargs)
            self.start()
            try:
                return forward(*args, **kwargs)
            finally:
                self.end()
        return first_call_compiles

    def register(self) -> None:
        """(Re-)register dynamo's compile callbacks: `torch._dynamo.reset()` drops them."""
        try:
            from torch._dynamo.callback import callback_handler

            if self.start not in callback_handler.start_callbacks:
                callback_handler.register_start_callback(self.start)
                callback_handler.register_end_callback(self.end)
            self._callbacks = True
        except (ImportError, AttributeError):
            self._callbacks = False

    def __enter__(self) -> "CompileProgress":
        self.register()
        if self.out is not None:
            self._thread = threading.Thread(target=self._run, name="accucheck-compile-progress",
                                            daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._halt.set()
        self._begun.set()
        if self._thread is not None:
            self._thread.join()
        if self._callbacks:
            from torch._dynamo.callback import callback_handler

            if self.start in callback_handler.start_callbacks:
                callback_handler.remove_start_callback(self.start)
            if self.end in callback_handler.end_callbacks:
                callback_handler.remove_end_callback(self.end)
        with self._lock:  # a compilation interrupted by an error still counts
            if self._started is not None:
                self.seconds += self.clock() - self._started
                self._started = None


TORCHAIR = "torchair"  # --compile-backend name of TorchAir's GE backend (not a dynamo name)


def backend_for(spec: dev.DeviceSpec, compile_backend: str | None) -> tuple[str, str | object]:
    """(name recorded in meta, backend passed to torch.compile) for mode "graph".

    Default on every device: "inductor", torch.compile's own default. On NPU that is
    torch_npu's graph mode: torch_npu registers its inductor lowering for the npu device
    (torch_npu._inductor, Triton kernels unless TORCHINDUCTOR_NPU_BACKEND says mlir / dvm)
    when inductor first compiles. A torch_npu without it fails in the compile, with its own
    traceback; pass --compile-backend torchair there.

    "torchair" (TorchAir's GE graph, `torchair.get_npu_backend()`) only when asked: dynamo's
    list_backends does not list it under that name (torch_npu registers it as "npu"), and
    loading it can raise anything (RuntimeError, OSError, AttributeError when CANN's
    set_env.sh was not sourced), so every failure is a one-line UserError naming the real
    one. Any other name must be one torch.compile knows here."""
    if compile_backend == TORCHAIR:
        return TORCHAIR, _torchair_backend()
    if compile_backend:
        from torch._dynamo import list_backends

        known = sorted(set(list_backends(exclude_tags=())) | {TORCHAIR})
        if compile_backend not in known:
            raise UserError(f"--compile-backend {compile_backend}: torch.compile knows no "
                            f"such backend here; use one of {', '.join(known)}")
        return compile_backend, compile_backend
    return "inductor", "inductor"


def _torchair_backend() -> object:
    """TorchAir's NPU backend with its default CompilerConfig, or a one-line UserError.

    torch_npu puts a lazy stand-in for `torchair` in sys.modules: the real import runs at the
    first attribute read and re-raises whatever it met, later reads raise torch_npu's own
    Exception subclass, not ImportError. Hence `except Exception`."""
    try:
        import torchair

        return torchair.get_npu_backend(compiler_config=torchair.CompilerConfig())
    except Exception as e:
        raise UserError(f"--compile-backend torchair: TorchAir did not load "
                        f"({type(e).__name__}: {one_line(e, 200)}); it ships with torch_npu "
                        f"and needs CANN's set_env.sh sourced (import torch_npu before it); or "
                        f"leave --compile-backend out for inductor") from None


@contextmanager
def dynamo_quiet(mode: str) -> Iterator[None]:
    """Graph mode: dynamo formats a stack trace for every recorded side effect (the recorder's
    list appends, one per record) unless its side-effect replay policy is "silent"; on the
    30-layer SmolLM2 that is 1.6x the whole compile time (193 s vs 123 s measured). The
    compiled program is the same."""
    import torch._dynamo

    if mode != "graph" or not hasattr(torch._dynamo.config, "side_effect_replay_policy"):
        yield
        return
    with torch._dynamo.config.patch(side_effect_replay_policy="silent"):
        yield


def compile_stats(since: dict | None = None) -> dict:
    """torch._dynamo's counters of graphs and graph breaks (minus `since`): evidence that the
    hooks were traced into the graph (0 breaks) rather than splitting it."""
    from torch._dynamo.utils import counters

    now = {"unique_graphs": counters["stats"].get("unique_graphs", 0),
           "graph_breaks": sum(counters["graph_break"].values()),
           "break_reasons": {str(k)[:200]: v for k, v in counters["graph_break"].items()}}
    if since:
        now["unique_graphs"] -= since["unique_graphs"]
        now["graph_breaks"] -= since["graph_breaks"]
        now["break_reasons"] = {k: v - since["break_reasons"].get(k, 0)
                                for k, v in now["break_reasons"].items()
                                if v > since["break_reasons"].get(k, 0)}
    return now
