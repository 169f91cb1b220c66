"""A candidate that runs other weights than the reference is said so by `diff` (compare.weights,
from each capture's meta "weights")."""
from __future__ import annotations

import copy

import pytest
import torch

from accucheck.capture.runners.hf import capture_model
from accucheck.capture.record.stats import weight_table
from accucheck.compare.diff import diff_captures
from accucheck.compare.weights import weight_differences, weight_notes

W = "model.layers.1.mlp.up_proj.weight"


def _entry(dtype="float32", checksum=7, sample=(1.0, -2.0, 0.5), shape=(3, 4)):
    return {"dtype": dtype, "shape": list(shape), "checksum": checksum, "sample": list(sample)}


def test_same_dtype_compares_every_bit():
    a = {"weights": {"w": _entry(), "b": _entry(checksum=1)}}
    assert weight_differences(a, a) == []
    b = {"weights": {"w": _entry(checksum=8), "b": _entry(checksum=1)}}
    assert weight_differences(a, b) == [("w", "float32, checksum 7 vs 8")]
    c = {"weights": {"w": _entry(shape=(4, 3)), "b": _entry(checksum=1)}}
    assert weight_differences(a, c)[0][1] == "shape [3, 4] vs [4, 3]"


def test_another_dtype_compares_the_cast_exactly():
    ref = {"weights": {"w": dict(_entry(), cast={"bfloat16": 5, "float16": 6})}}
    assert weight_differences(ref, {"weights": {"w": _entry("bfloat16", 5)}}) == []
    assert weight_differences({"weights": {"w": _entry("float16", 6)}}, ref) == []
    (name, why), = weight_differences(ref, {"weights": {"w": _entry("bfloat16", 9)}})
    assert name == "w" and why == ("float32 vs bfloat16, the float32 weight cast to bfloat16: "
                                   "checksum 5 vs 9")


def test_bfloat16_vs_float16_compares_samples_within_one_ulp():
    ref = {"weights": {"w": _entry("float16", 1, (1.0, -2.0, 0.1, None))}}
    cast = {"weights": {"w": _entry("bfloat16", 99, (1.0, -2.0, 0.10009765625, None))}}
    assert weight_differences(ref, cast) == []
    changed = {"weights": {"w": _entry("bfloat16", 99, (1.0, -2.0, 0.1015625, None))}}
    (name, why), = weight_differences(ref, changed)
    assert name == "w" and "sampled value 2" in why and "beyond the cast" in why


def test_names_on_one_side_and_old_captures_are_not_compared():
    a = {"weights": {"w": _entry()}}
    assert weight_differences(a, {"weights": {"qkv": _entry(checksum=3)}}) == []
    assert weight_differences(a, {}) == [] and weight_notes({}, a) == []


def test_weight_table_is_exact_and_dtype_independent(tiny):
    model, _ = tiny
    t32 = weight_table(model)
    assert set(t32) >= {n for n, _ in model.named_parameters()}
    assert t32[W]["shape"] == [512, 256] and len(t32[W]["sample"]) == 8
    for dt in (torch.bfloat16, torch.float16, torch.float64):
        other = weight_table(copy.deepcopy(model).to(dt))
        assert weight_differences({"weights": t32}, {"weights": other}) == [], dt
    assert weight_differences({"weights": t32}, {"weights": t32}) == []


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_diff_names_the_weight_the_candidate_changed(tiny, tmp_path, dtype):
    model, tok = tiny
    ref = capture_model(model, ["The quick brown fox"], tmp_path / "ref.h5", tokenizer=tok)
    same = capture_model(model, ["The quick brown fox"], tmp_path / "same.h5", tokenizer=tok,
                         dtype=dtype)
    assert not any("WEIGHTS" in n for n in diff_captures(ref, same).notes)
    other = copy.deepcopy(model)
    with torch.no_grad():
        dict(other.named_parameters())[W][7, 3] += 0.05
    cand = capture_model(other, ["The quick brown fox"], tmp_path / "cand.h5", tokenizer=tok,
                         dtype=dtype)
    notes = [n for n in diff_captures(ref, cand).notes if n.startswith("WEIGHTS DIFFER")]
    assert len(notes) == 1 and W in notes[0] and "1 weight(s)" in notes[0], notes
