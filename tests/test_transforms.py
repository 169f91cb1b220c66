"""Declared transforms before compare (accucheck.compare.transforms, `accucheck diff
--transform`): each function against a known answer, the parser's refusals, and end to end on
hand-made captures where the untransformed comparison fails and the declared one passes."""
from __future__ import annotations

import numpy as np
import pytest

from accucheck.compare.diff import diff_captures
from accucheck.compare.transforms import (apply, dequant, parse_transform, permute, reshape,
                                          rotate)
from accucheck.errors import UserError
from test_verdicts import cap

RNG = np.random.default_rng(7)


def _hadamard(n: int) -> np.ndarray:
    h = np.array([[1.0]])
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(n)


def _nz(w: np.ndarray, m0: int = 16, n0: int = 16) -> np.ndarray:
    """An [m, n] matrix in NZ-style blocks [n1, m1, m0, n0] (Ascend's fractal layout)."""
    m, n = w.shape
    return w.reshape(m // m0, m0, n // n0, n0).transpose(2, 0, 1, 3)


def test_dequant_per_tensor_per_channel_and_per_token():
    q = RNG.integers(-127, 128, (2, 3, 4)).astype(np.float64)
    assert np.array_equal(dequant(q, np.array(0.5)), q * 0.5)
    ch = np.array([1.0, 2.0, 0.5, 0.25])
    assert np.array_equal(dequant(q, ch), q * ch)
    tok = np.array([[[2.0], [3.0], [4.0]]])
    assert np.array_equal(dequant(q, tok), q * tok)
    assert np.array_equal(dequant(q, ch.reshape(1, 1, 1, 4)), q * ch)  # extra leading 1s
    with pytest.raises(UserError):
        dequant(q, np.ones(5))


def test_permute_and_reshape_undo_an_nz_block_layout():
    w = RNG.standard_normal((32, 64))
    blocks = _nz(w)
    assert blocks.shape == (4, 2, 16, 16)
    back = reshape(permute(blocks, (1, 2, 0, 3)), (32, 64))
    assert np.array_equal(back, w)
    t = parse_transform("cand:*w=permute:1,2,0,3+reshape:32,64")
    assert np.array_equal(apply(t, blocks, lambda p: None), w)
    with pytest.raises(UserError):
        permute(w, (1, 0, 2))
    with pytest.raises(UserError):
        reshape(w, (7, -1))


def test_rotate_undoes_a_hadamard_rotation():
    x = RNG.standard_normal((1, 5, 64))
    q = _hadamard(64)
    y = x @ q
    assert not np.allclose(y, x)
    assert np.allclose(rotate(y, q), x, atol=1e-12)
    with pytest.raises(UserError):
        rotate(y, q[:32, :32])


@pytest.mark.parametrize("text, message", [
    ("*.x", "use [ref:|cand:]PATTERN=STEP"),
    ("*.x=squash:1", "step 'squash:1'"),
    ("*.x=permute:0,0", "not a permutation"),
    ("*.x=permute:a,b", "takes integers"),
    ("*.x=reshape:-1,-1", "one -1 at most"),
    ("cand:=dequant:k", "use [ref:|cand:]PATTERN=STEP"),
])
def test_malformed_transforms_are_usage_errors(text, message):
    with pytest.raises(UserError) as e:
        parse_transform(text)
    assert e.value.exit_code == 2 and message in str(e.value)


def test_sides_and_steps_are_parsed():
    t = parse_transform("ref:*o_proj#0:out.0=dequant:*o_proj#0:out.scale+reshape:1,-1")
    assert (t.side, t.pattern) == ("ref", "*o_proj#0:out.0")
    assert [s.kind for s in t.steps] == ["dequant", "reshape"] and t.steps[1].ints == (1, -1)
    assert t.needs() == ("*o_proj#0:out.scale",)
    assert parse_transform("*.x=rotate:r").side == "cand"


def test_a_declared_dequant_makes_an_int8_style_record_comparable(tmp_path):
    """The candidate stores o_proj's output as int8-style integers with a per-channel scale
    record next to it: compared raw it fails; declared, it matches within float32."""
    x = RNG.standard_normal((1, 3, 8))
    scale = np.abs(x).max(axis=(0, 1)) / 127.0
    q = np.round(x / scale)
    key = "r0.s0:model.layers.0.self_attn.o_proj#0:out.0"
    ref = cap(tmp_path / "r.h5", [(key, x, None, None)])
    cand = cap(tmp_path / "c.h5", [(key, q, None, None),
                                   ("r0.s0:model.layers.0.self_attn.o_proj#0:out.scale",
                                    scale, None, None)])
    raw = diff_captures(ref, cand)
    assert not raw.within
    t = parse_transform("cand:*o_proj#0:out.0=dequant:*o_proj#0:out.scale")
    d = diff_captures(ref, cand, transforms=[t], tolerances=None)
    r = d.record(key)
    # rounding to 127 levels: an error of at most half a step per element
    assert r.basis == "tensor" and r.error < 0.02 and r.error < raw.record(key).error / 10
    assert any(n.startswith(f"--transform {t.text}: applied to 1 record") for n in d.notes)


def test_a_transform_that_matches_nothing_is_refused(tmp_path):
    key = "r0.s0:model.layers.0.mlp#0:out.0"
    x = RNG.standard_normal((1, 3, 8))
    ref = cap(tmp_path / "r.h5", [(key, x, None, None)])
    cand = cap(tmp_path / "c.h5", [(key, x, None, None)])
    with pytest.raises(UserError) as e:
        diff_captures(ref, cand, transforms=[parse_transform("*.attn=permute:1,0")])
    assert "matches no record" in str(e.value)


def test_the_cli_applies_a_layout_transform(tmp_path, capsys):
    from accucheck.cli import main

    w = RNG.standard_normal((32, 64))
    key = "r0.s0:model.layers.0.mlp.down_proj#0:out.0"
    ref = cap(tmp_path / "r.h5", [(key, w, None, None)])
    cand = cap(tmp_path / "c.h5", [(key, _nz(w), None, None)])
    args = ["diff", str(ref), str(cand)]
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 1 and "shape [32, 64] vs [4, 2, 16, 16]" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(args + ["--transform", "*down_proj#0:out.0=permute:1,2,0,3+reshape:32,64"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and out.startswith("PASS"), out
    assert "--transform *down_proj#0:out.0=permute:1,2,0,3+reshape:32,64: applied to 1" in out


def test_raw_logits_against_processed_ones_are_refused(tmp_path):
    """Captures say which logits they hold (meta "logits": accucheck records raw ones); a
    processed side (after penalties / temperature) against a raw one is refused in one line."""
    key = "r0.s0:logits#0:out.0"
    x = RNG.standard_normal((1, 3, 16))
    ref, cand = (cap(tmp_path / f"{kind}.h5", [(key, x, None, None)],
                     meta={"logits": {"kind": kind, "source": "test"}})
                 for kind in ("raw", "processed"))
    with pytest.raises(UserError) as e:
        diff_captures(ref, cand)
    assert "holds raw logits" in str(e.value) and "processed ones" in str(e.value)
    assert e.value.exit_code == 3
    assert diff_captures(ref, ref).within  # the same kind: compared
