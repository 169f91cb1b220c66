"""One capture file's life, whoever runs the model: the checks before anything is written, the
writer, interrupts, progress, the coverage verdict and complete / close.

A runner (capture.runners: hf, vllm, batched) checks its options (capture.options), builds the
file's meta (store.meta_header plus what it knows of the model and the engine) and then works
inside a `CaptureSession`:

    check_output_path(out, opts.force, opts.inputs())      # before the model is loaded
    with CaptureSession(out, meta, opts, requests=n, steps=k, progress=progress) as s:
        with interruptible() as guard:
            ...  s.writer.add(...); s.tick(request, step)
        s.finish()                                          # the coverage verdict

On leaving the block the file is closed complete only after `finish()`; otherwise a new file
is left marked incomplete and a replaced one unchanged (store.CaptureWriter). SIGINT / SIGTERM
inside `interruptible()` become UserError (exit 3) naming what was left, never a traceback.

Never imports a runner (tests/test_layout.py).
"""
from __future__ import annotations

import signal
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from accucheck.capture.options import CaptureOptions
from accucheck.capture.record.spill import release_freed_memory
from accucheck.coverage import coverage, coverage_line, sites_of
from accucheck.errors import UserError
from accucheck.paths import check_not_input, check_output_file
from accucheck.store import CaptureWriter, open_capture

Progress = Callable[[str], None]


class CaptureSession:
    """The writer of one capture and the rules of its life (see the module docstring).

    `requests` / `steps`: what the run covers, for the progress lines and the coverage verdict
    (steps counts the prefill: max_new_tokens + 1 for a causal model, 1 otherwise). `require`:
    a module the selection names that never fired fails the capture (`finish` raises);
    False only records the coverage (batched rows, where padding rows are not recorded)."""

    def __init__(self, out: str | Path, meta: dict, opts: CaptureOptions, *, requests: int,
                 steps: int, progress: Progress | None = None, require: bool = True):
        self.out, self.requests, self.steps, self.require = Path(out), requests, steps, require
        self.opts = opts
        self.progress = progress
        self.writer = CaptureWriter(out, meta=meta, store=opts.store, force=opts.force,
                                    compression=opts.compression)
        self.complete = False
        self._ticker = Ticker(progress, requests, steps - 1)

    def __enter__(self) -> "CaptureSession":
        return self

    def __exit__(self, kind, exc, tb) -> bool:
        if kind is not None and issubclass(kind, KeyboardInterrupt):
            self.writer.close(complete=False)
            raise UserError(interrupted_message(self.writer, exc)) from None
        self.writer.close(complete=self.complete and kind is None)
        return False

    def tick(self, request: int, step: int) -> None:
        """At every step boundary: the heap the last step freed goes back to the system
        (`release_freed_memory`), and a progress line at most every Ticker.every seconds of a
        long capture."""
        release_freed_memory()
        self._ticker.tick(request, step, self.writer.n_records)

    def left_behind(self) -> str:
        return left_behind(self.writer)

    def finish(self, cov: dict | None = None) -> dict:
        """The coverage verdict (accucheck.coverage: from the writer's keys, or `cov` as the
        runner measured it, e.g. per rank), written into meta and said in one line; with
        `require`, a capture that misses a selected module is refused (UserError, the file left
        as `left_behind` says). Marks the capture complete: the file is closed complete when
        the session's block then ends without an error."""
        if cov is None:
            cov = coverage(sites_of(self.writer.keys), self.requests, self.steps,
                           only=self.opts.requests,
                           first_step=1 if self.opts.positions == "decode" else 0)
        self.writer.update_meta(coverage=cov)
        if self.progress is not None and self.require:
            self.progress(coverage_line(cov))
        if self.require and not cov["ok"]:
            raise UserError(f"{coverage_line(cov)}; {self.left_behind()}")
        self.complete = True
        return cov


