"""capture.session.CaptureSession: one capture file's life, the same for every runner (issue
35). A file is complete only after `finish()` and a clean exit; an interrupt is one line naming
what was left; a failed coverage verdict refuses the capture. No model: records written by
hand, milliseconds."""
from __future__ import annotations

import pytest
import torch

from accucheck.capture.options import CaptureOptions
from accucheck.capture.session import CaptureSession
from accucheck.coverage import coverage_line
from accucheck.errors import UserError
from accucheck.store import open_capture
from test_store import _add, _key

OPTS = CaptureOptions(store="full")


def _session(path, steps=1, **kw):
    return CaptureSession(path, {"runner": "test"}, OPTS, requests=1, steps=steps, **kw)


def test_complete_only_after_finish(tmp_path):
    with _session(tmp_path / "a.h5") as s:
        _add(s.writer, "m", torch.ones(2))
    with pytest.raises(UserError, match="incomplete"):
        open_capture(tmp_path / "a.h5")
    lines = []
    with _session(tmp_path / "b.h5", progress=lines.append) as s:
        _add(s.writer, "m", torch.ones(2))
        cov = s.finish()
    assert cov["ok"] and lines == [coverage_line(cov)]
    with open_capture(tmp_path / "b.h5") as r:
        assert r.meta["coverage"]["ok"] and r.meta["runner"] == "test"


def test_an_error_after_finish_still_leaves_the_file_incomplete(tmp_path):
    with pytest.raises(RuntimeError):
        with _session(tmp_path / "a.h5") as s:
            _add(s.writer, "m", torch.ones(2))
            s.finish()
            raise RuntimeError("a check after the coverage verdict")
    with open_capture(tmp_path / "a.h5", allow_incomplete=True) as r:
        assert not r.complete


def test_an_interrupt_is_one_line_naming_what_was_left(tmp_path):
    with pytest.raises(UserError, match=r"interrupted \(SIGINT\): .*a\.h5 is left incomplete "
                                        r"\(1 records\)"):
        with _session(tmp_path / "a.h5") as s:
            _add(s.writer, "m", torch.ones(2))
            raise KeyboardInterrupt("SIGINT")
    # an existing file replaced with --force stays as it was
    before = (tmp_path / "a.h5").read_bytes()
    opts = CaptureOptions(store="full", force=True)
    with pytest.raises(UserError, match="the new capture was discarded"):
        with CaptureSession(tmp_path / "a.h5", {}, opts, requests=1, steps=1):
            raise KeyboardInterrupt("SIGTERM")
    assert (tmp_path / "a.h5").read_bytes() == before


def test_a_failed_coverage_verdict_refuses_the_capture(tmp_path):
    """Two steps expected, the module recorded at the prefill only."""
    with pytest.raises(UserError, match="left incomplete"):
        with _session(tmp_path / "a.h5", steps=2) as s:
            _add(s.writer, "m", torch.ones(2))
            s.finish()
    # require=False (batched rows) records the verdict and completes
    with _session(tmp_path / "b.h5", steps=2, require=False) as s:
        _add(s.writer, "m", torch.ones(2))
        assert not s.finish()["ok"]
    with open_capture(tmp_path / "b.h5") as r:
        assert r.meta["coverage"]["ok"] is False
