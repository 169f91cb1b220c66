"""Store: schema, execution order, bf16 bit-exactness, incomplete files, no overwrite."""
from __future__ import annotations

import h5py
import numpy as np
import pytest
import torch

from accucheck.capture.record.recorder import finish_stats
from accucheck.capture.record.stats import tensor_stats, to_host
from accucheck.errors import UserError
from accucheck.keys import RecordKey
from accucheck.store import SAMPLE_SIZE, SCHEMA_VERSION, CaptureWriter, open_capture, sketch_row


def _key(module, step=0):
    return RecordKey(0, step, module, 0, "out", "0")


def _add(w, module, t):
    host, dtype = to_host(t)
    raw = tensor_stats(t).numpy()
    exact = t.detach().to(torch.float64).numpy()
    w.add(_key(module), "module", dtype, tuple(t.shape), finish_stats(raw, t.numel(), exact),
          int(raw[7]), host)


def test_bf16_round_trips_bit_exact(tmp_path):
    t = (torch.randn(3, 50, dtype=torch.float32) * 100).to(torch.bfloat16)
    t[0, 0] = float("nan")
    t[0, 1] = float("-inf")
    t[1, 2] = -0.0
    with CaptureWriter(tmp_path / "a.h5", meta={}, store="full") as w:
        _add(w, "m", t)
    with open_capture(tmp_path / "a.h5") as r:
        back = r.read(_key("m"))
        raw = h5py.File(tmp_path / "a.h5")["tensors"][r.row(_key("m")).data][()]
    assert back.dtype == np.float32
    assert raw.dtype == np.uint16
    expect = t.view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(raw, expect)
    # exact values: converting back to bf16 gives the same bits (NaN payloads aside)
    rt = torch.from_numpy(back).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    finite = ~np.isnan(back)
    np.testing.assert_array_equal(rt[finite], expect[finite])
    assert np.isnan(back[0, 0]) and back[0, 1] == -np.inf


def test_execution_order_is_not_alphabetical(tmp_path):
    mods = [f"model.layers.{i}" for i in (0, 1, 2, 10, 11)]
    order = [mods[i] for i in (0, 1, 2, 3, 4)]
    with CaptureWriter(tmp_path / "a.h5", meta={}, store="full") as w:
        for m in order:
            _add(w, m, torch.ones(2))
    with open_capture(tmp_path / "a.h5") as r:
        assert [row.key.module for row in r.rows] == order
        assert sorted(order) != order  # the alphabetical order would differ


def test_stats_are_exact_and_finite_only(tmp_path):
    t = torch.tensor([1.0, -2.0, 0.0, float("nan"), float("inf"), 4.0])
    with CaptureWriter(tmp_path / "a.h5", meta={}, store="full") as w:
        _add(w, "m", t)
    with open_capture(tmp_path / "a.h5") as r:
        s = r.row(_key("m")).stats
    assert (s.min, s.max, s.nan, s.inf, s.zero, s.numel) == (-2.0, 4.0, 1, 1, 1, 6)
    assert s.mean == pytest.approx(0.75)
    assert s.l2 == pytest.approx(np.sqrt(21))
    # without the tensor at hand (stats mode) the counts stay exact, min..l2 are NaN
    raw = tensor_stats(t).numpy()
    row = finish_stats(raw, t.numel())
    assert list(row[6:10]) == [1, 1, 1, 6] and np.isnan(row[0])
    clean = finish_stats(tensor_stats(torch.tensor([3.0, -4.0])).numpy(), 2)
    assert list(clean[:10]) == pytest.approx([-4, 3, -0.5, np.std([3, -4], ddof=1), 4, 5, 0, 0, 0, 2])
    assert list(clean[10:12]) == [3, -4] and np.isnan(clean[12:10 + SAMPLE_SIZE]).all()  # sample,
    # NaN-padded, then the sketch row
    np.testing.assert_allclose(clean[10 + SAMPLE_SIZE:], sketch_row(np.array([3.0, -4.0])))
    assert np.isnan(row[10 + SAMPLE_SIZE + 1:]).all()  # a NaN or an Inf: no sketch


