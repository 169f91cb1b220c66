"""--mode graph says it is compiling while torch.compile / the backend works, and records how
long that took (meta compile_seconds)."""
from __future__ import annotations

import time

import torch

from accucheck.capture.session import Ticker
from accucheck.capture.runners.hf import capture_model
from accucheck.capture.record.compiling import CompileProgress
from accucheck.store import open_capture


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_progress_lines_while_compiling_and_the_seconds_it_took():
    clock, lines = _Clock(), []
    cp = CompileProgress(lines.append, "inductor", clock=clock)
    assert cp.tick() is False and lines == []  # nothing compiles: nothing said
    cp.start()
    clock.now += 5
    assert cp.tick() is True
    clock.now += 7
    cp.tick()
    cp.end()
    assert cp.tick() is False
    assert lines == ["capture: compiling (inductor), 5 s", "capture: compiling (inductor), 12 s"]
    cp.start()  # a recompilation (a decode step's new shape), nested callbacks counted once
    cp.start()
    clock.now += 3
    cp.end()
    assert cp.tick() is True  # the outer compilation still runs
    cp.end()
    assert cp.seconds == 15.0


def test_first_call_counts_without_dynamo_callbacks():
    clock = _Clock()
    cp = CompileProgress(None, None, clock=clock)

    def forward():
        clock.now += 4
        return "out"
    watched = cp.watch(forward)  # not entered: no callbacks, the first call is the compile
    assert watched() == "out" and watched() == "out"
    assert cp.seconds == 4.0


def test_graph_capture_says_it_is_compiling(tiny, tmp_path, monkeypatch):
    from torch._dynamo import register_backend

    @register_backend(name="accucheck_slow_test")
    def slow(gm, example_inputs):  # a backend that takes its time, like a real model's
        time.sleep(0.4)
        return gm.forward

    monkeypatch.setattr(CompileProgress, "every", 0.05)
    monkeypatch.setattr(Ticker, "every", 1e9)  # only the compile lines
    model, tok = tiny
    lines: list[str] = []
    torch._dynamo.reset()
    out = capture_model(model, ["The quick brown fox"], tmp_path / "g.h5", tokenizer=tok,
                        mode="graph", compile_backend="accucheck_slow_test", progress=lines.append)
    assert lines.pop().startswith("coverage: ")  # the capture's last line: its coverage verdict
    assert lines and all(ln.startswith("capture: compiling (accucheck_slow_test") and
                         ln.endswith(" s") for ln in lines), lines
    # the observer check compiles the model twice: without taps first, then with them
    untapped = "capture: compiling (accucheck_slow_test, untapped run of the observer check), "
    assert lines[0].startswith(untapped), lines
    assert any(ln.startswith("capture: compiling (accucheck_slow_test), ") for ln in lines), lines
    with open_capture(out) as r:
        assert r.meta["compile_seconds"] >= 0.8
        assert r.meta["observer_effect"]["bitwise"]
        assert r.meta["compile_backend"] == "accucheck_slow_test"
