"""Today's capture of the tiny model still matches the committed golden captures (golden/*.h5).

Exact: file format and schema version, meta fields, record keys in execution order, kinds,
dtypes, shapes, prompt and generated token ids, model config / weight hashes. Within the float32
tolerance of the diff library (rel_l2 5e-5 per record, see compare.tolerances): the values,
because CPU kernels may sum float32 in another order on another machine. A failure names the
command that regenerates the files (golden/make_golden.py), to run only when the change is
intended.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import h5py
import numpy as np
import pytest

from accucheck import store
from accucheck.compare.diff import diff_captures
from accucheck.errors import UserError
from accucheck.store import open_capture

ROOT = Path(__file__).resolve().parents[1]
GOLDEN_DIR = ROOT / "golden"


def _make_golden():
    spec = importlib.util.spec_from_file_location("make_golden", GOLDEN_DIR / "make_golden.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


MG = _make_golden()
HINT = (f"if this change of accucheck (or torch / transformers) is intended, regenerate with "
        f"`{MG.REGENERATE}` and commit golden/*.h5 with it")


def test_golden_files_are_small_and_present():
    sizes = {n: (GOLDEN_DIR / n).stat().st_size for n in MG.GOLDEN}
    assert sum(sizes.values()) < MG.MAX_BYTES, sizes


@pytest.fixture(scope="module")
def today(tiny, tmp_path_factory):
    """The golden captures made again now, with the same options."""
    model, tok = tiny
    d = tmp_path_factory.mktemp("golden-today")
    return {name: MG.capture(model, tok, name, d / name) for name in MG.GOLDEN}


@pytest.mark.parametrize("name", list(MG.GOLDEN))
def test_schema_matches_golden(name):
    path = GOLDEN_DIR / name
    with h5py.File(path, "r") as f:
        fmt, ver = f.attrs.get("format"), int(f.attrs.get("schema_version", -1))
        assert fmt == store.FORMAT and ver == store.SCHEMA_VERSION, (
            f"{path}: format {fmt!r} v{ver}, accucheck writes {store.FORMAT!r} "
            f"v{store.SCHEMA_VERSION}: {HINT}")
        assert bool(f.attrs["complete"])
        required = set(store._INDEX_COLUMNS) | {"stats"}
        # optional columns (accucheck.store): extra, and sample (stats-mode values, not a string column)
        optional = set(store._OPTIONAL_COLUMNS) | {"sample", "sketch"}
        have = set(f["index"])
        assert required <= have <= required | optional, (
            f"{path}: index columns {sorted(have)}, accucheck expects {sorted(required)} "
            f"(+ optional {sorted(optional)}): {HINT}")
        assert f["index/stats"].shape[1] == len(store.STAT_FIELDS), HINT
    try:
        with open_capture(path) as r:
            meta = r.meta
    except UserError as e:
        pytest.fail(f"{e}: {HINT}")
    for k in ("tool", "device", "dtype", "mode", "runner", "seed", "environment", "model",
              "options", "store"):
        assert k in meta, f"{path}: meta has no {k!r}: {HINT}"
    prompts, store_mode, steps = MG.GOLDEN[name]
    assert (meta["device"], meta["dtype"], meta["mode"], meta["store"]) == (
        "cpu", "float32", "eager", store_mode)


@pytest.mark.parametrize("name", list(MG.GOLDEN))
def test_todays_capture_matches_golden(name, today):
    gpath, tpath = GOLDEN_DIR / name, today[name]
    with open_capture(gpath) as g, open_capture(tpath) as t:
        gm, tm = g.meta, t.meta
        assert gm["model"]["config_hash"] == tm["model"]["config_hash"], (
            f"the tiny model's config changed: {HINT}")
        assert gm["model"]["weight_hash"] == tm["model"]["weight_hash"], (
            f"the tiny model's weights changed (torch / transformers initialize it "
            f"differently?): {HINT}")
        gkeys, tkeys = [str(r.key) for r in g.rows], [str(r.key) for r in t.rows]
        if gkeys != tkeys:
            extra, gone = sorted(set(tkeys) - set(gkeys)), sorted(set(gkeys) - set(tkeys))
            pytest.fail(f"record keys changed ({len(gkeys)} golden, {len(tkeys)} now; new "
                        f"{extra[:3]}, gone {gone[:3]}, or another order): {HINT}")
        for gr in g.rows:
            tr = t.row(gr.key)
            assert (gr.kind, gr.dtype, gr.shape, gr.has_data) == \
                (tr.kind, tr.dtype, tr.shape, tr.has_data), f"{gr.key}: {HINT}"
        assert len(g.requests) == len(t.requests)
        for i, (a, b) in enumerate(zip(g.requests, t.requests)):
            assert a.prompt == b.prompt
            assert np.array_equal(a.prompt_ids, b.prompt_ids), f"request {i} prompt ids: {HINT}"
            assert np.array_equal(a.generated_ids, b.generated_ids), (
                f"request {i} generated {list(b.generated_ids)}, golden "
                f"{list(a.generated_ids)}: {HINT}")
        assert json.dumps(gm["options"], sort_keys=True) == \
            json.dumps(tm["options"], sort_keys=True), f"capture options changed: {HINT}"
    # numerics: the diff library with its float32 tolerance
    d = diff_captures(gpath, tpath)
    assert not d.missing
    if not d.within:
        worst = max(d.records, key=lambda r: r.error / max(r.tolerance.rel_l2, 1e-300))
        pytest.fail(f"{len(d.failed)} of {len(d.records)} records differ from {gpath.name} "
                    f"beyond the float32 tolerance; worst {worst.key}: rel_l2 {worst.error:.3g} "
                    f"(tolerance {worst.tolerance.rel_l2:g}): {HINT}")
    if MG.GOLDEN[name][1] == "full":
        assert d.basis == "tensor" and d.logits  # exact metrics and logits were compared