def test_refuses_to_overwrite(tmp_path):
    p = tmp_path / "a.h5"
    p.write_bytes(b"precious")
    with pytest.raises(UserError, match="--force"):
        CaptureWriter(p, meta={})
    assert p.read_bytes() == b"precious"


def test_incomplete_file_opens_but_is_refused_by_default(tmp_path):
    p = tmp_path / "a.h5"
    w = CaptureWriter(p, meta={}, store="stats")
    _add(w, "m", torch.ones(3))
    w.flush()  # what the recorder does after every step; then the process dies
    w._f.close()
    with pytest.raises(UserError, match="incomplete"):
        open_capture(p)
    with open_capture(p, allow_incomplete=True) as r:
        assert not r.complete and len(r.rows) == 1


def test_exception_inside_writer_leaves_incomplete(tmp_path):
    p = tmp_path / "a.h5"
    with pytest.raises(RuntimeError):
        with CaptureWriter(p, meta={}) as w:
            _add(w, "m", torch.ones(3))
            raise RuntimeError("boom")
    with open_capture(p, allow_incomplete=True) as r:
        assert not r.complete


def test_foreign_and_future_files_are_refused(tmp_path):
    p = tmp_path / "x.h5"
    with h5py.File(p, "w") as f:
        f["a"] = 1
    with pytest.raises(UserError, match="not an accucheck capture"):
        open_capture(p)
    q = tmp_path / "v.h5"
    with CaptureWriter(q, meta={}):
        pass
    with h5py.File(q, "a") as f:
        f.attrs["schema_version"] = SCHEMA_VERSION + 1
    with pytest.raises(UserError, match="HINT: re-run"):
        open_capture(q)
    (tmp_path / "t.h5").write_text("not hdf5")
    with pytest.raises(UserError, match="not a readable HDF5"):
        open_capture(tmp_path / "t.h5")
    with pytest.raises(UserError, match="no such capture"):
        open_capture(tmp_path / "missing.h5")


def test_iter_chunks_bounded_and_complete(tmp_path):
    t = torch.arange(1000, dtype=torch.float32).reshape(100, 10)
    with CaptureWriter(tmp_path / "a.h5", meta={}, store="full") as w:
        _add(w, "m", t)
    with open_capture(tmp_path / "a.h5") as r:
        chunks = list(r.iter_chunks(_key("m"), max_elems=64))
    assert max(c.size for c in chunks) <= 64
    np.testing.assert_array_equal(np.concatenate(chunks), t.numpy().ravel())


def test_iter_chunks_splits_inside_rows(tmp_path):
    t = torch.arange(2 * 3 * 50, dtype=torch.float32).reshape(2, 3, 50)  # [1, T, H]-like rows
    with CaptureWriter(tmp_path / "a.h5", meta={}, store="full") as w:
        _add(w, "m", t)
    with open_capture(tmp_path / "a.h5") as r:
        for cap in (7, 50, 64, 160):
            chunks = list(r.iter_chunks(_key("m"), max_elems=cap))
            assert max(c.size for c in chunks) <= cap
            np.testing.assert_array_equal(np.concatenate(chunks), t.numpy().ravel())


def test_sample_is_taken_at_the_documented_positions(tmp_path):
    from accucheck.store import SAMPLE_SIZE

    t = torch.arange(1000, dtype=torch.bfloat16).reshape(1, 10, 100) / 7
    with CaptureWriter(tmp_path / "a.h5", meta={}, store="stats") as w:
        _add(w, "m", t)
    with open_capture(tmp_path / "a.h5") as r:
        sample = r.row(_key("m")).sample
    pos = (np.arange(SAMPLE_SIZE) * 999) // (SAMPLE_SIZE - 1)
    np.testing.assert_array_equal(sample, t.float().numpy().ravel()[pos])
    assert pos[0] == 0 and pos[-1] == 999