# -- before anything is written ------------------------------------------------------------
def check_output_path(out: str | Path, force: bool, inputs: dict[str, str] | None = None) -> None:
    """Before anything is created: `out` can be written (UserError, exit 3, otherwise) and is
    none of `inputs` ({flag: path}; exit 2: an input is never an output)."""
    check_not_input(out, inputs or {})
    check_output_file(out, force)


def check_input(flag: str, path: str) -> None:
    """A capture named by `flag` opens (complete) and, for --shadow, can serve as a shadow
    reference: checked before any output is touched or the model is loaded."""
    with open_capture(path) as r:
        if flag != "--shadow":
            return
        if r.store_mode != "full":
            raise UserError(f"--shadow {path}: it holds statistics only; the reference must be "
                            f"captured with --store full --inputs")
        if not any(row.key.role == "in" and row.has_data for row in r.rows):
            raise UserError(f"--shadow {path}: it has no recorded inputs; capture the reference "
                            f"with --store full --inputs")



# -- what a capture that did not complete leaves ------------------------------------------
def left_behind(writer: CaptureWriter) -> str:
    """What a capture that did not complete leaves: a new file incomplete, a replaced one as
    it was."""
    if writer.replacing:
        return f"the new capture was discarded, {writer.path} is unchanged"
    return f"{writer.path} is left incomplete ({writer.n_records} records)"


def interrupted_message(writer: CaptureWriter, e: BaseException) -> str:
    """What an interrupted capture left: a new file incomplete, an existing one unchanged."""
    what = f"interrupted ({e.args[0]})" if e.args else "interrupted"
    if writer.replacing:
        return (f"{what}: the new capture was discarded; {writer.path} is unchanged; re-run the "
                f"capture to replace it")
    return (f"{what}: {writer.path} is left incomplete ({writer.n_records} records); re-run the "
            f"capture with --force to replace it")



# -- progress and interrupts ---------------------------------------------------------------
class Ticker:
    """Progress lines for long captures, at most one every `every` seconds."""

    every = 2.0

    def __init__(self, out: Callable[[str], None] | None, n_prompts: int, n_steps: int):
        self.out, self.n_prompts, self.n_steps = out, n_prompts, n_steps
        self.last = time.monotonic()

    def tick(self, req: int, step: int, records: int) -> None:
        now = time.monotonic()
        if self.out is not None and now - self.last >= self.every:
            self.last = now
            self.out(f"capture: prompt {req + 1}/{self.n_prompts}, step {step}/{self.n_steps}, "
                     f"{records} records")


class Interrupts:
    """SIGINT / SIGTERM during a capture end it like Ctrl-C: the file is closed, incomplete.

    The handler only records the signal: raising from a handler can land anywhere, e.g. inside
    a finalizer (`__del__`, a weakref callback of h5py or tqdm), where Python prints "Exception
    ignored" and drops it. `check()`, called at every step boundary (and when the guarded block
    ends), raises KeyboardInterrupt for it. A second signal raises at once: the way out of a
    step that does not end.
    """

    def __init__(self) -> None:
        self.signum: int | None = None

    def _handler(self, signum, frame):
        if self.signum is not None:
            raise KeyboardInterrupt(f"{_signame(signum)} twice")
        self.signum = signum

    def check(self) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt(_signame(self.signum))


def _signame(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


@contextmanager
def interruptible() -> Iterator[Interrupts]:
    """Install the recording handler for SIGINT and SIGTERM (main thread only) and restore
    exactly the dispositions found on exit; a signal recorded during the block interrupts it
    when it ends. A signal whose disposition is SIG_IGN stays ignored, as Python leaves an
    ignored SIGINT it inherits (a job started with `nohup` or `cmd &` from a non-interactive
    shell): the one who started us asked for it not to stop us."""
    guard = Interrupts()
    old = {}
    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            found = signal.getsignal(sig)
            if found is signal.SIG_IGN or found is None:  # ignored, or set outside Python
                continue
            old[sig] = found
            signal.signal(sig, guard._handler)
    except ValueError:  # not in the main thread: signals stay as they were
        pass
    try:
        yield guard
        guard.check()
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
