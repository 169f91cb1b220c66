"""A module whose tensors hold another number of rows than the step's tokens (vLLM's
sequence-parallel padding, vllm-ascend's MC2 / FlashComm token splits: each rank holds a
padded or split share) is dropped by the worker as "first dimension is not tokens". The
coverage verdict expects only sites recorded at least once, so a module dropped at every step
passed it: now the capture is refused in one line naming the module (issue 34, item 5)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from accucheck.coverage import skipped_throughout

pytest.importorskip("vllm")

import vllm_fakes as fk  # noqa: E402
from accucheck.capture.options import CaptureOptions  # noqa: E402
from accucheck.errors import UserError  # noqa: E402

PROMPTS = [[5, 6, 7], [8, 9, 10, 11]]
PAD = 8  # sequence parallel pads the tokens to a multiple of the ranks


class PaddedBlock(fk.MoEBlock):
    """An MLP whose output keeps the padded rows, as a sequence-parallel layout holds them."""

    def forward(self, x):
        y = super().forward(x)
        return F.pad(y, (0, 0, 0, -x.shape[0] % PAD))


class PaddedLayer(fk.Layer):
    def __init__(self, g, variant):
        super().__init__(g, variant)
        self.mlp = PaddedBlock(g, variant)

    def forward(self, x):
        return x + self.mlp(x)[: x.shape[0]]


def _padded_model():
    model = fk.MoEModel("vllm")
    g = torch.Generator().manual_seed(1)
    model.model.layers[0] = PaddedLayer(g, "vllm")
    return model


def test_a_module_dropped_at_every_step_is_refused(monkeypatch, tiny_dir, tmp_path):
    engine = fk.install_engine(monkeypatch)
    monkeypatch.setattr(engine, "make_runner", staticmethod(lambda: fk.Runner(_padded_model())))
    from accucheck.capture.runners.vllm import capture_vllm
    from accucheck.store import open_capture

    out = tmp_path / "x.h5"
    with pytest.raises(UserError, match=r"coverage FAILED: 1 selected module recorded nothing "
                                        r"at any step \(first: model\.layers\.0\.mlp: first "
                                        r"dimension is not tokens\)") as e:
        capture_vllm(tiny_dir, PROMPTS, out, CaptureOptions(max_new_tokens=1))
    assert "\n" not in str(e.value) and "sequence parallelism" in str(e.value)
    with open_capture(out, allow_incomplete=True) as c:  # kept, marked incomplete
        assert not c.complete


def test_a_module_with_one_slot_dropped_is_not_refused():
    """Only a module with no record at all: a router whose routing slots a worker could not
    tap, but whose logits were recorded, is the routing check's business."""
    sites = {"model.layers.0.mlp.gate#0:out.0", "model.layers.0.mlp#0:out.0"}
    skipped = {"model.layers.0.mlp.gate:out.2": "graph mode: not tapped"}
    assert skipped_throughout(["model.layers.0.mlp.gate", "model.layers.0.mlp"], sites,
                              skipped) is None
    assert skipped_throughout(["model.layers.0.mlp.gate", "model.layers.1.mlp"], sites,
                              {"model.layers.1.mlp:out.0": "first dimension 8 is not tokens"}
                              ).startswith("coverage FAILED: 1 selected module")
    # a selected module that never ran and that no worker skipped is left to coverage
    assert skipped_throughout(["model.layers.1.mlp"], sites, {}) is None