def test_record_key_round_trip():
    for k in (RecordKey(1, 3, "model.layers.10.mlp", 2, "in", "hidden_states"),
              RecordKey(0, 0, "logits", 0, "out", "0"),
              RecordKey(0, 1, "model.layers.0.mlp", 0, "shadow", "0", "aten.mul.Tensor", 7)):
        assert RecordKey.parse(str(k)) == k
    with pytest.raises(UserError):
        RecordKey.parse("layers.0")


def test_add_rows_writes_what_add_writes(tmp_path):
    """CaptureWriter.add_rows (a stats-mode step in one call) stores exactly the rows that one
    `add` per record stores, and refuses what `add` refuses."""
    rng = np.random.default_rng(0)
    keys = [str(RecordKey(0, 0, f"m{i}", 0, "out", "0")) for i in range(300)]  # > one block
    kinds = ["module"] * 299 + ["logits"]
    dtypes = ["float32", "bfloat16"] * 150
    shapes = [torch.Size([1, i % 7 + 1]) if i % 2 else (2, 3) for i in range(300)]
    stats = rng.standard_normal((300, 10 + 64))
    checksums = [int(v) for v in rng.integers(0, 2 ** 52, 300)]
    extras = ["", '{"src":{"0":"m0#0:out.0"}}'] * 150
    for name, how in (("one.h5", "add"), ("rows.h5", "rows")):
        with CaptureWriter(tmp_path / name, meta={}, store="stats") as w:
            if how == "add":
                for i in range(300):
                    w.add(keys[i], kinds[i], dtypes[i], shapes[i], stats[i], checksums[i],
                          extra=extras[i])
            else:
                w.add_rows(keys[:120], kinds[:120], dtypes[:120], shapes[:120], stats[:120],
                           checksums[:120], extras[:120])
                w.flush(force=True)
                w.add_rows(keys[120:], kinds[120:], dtypes[120:], shapes[120:], stats[120:],
                           checksums[120:], extras[120:])
            with pytest.raises(ValueError, match="duplicate record key"):
                w.add_rows([keys[5]], ["module"], ["float32"], [(1,)], stats[:1], [0], [""])
            with pytest.raises(ValueError, match="kind must be"):
                w.add_rows(["x"], ["tensor"], ["float32"], [(1,)], stats[:1], [0], [""])
    with h5py.File(tmp_path / "one.h5") as a, h5py.File(tmp_path / "rows.h5") as b:
        assert sorted(a["index"]) == sorted(b["index"])
        for col in a["index"]:
            x, y = a["index"][col][()], b["index"][col][()]
            if x.dtype == object:
                assert x.tolist() == y.tolist(), col
            else:
                np.testing.assert_array_equal(x, y, err_msg=col)


def test_content_hash_is_positional_shared_and_absent_in_old_files(tmp_path):
    """/index/hash (schema_minor 1): equal for equal bytes, different for a permutation the
    checksum cannot see, shared with the dataset, 0 without a tensor and in older files."""
    from accucheck.store import SCHEMA_MINOR, content_hash

    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    st = np.zeros(10)
    with CaptureWriter(tmp_path / "a.h5", meta={}, store="full") as w:
        w.add(_key("a"), "module", "float32", x.shape, st, 1, x)
        w.add(_key("b"), "module", "float32", x.shape, st, 1, x[::-1].copy())
        w.add(_key("c"), "module", "float32", x.shape, st, 1, x, share="w")
        w.add(_key("d"), "module", "float32", x.shape, st, 1, None, share="w")
        w.add(_key("e"), "module", "float32", x.shape, st, 1, None)
    with open_capture(tmp_path / "a.h5") as r:
        h = {m: r.row(_key(m)).hash for m in "abcde"}
    assert h["a"] == h["c"] == h["d"] == content_hash(x) != 0
    assert h["b"] != h["a"] and h["e"] == 0
    with h5py.File(tmp_path / "a.h5", "a") as f:  # a file written before the column existed
        assert int(f.attrs["schema_minor"]) == SCHEMA_MINOR
        del f["index/hash"]
        del f.attrs["schema_minor"]
    with open_capture(tmp_path / "a.h5") as r:
        assert all(row.hash == 0 for row in r.rows)
