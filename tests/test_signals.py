"""SIGINT / SIGTERM during a capture, deterministically: the signal is sent from inside the
capture at a known step (no sleeps racing it), in a subprocess running `accucheck capture`.

Each case asserts: exit 3, one line on stderr and no "Traceback" / "Exception ignored", the
output opens as incomplete (or, when it replaced an existing file, that file is byte-identical
and no temporary file is left), and the handlers are restored afterwards.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import accucheck
from accucheck.cli import main

REPO = str(Path(accucheck.__file__).resolve().parent.parent)

# Runs `accucheck capture` (cli.main, as `python -m accucheck` does) once per case in one
# process. accucheck.capture.runners.hf.greedy_run is wrapped so that at step AT the signal is sent:
#   boundary  - just before the step starts
#   finalizer - from inside a weakref finalizer, so the handler runs inside it (where an
#               exception raised by a handler is dropped with "Exception ignored")
#   twice     - twice inside the model's forward of that step: the second aborts at once
# Each case's stderr (file descriptor 2, so that anything Python or C prints is kept) goes to
# its own file; the results go to results.json.
DRIVER = textwrap.dedent('''
    import json, os, signal, sys, weakref
    from pathlib import Path

    sig = getattr(signal, sys.argv[1])
    # the disposition this test needs, whatever this process inherited (a background job
    # inherits SIGINT ignored): Python's own for SIGINT, the default for SIGTERM
    signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    before = signal.getsignal(sig)
    model, work = sys.argv[2], Path(sys.argv[3])
    cases = json.loads(sys.argv[4])
    import accucheck.capture.runners.hf as api
    from accucheck.cli import main

    AT = 2
    plan = {}
    orig = api.greedy_run

    def kill():
        os.kill(os.getpid(), sig)

    def greedy_run(forward, ids, device, n, *, on_step, **kw):
        def fwd(*a, **k):
            if plan.pop("in_forward", False):
                kill()
                kill()  # the second signal: KeyboardInterrupt here, mid-step
            return forward(*a, **k)

        def step(k):
            if k == AT:
                how = plan["how"]
                if how == "boundary":
                    kill()
                elif how == "finalizer":
                    class Box:
                        pass

                    def finalizer():
                        kill()
                        sum(range(10000))  # the handler runs here, inside the finalizer

                    box = Box()
                    weakref.finalize(box, finalizer)
                    del box
                elif how == "twice":
                    plan["in_forward"] = True
            on_step(k)
        return orig(fwd, ids, device, n, on_step=step, **kw)

    api.greedy_run = greedy_run
    results = {}
    for name, how, out, force in cases:
        plan.clear()
        plan["how"] = how
        err_path = work / f"{name}.stderr"
        sys.stderr.flush()
        saved = os.dup(2)
        fd = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 2)
        os.close(fd)
        args = ["capture", model, "--prompt", "a signal at a known step", "--max-new-tokens",
                "6", "--store", "full", "-o", out] + (["--force"] if force else [])
        try:
            main(args)
            code = 0
        except SystemExit as e:
            code = e.code
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        results[name] = {"code": code, "stderr": err_path.read_text(),
                         "handler_restored": signal.getsignal(sig) is before}
    (work / "results.json").write_text(json.dumps(results))
''')


def _env() -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def one_error_line(err: str) -> str:
    assert "Traceback" not in err and "Exception ignored" not in err, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("accucheck: error:")]
    assert len(errors) == 1, err
    # the only other lines allowed: the one that names the run, and progress lines (one every
    # 2 s of a capture: a loaded machine prints some)
    assert all(ln.startswith(("capturing ", "capture: prompt ")) for ln in lines
               if ln not in errors), err
    return errors[0]


@pytest.mark.slow
@pytest.mark.signals
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_signal_at_a_known_step_ends_the_capture_cleanly(sig, tiny_dir, tmp_path, capsys):
    keep = tmp_path / "keep.h5"
    with pytest.raises(SystemExit) as e:
        main(["capture", str(tiny_dir), "--prompt", "kept", "-o", str(keep)])
    assert e.value.code == 0, capsys.readouterr().err
    precious = keep.read_bytes()
    cases = [("boundary", "boundary", str(tmp_path / "boundary.h5"), False),
             ("finalizer", "finalizer", str(tmp_path / "finalizer.h5"), False),
             ("twice", "twice", str(tmp_path / "twice.h5"), False),
             ("replace", "boundary", str(keep), True)]
    (tmp_path / "driver.py").write_text(DRIVER)
    proc = subprocess.run([sys.executable, str(tmp_path / "driver.py"), sig, str(tiny_dir),
                           str(tmp_path), json.dumps(cases)],
                          env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr
    results = json.loads((tmp_path / "results.json").read_text())
    for name, *_ in cases:
        r = results[name]
        assert r["code"] == 3, (name, r)
        assert r["handler_restored"], name
        line = one_error_line(r["stderr"])
        assert f"interrupted ({sig}" in line, line
    assert f"({sig} twice)" in one_error_line(results["twice"]["stderr"])

    from accucheck.store import open_capture

    for name in ("boundary", "finalizer", "twice"):
        out = tmp_path / f"{name}.h5"
        assert "left incomplete" in one_error_line(results[name]["stderr"])
        with open_capture(out, allow_incomplete=True) as r:
            assert not r.complete and r.rows  # step 0 and 1 were flushed
            assert max(row.key.step for row in r.rows) < 6
    # an existing output is replaced only by a complete capture
    assert "is unchanged" in one_error_line(results["replace"]["stderr"])
    assert keep.read_bytes() == precious
    assert not list(tmp_path.glob(".*.partial"))

    # what the interrupted file says to the other commands
    with pytest.raises(SystemExit) as e:
        main(["inspect", str(tmp_path / "boundary.h5")])
    out, err = capsys.readouterr()
    assert e.value.code == 3 and "INCOMPLETE" in out and "incomplete" in err
    with pytest.raises(SystemExit) as e:
        main(["diff", str(tmp_path / "boundary.h5"), str(keep)])
    _, err = capsys.readouterr()
    assert e.value.code == 3 and "incomplete" in err and "Traceback" not in err


@pytest.fixture
def dispositions():
    """Sets SIGINT / SIGTERM to what the test says, and puts back what was inherited."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def set_(**how):
        for name, handler in how.items():
            signal.signal(getattr(signal, name), handler)
    yield set_
    for s, h in saved.items():
        signal.signal(s, h)


