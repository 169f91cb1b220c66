"""Adding a runner is one file (issue 35): `capture_toy` below is a whole runner for a toy
engine that is not transformers nor vLLM. It checks the output, builds its meta, and feeds a
capture.session.CaptureSession through the record/ recorder from its own forward loop; the file
it writes is a capture like any other: `accucheck diff` compares two of them and names the
module of a planted fault. No transformers model: a hand-made nn.Module, greedy decoding by
hand, well under a second."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from accucheck.capture.options import CaptureOptions
from accucheck.capture.record.recorder import Recorder
from accucheck.capture.record.selection import select_modules
from accucheck.capture.session import CaptureSession, check_output_path, interruptible
from accucheck.store import meta_header, open_capture
from accucheck.verdict.locate import analyze

VOCAB, HIDDEN = 32, 16


# ----------------------------------------------------------------------------- the runner

def capture_toy(model: nn.Module, prompts: list[list[int]], out: str | Path,
                opts: CaptureOptions) -> Path:
    """Greedy decoding of `prompts` (token ids) by `model` (ids [1, T] -> logits [1, T, V]),
    every selected module recorded at every step: the prefill, then one token per step."""
    check_output_path(out, opts.force, opts.inputs())
    modules = select_modules(model, opts.include, opts.exclude)
    meta = {**meta_header("toy"), "device": "cpu", "dtype": "float32", "mode": "eager",
            "model": {"class": type(model).__name__, "causal_lm": True},
            "modules": modules, "logits": {"kind": "raw", "source": "the toy's output"}}
    steps = opts.max_new_tokens + 1
    with CaptureSession(out, meta, opts, requests=len(prompts), steps=steps) as session:
        recorder = Recorder(model, session.writer, modules)
        with interruptible() as guard, recorder.hooks(), torch.no_grad():
            for r, ids in enumerate(prompts):
                seq, new = list(ids), []
                for step in range(steps):
                    guard.check()
                    session.tick(r, step)
                    recorder.begin_step(r, step)
                    x = torch.tensor([seq if step == 0 else seq[-1:]])
                    logits = model(x, past=len(seq) - x.shape[1])
                    recorder.end_step(logits)
                    nxt = int(logits[0, -1].argmax())
                    seq.append(nxt)
                    new.append(nxt)
                session.writer.set_request(r, ids, new[:opts.max_new_tokens])
        session.finish()
    return Path(out)


# ----------------------------------------------------------------------------- a toy engine

class Toy(nn.Module):
    """Embedding, two residual MLP blocks with a norm each, an output head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, 64),
                                                  nn.GELU(), nn.Linear(64, HIDDEN))
                                    for _ in range(2))
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids: torch.Tensor, past: int = 0) -> torch.Tensor:
        h = self.embed(ids)
        for b in self.blocks:
            h = h + b(h)
        return self.head(h)


def test_a_runner_in_one_file_writes_a_capture_diff_understands(tmp_path):
    opts = CaptureOptions(store="full", max_new_tokens=2)
    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    ref = capture_toy(Toy(), prompts, tmp_path / "ref.h5", opts)
    with open_capture(ref) as r:
        assert r.meta["runner"] == "toy" and r.meta["coverage"]["ok"]
        assert [len(q.generated_ids) for q in r.requests] == [2, 2]
        assert "r1.s2:blocks.1.1#0:out.0" in {str(row.key) for row in r.rows}
    same = capture_toy(Toy(), prompts, tmp_path / "same.h5", opts)
    assert analyze(ref, same).exit_code == 0
    faulty = Toy()
    with torch.no_grad():
        faulty.blocks[1][3].weight.mul_(1.3)    # the second block's output projection
    cand = capture_toy(faulty, prompts, tmp_path / "cand.h5", opts)
    a = analyze(ref, cand)
    assert a.exit_code == 1
    assert a.location.first_divergence.module == "blocks.1.3"
    assert a.culprit is not None and a.culprit.module == "blocks.1.3"
