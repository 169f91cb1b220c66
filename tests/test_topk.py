"""Logits as top-k log-probabilities (issue 36, item 2: `capture --logits topk:K`): what the
file holds, and a diff of top-k captures against top-k or full ones that finds the same token
flips, the same top-1 / top-2 margins and never more KL than the full vocabulary gives."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from accucheck.capture.record.selection import topk_logprobs
from accucheck.cli import main
from accucheck.compare.diff import diff_captures
from accucheck.compare import topk
from accucheck.compare.topk import TopkSide, compare_topk
from accucheck.store import logits_topk, open_capture

PROMPTS = ["The quick brown fox jumps over the lazy dog", "Accuracy of large models"]
K = 8


def run(args, capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in args])
    out, err = capsys.readouterr()
    return e.value.code, out, err


def _capture(tiny, path, fault=None, **kw):
    from accucheck.capture.faults import planted
    from accucheck.capture.runners.hf import capture_model

    model, tok = tiny
    kw = dict(tokenizer=tok, max_new_tokens=3, **kw)
    if fault is None:
        return capture_model(model, PROMPTS, path, **kw)
    with planted(model, *fault):
        return capture_model(model, PROMPTS, path, **kw)


FAULT = ("model.norm", "noise:0.6")  # moves the logits enough to flip greedy tokens


@pytest.fixture(scope="module")
def caps(tiny, tmp_path_factory):
    d = tmp_path_factory.mktemp("topk")
    _capture(tiny, d / "full.h5", store="full")
    _capture(tiny, d / "topk.h5", logits=f"topk:{K}")                       # stats store
    _capture(tiny, d / "bad_full.h5", FAULT, store="full")
    _capture(tiny, d / "bad_topk.h5", FAULT, logits=f"topk:{K}")
    _capture(tiny, d / "last2.h5", logits="topk:4", positions="last:2")
    return d


def test_the_file_holds_the_top_k_of_the_full_logits_and_the_following_token(caps):
    with open_capture(caps / "full.h5") as f, open_capture(caps / "topk.h5") as t:
        assert logits_topk(t.meta) == K and logits_topk(f.meta) is None
        for r, req in enumerate(t.requests):
            gen = list(req.generated_ids)
            for step in range(4):
                full = torch.from_numpy(f.read(f"r{r}.s{step}:logits#0:out.0"))
                values = t.read(f"r{r}.s{step}:logits#0:out.0")  # kept in the stats store
                ids = t.read(f"r{r}.s{step}:logits#0:out.1")
                n = full.shape[1]
                assert values.shape == ids.shape == (1, n, K + 1)
                taken = gen[step] if step < len(gen) else int(full[0, -1].argmax())
                want = (list(req.prompt_ids[1:]) if step == 0 else []) + [taken]
                assert ids[0, :, 0].tolist() == want
                lp = torch.log_softmax(full.double(), -1)
                top = torch.topk(lp, K, -1)
                assert ids[0, :, 1:].tolist() == top.indices[0].tolist()
                np.testing.assert_allclose(values[0, :, 1:], top.values[0].numpy(), atol=1e-5)
                np.testing.assert_allclose(values[0, :, 0],
                                           lp[0].gather(-1, torch.tensor(want)[:, None])[:, 0],
                                           atol=1e-5)


def test_a_top_k_diff_finds_the_full_diffs_flips_and_margins(caps):
    full = diff_captures(caps / "full.h5", caps / "bad_full.h5")
    for ref, cand in (("topk.h5", "bad_topk.h5"), ("full.h5", "bad_topk.h5"),
                      ("topk.h5", "bad_full.h5")):
        d = diff_captures(caps / ref, caps / cand)
        assert any("compared on the tokens both hold" in n for n in d.notes), (ref, cand)
        assert full.first_flip is not None
        assert (d.first_flip.req, d.first_flip.step, d.first_flip.position,
                d.first_flip.ref_token, d.first_flip.cand_token) == \
            (full.first_flip.req, full.first_flip.step, full.first_flip.position,
             full.first_flip.ref_token, full.first_flip.cand_token), (ref, cand)
        assert [(f.req, f.step) for f in d.flips] == [(f.req, f.step) for f in full.flips]
        by = {(s.key.req, s.key.step): s for s in full.logits}
        assert len(d.logits) == len(full.logits)
        for s in d.logits:
            f = by[(s.key.req, s.key.step)]
            for p, q in zip(s.positions, f.positions):
                assert (p.top1_ref, p.top1_cand) == (q.top1_ref, q.top1_cand)
                assert p.margin == pytest.approx(q.margin, abs=1e-4)
                assert p.kl <= q.kl + 1e-6       # a coarser partition: a lower bound
        assert max(p.kl for s in d.logits for p in s.positions) > 0.05


def test_top_k_captures_of_one_run_agree(caps, capsys):
    code, out, _ = run(["diff", caps / "full.h5", caps / "topk.h5"], capsys)
    assert code == 0 and "PASS" in out and "top-8 log-probabilities" in out
    code, out, _ = run(["diff", caps / "topk.h5", caps / "topk.h5"], capsys)
    assert code == 0, out


def test_positions_cut_the_top_k_records_too(caps):
    with open_capture(caps / "last2.h5") as c:
        assert c.read("r0.s0:logits#0:out.0").shape == (1, 2, 5)
        assert c.read("r0.s0:logits#0:out.1").shape == (1, 2, 5)
    d = diff_captures(caps / "full.h5", caps / "last2.h5")
    assert d.within and d.first_flip is None


def test_the_coarse_kl_is_a_lower_bound_and_the_flip_exact():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(40, 300)) * 3
    b = a + rng.normal(size=a.shape) * 0.7
    follow = torch.from_numpy(rng.integers(0, 300, size=(40,)))
    va, ia = topk_logprobs(torch.from_numpy(a)[None], 16, follow[None])
    vb, ib = topk_logprobs(torch.from_numpy(b)[None], 16, follow[None])
    la, lb = (torch.log_softmax(torch.from_numpy(x), -1).numpy() for x in (a, b))
    full_kl = np.sum(np.exp(la) * (la - lb), axis=-1)
    for ref, cand in ((TopkSide(va[0].numpy(), ia[0].numpy()),
                       TopkSide(vb[0].numpy(), ib[0].numpy())),
                      (TopkSide(a, None), TopkSide(vb[0].numpy(), ib[0].numpy()))):
        _, pos = compare_topk(ref, cand, "float32", "float32", rtol=None, atol=None)
        for i, p in enumerate(pos):
            assert p.top1_ref == int(a[i].argmax()) and p.top1_cand == int(b[i].argmax())
            top2 = np.sort(a[i])[-2:]
            assert p.margin == pytest.approx(top2[1] - top2[0], abs=1e-4)
            assert 0 <= p.kl <= full_kl[i] + 1e-6
    assert sum(p.top1_ref != p.top1_cand for p in pos) > 0   # the case has flips
    # every token held: the KL is the full one; the same side twice: nothing apart
    va, ia = topk_logprobs(torch.from_numpy(a)[None], 300, follow[None])
    vb, ib = topk_logprobs(torch.from_numpy(b)[None], 300, follow[None])
    _, pos = compare_topk(TopkSide(va[0].numpy(), ia[0].numpy()),
                          TopkSide(vb[0].numpy(), ib[0].numpy()), "float32", "float32",
                          rtol=None, atol=None)
    np.testing.assert_allclose([p.kl for p in pos], full_kl, rtol=1e-4, atol=1e-6)
    same, pos = compare_topk(TopkSide(va[0].numpy(), ia[0].numpy()),
                             TopkSide(va[0].numpy(), ia[0].numpy()), "float32", "float32",
                             rtol=None, atol=None)
    assert same.identical and all(p.kl == 0 and p.noise == 0 for p in pos)


def test_blocks_of_a_full_side_give_the_whole_answer(monkeypatch):
    rng = np.random.default_rng(1)
    a = rng.normal(size=(37, 500)) * 2
    b = a + rng.normal(size=a.shape) * 0.3
    vb, ib = topk_logprobs(torch.from_numpy(b)[None], 8, torch.zeros(1, 37, dtype=torch.long))
    sides = (TopkSide(a, None), TopkSide(vb[0].numpy(), ib[0].numpy()))
    whole = compare_topk(*sides, "float32", "float32", rtol=None, atol=None)
    monkeypatch.setattr(topk, "BLOCK_ELEMS", 3 * 500)   # 3 positions a block
    blocks = compare_topk(*sides, "float32", "float32", rtol=None, atol=None)
    assert blocks[1] == whole[1]
    assert blocks[0].rel_l2 == pytest.approx(whole[0].rel_l2, rel=1e-12)


@pytest.mark.parametrize("bad", ["topk:0", "topk:x", "top:5", "topk:100000"])
def test_a_bad_logits_flag_is_a_usage_error(bad, tmp_path, capsys):
    code, _, err = run(["capture", "@tiny", "--prompt", "hi", "--logits", bad,
                        "-o", tmp_path / "x.h5"], capsys)
    assert code == 2 and "--logits" in err and "Traceback" not in err
    assert not (tmp_path / "x.h5").exists()


def test_the_default_is_top_k_in_the_stats_store_and_full_in_the_full_store():
    from accucheck.capture.options import DEFAULT_TOPK, CaptureOptions, check_runner
    from accucheck.errors import UserError

    assert CaptureOptions().logits == f"topk:{DEFAULT_TOPK}"
    assert CaptureOptions(store="full").logits == "full"
    assert CaptureOptions(store="full", logits="topk:5").logits == "topk:5"
    assert CaptureOptions(logits="full").meta().get("logits") is None
    with pytest.raises(UserError, match="raw_logprobs"):
        check_runner(CaptureOptions(logits="topk:4"), "vllm", {"logprobs_mode": "raw_logits"})


def test_a_control_takes_the_references_logits_form_and_impact_refuses_top_k(tiny, caps,
                                                                              capsys, tmp_path):
    from accucheck.capture.options import CaptureOptions
    from accucheck.capture.runners.control import control_run

    _, opts = control_run(caps / "topk.h5", CaptureOptions(), dtype_given=False)
    assert opts.logits == f"topk:{K}"
    ref = _capture(tiny, tmp_path / "ref.h5", store="full", logits="topk:4")
    code, _, err = run(["impact", ref, "@tiny"], capsys)
    assert code == 3 and "top-4 log-probabilities" in err and "Traceback" not in err
