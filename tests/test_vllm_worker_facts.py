"""What the vLLM workers report about themselves and what the front end does with it (issue 34),
through `capture_vllm` on the fake engine of tests/vllm_fakes.py (its worker in this process):
a sampler that ignores the engine's logprobs_mode is refused before generating."""
from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import vllm_fakes as fk  # noqa: E402
from accucheck.capture.api import CaptureOptions  # noqa: E402
from accucheck.errors import UserError  # noqa: E402

PROMPTS = [[5, 6, 7], [8, 9, 10, 11]]


@pytest.fixture
def engine(monkeypatch):
    return fk.install_engine(monkeypatch)


def _capture(tiny_dir, out, **opts):
    from accucheck.capture.vllm_runner import capture_vllm

    return capture_vllm(tiny_dir, PROMPTS, out, CaptureOptions(max_new_tokens=1, **opts))


def test_a_sampler_that_ignores_logprobs_mode_is_refused(engine, tiny_dir, tmp_path,
                                                         monkeypatch):
    """vllm-ascend's AscendSampler is built without the engine's logprobs_mode (raw_logprobs):
    one line naming the class and the mode, exit 3, before generating, no file. Before: the
    engine generated, and only the check of the returned rows (logsumexp about 0) could
    refuse them afterwards, without naming the sampler (the fake's rows are raw: it passes)."""
    monkeypatch.setattr(engine, "make_runner", staticmethod(lambda: fk.Runner(
        fk.MoEModel("vllm"), sampler=fk.AscendSampler("raw_logprobs"))))
    out = tmp_path / "x.h5"
    with pytest.raises(UserError, match="rank 0's sampler AscendSampler computes "
                                        "logprobs_mode=raw_logprobs, not the raw_logits") as e:
        _capture(tiny_dir, out)
    assert e.value.exit_code == 3 and "\n" not in str(e.value)
    assert not engine.started[-1].generated and not out.exists()