def test_the_handler_only_records_and_a_second_signal_raises_at_once(dispositions):
    from accucheck.capture.session import interruptible

    dispositions(SIGINT=signal.default_int_handler, SIGTERM=signal.SIG_DFL)
    with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
        with interruptible() as guard:
            os.kill(os.getpid(), signal.SIGTERM)  # recorded, nothing raised here
            sum(range(1000))
            assert guard.signum == signal.SIGTERM
            with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
                guard.check()  # what every step boundary does
            with pytest.raises(KeyboardInterrupt, match="SIGTERM twice"):
                os.kill(os.getpid(), signal.SIGTERM)
                sum(range(1000))
        # leaving the block with a recorded signal interrupts too
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_an_inherited_ignored_sigint_stays_ignored_and_is_restored(dispositions):
    """A background job inherits SIGINT ignored: the capture must not start listening to it,
    and leaves it ignored. SIGTERM, set to a handler of the caller's, is recorded and then
    restored to that very handler."""
    from accucheck.capture.session import interruptible

    seen = []

    def callers(signum, frame):
        seen.append(signum)
    dispositions(SIGINT=signal.SIG_IGN, SIGTERM=callers)
    with interruptible() as guard:
        os.kill(os.getpid(), signal.SIGINT)  # ignored: nothing recorded, nothing raised
        sum(range(1000))
        assert guard.signum is None
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    assert signal.getsignal(signal.SIGTERM) is callers and seen == []
    with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
        with interruptible():
            os.kill(os.getpid(), signal.SIGTERM)
            sum(range(1000))
    assert signal.getsignal(signal.SIGTERM) is callers and seen == []
