"""msprobe (MindStudio Probe) dumps read as accucheck captures (accucheck.importers.msprobe).

Quick tests use small dumps written here in msprobe's documented format (dump.json,
construct.json, stack.json, dump_tensor_data/); the slow ones dump the tiny Llama with msprobe's
own PyTorch dumper on the CPU (bench/bench_msprobe.py `dump`, in a child process: msprobe
patches torch process-wide) in statistics and tensor mode, L0 and mix, and diff the imports.
"""
from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from accucheck.errors import UserError
from accucheck.importers.msprobe import call_site, find_dumps, import_msprobe, stats_row
from accucheck.store import open_capture

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "bench_msprobe.py"
NORM = "model.layers.1.post_attention_layernorm"


# ----------------------------------------------------------------------------- a small dump

def t(shape, mx=1.0, mn=-1.0, mean=0.0, norm=2.0, dtype="torch.float32", grad=False, **kw):
    d = {"type": "torch.Tensor", "dtype": dtype, "shape": list(shape), "Max": mx, "Min": mn,
         "Mean": mean, "Norm": norm, "requires_grad": grad}
    d.update(kw)
    return d


IDS = t([1, 3], 7, 2, None, None, dtype="torch.int64")
W_EMB = t([16, 8], 0.3, -0.3, 0.0, 4.0, grad=True)
W_NORM = t([8], 1.0, 1.0, 1.0, 2.8284, grad=True)
H0 = t([1, 3, 8], 0.2, -0.2, 0.01, 1.0)
N0 = t([1, 3, 8], 2.0, -2.0, 0.02, 4.9)
H1 = t([1, 3, 8], 2.1, -2.1, 0.03, 5.0)
LOGITS = t([1, 3, 16], 5.0, -5.0, 0.1, 20.0)
COS, SIN = t([1, 3, 4], 1.0, 0.5, 0.9, 3.3), t([1, 3, 4], 0.8, 0.0, 0.2, 1.1)
FRAME = ("File /usr/lib/python3/site-packages/transformers/models/llama/modeling_llama.py, "
         "line {}, in forward, \n x = y")
TORCH_FRAME = ("File /usr/lib/python3/site-packages/torch/nn/modules/module.py, line 1778, in "
               "_wrapped_call_impl, \n return self._call_impl(*args, **kwargs)")
L0 = "Module.model.layers.0.LlamaDecoderLayer.forward.0"
NORM0 = "Module.model.layers.0.input_layernorm.LlamaRMSNorm.forward.0"


def small_dump(task: str = "statistics"):
    """(dump.json data, construct.json, stack.json) of one forward of a one-layer Llama, in
    msprobe's mix-level format: APIs before the module they run in, modules when they end."""
    data = {
        "Functional.embedding.0.forward": {"input_args": [IDS, W_EMB, None, {"type": "float",
                                                                             "value": 2.0}],
                                           "input_kwargs": {}, "output": [H0]},
        "Module.model.embed_tokens.Embedding.forward.0": {
            "input_args": [IDS], "input_kwargs": {}, "output": [H0],
            "parameters": {"weight": W_EMB}},
        "Tensor.pow.0.forward": {"input_args": [H0, {"type": "int", "value": 2}],
                                 "input_kwargs": {}, "output": [t([1, 3, 8], 0.04, 0, 0.001, 0.1)]},
        "Torch.rsqrt.0.forward": {"input_args": [t([1, 3, 1], 9, 8, 8.5, 14.0)],
                                  "input_kwargs": {}, "output": [t([1, 3, 1], 0.3, 0.2, 0.25, 0.4)]},
        "Tensor.__mul__.0.forward": {"input_args": [H0, t([1, 3, 1], 0.3, 0.2, 0.25, 0.4)],
                                     "input_kwargs": {}, "output": [N0]},
        "Tensor.__mul__.1.forward": {"input_args": [W_NORM, N0], "input_kwargs": {},
                                     "output": [N0]},
        NORM0: {"input_args": [H0], "input_kwargs": {}, "output": [N0],
                "parameters": {"weight": W_NORM}},
        "Tensor.__add__.0.forward": {"input_args": [H0, N0], "input_kwargs": {},
                                     "output": [H1]},
        L0: {"input_args": [H0], "input_kwargs": {
                 "position_embeddings": [COS, SIN], "use_cache": {"type": "bool", "value": True},
                 "past_key_values": None},
             "output": [H1], "parameters": {}},
        "Module.model.layers.0.LlamaDecoderLayer.backward.0": {"input": [H1], "output": [H0]},
        "Module.model.LlamaModel.forward.0": {
            "input_args": [], "input_kwargs": {"input_ids": IDS},
            "output": [{"last_hidden_state": H1, "past_key_values": None}], "parameters": {}},
        "Functional.linear.0.forward": {"input_args": [H1, t([16, 8], 0.5, -0.5, 0, 3, grad=True)],
                                        "input_kwargs": {}, "output": [LOGITS]},
        "Module.lm_head.Linear.forward.0": {
            "input_args": [H1], "input_kwargs": {}, "output": [LOGITS],
            "parameters": {"weight": t([16, 8], 0.5, -0.5, 0, 3, grad=True)}},
        "Tensor.__getitem__.0.forward": {"input_args": [LOGITS], "input_kwargs": {},
                                         "output": [t([1, 1, 16], 5.0, -5.0, 0.1, 11.0)]},
    }
    construct = {
        "Functional.embedding.0.forward": "Module.model.embed_tokens.Embedding.forward.0",
        "Module.model.LlamaModel.forward.0": None,
        "Module.model.embed_tokens.Embedding.forward.0": "Module.model.LlamaModel.forward.0",
        L0: "Module.model.LlamaModel.forward.0",
        NORM0: L0,
        "Tensor.pow.0.forward": NORM0, "Torch.rsqrt.0.forward": NORM0,
        "Tensor.__mul__.0.forward": NORM0, "Tensor.__mul__.1.forward": NORM0,
        "Tensor.__add__.0.forward": L0,
        "Module.lm_head.Linear.forward.0": None,
        "Functional.linear.0.forward": "Module.lm_head.Linear.forward.0",
        "Tensor.__getitem__.0.forward": None,
    }
    stack = {
        "0": [["Tensor.pow.0.forward", "Torch.rsqrt.0.forward"], [TORCH_FRAME, FRAME.format(64)]],
        "1": [["Tensor.__add__.0.forward"], [FRAME.format(301), TORCH_FRAME]],
    }
    return {"task": task, "level": "mix", "framework": "pytorch", "dump_data_dir": None,
            "data": data}, construct, stack


def write_dump(d: Path, dump=None, construct=None, stack=None) -> Path:
    if dump is None:
        dump, construct, stack = small_dump()
    d.mkdir(parents=True, exist_ok=True)
    (d / "dump.json").write_text(json.dumps(dump, indent=1))
    if construct is not None:
        (d / "construct.json").write_text(json.dumps(construct))
    if stack is not None:
        (d / "stack.json").write_text(json.dumps(stack))
    return d


def keys(path) -> list[str]:
    with open_capture(path) as r:
        return [str(x.key) for x in r.rows]


# ----------------------------------------------------------------------------- quick tests

EXPECTED_KEYS = [
    "r0.s0:model#0:in.input_ids",
    "r0.s0:model.embed_tokens#0:in.0",
    "r0.s0:model.embed_tokens#0/Functional.embedding@0:in.0",
    "r0.s0:model.embed_tokens#0/Functional.embedding@0:out.0",
    "r0.s0:model.embed_tokens#0:out.0",
    "r0.s0:model.layers.0#0:in.0",
    "r0.s0:model.layers.0#0:in.position_embeddings.0",
    "r0.s0:model.layers.0#0:in.position_embeddings.1",
    "r0.s0:model.layers.0.input_layernorm#0:in.0",
    "r0.s0:model.layers.0.input_layernorm#0/Tensor.pow@0:in.0",
    "r0.s0:model.layers.0.input_layernorm#0/Tensor.pow@0:out.0",
    "r0.s0:model.layers.0.input_layernorm#0/Torch.rsqrt@1:in.0",
    "r0.s0:model.layers.0.input_layernorm#0/Torch.rsqrt@1:out.0",
    "r0.s0:model.layers.0.input_layernorm#0/Tensor.__mul__@2:in.0",
    "r0.s0:model.layers.0.input_layernorm#0/Tensor.__mul__@2:in.1",
    "r0.s0:model.layers.0.input_layernorm#0/Tensor.__mul__@2:out.0",
    "r0.s0:model.layers.0.input_layernorm#0/Tensor.__mul__@3:in.1",
    "r0.s0:model.layers.0.input_layernorm#0/Tensor.__mul__@3:out.0",
    "r0.s0:model.layers.0.input_layernorm#0:out.0",
    "r0.s0:model.layers.0#0/Tensor.__add__@0:in.0",
    "r0.s0:model.layers.0#0/Tensor.__add__@0:in.1",
    "r0.s0:model.layers.0#0/Tensor.__add__@0:out.0",
    "r0.s0:model.layers.0#0:out.0",
    "r0.s0:model#0:out.0.last_hidden_state",
    "r0.s0:lm_head#0/Functional.linear@0:in.0",
    "r0.s0:lm_head#0/Functional.linear@0:out.0",
    "r0.s0:logits#0:out.0",
    "r0.s0:<top>#0/Tensor.__getitem__@0:in.0",
    "r0.s0:<top>#0/Tensor.__getitem__@0:out.0",
]


def test_names_roles_slots_op_index_and_order(tmp_path):
    """Module / API names -> keys: path and call index, role and slot from the argument
    position, ops under their construct.json module call with an index counted inside it,
    weights (parameters, and the API inputs that are those parameters) and backward entries
    skipped, lm_head's output as the logits record, execution order (inputs first)."""
    write_dump(tmp_path / "dump")
    res = import_msprobe(tmp_path / "dump", tmp_path / "run.h5")
    assert keys(tmp_path / "run.h5") == EXPECTED_KEYS
    assert res.records == len(EXPECTED_KEYS) and res.store == "stats" and res.steps == (0,)
    skipped = dict(res.skipped)
    assert skipped["weights (parameters)"] == 3
    assert skipped["weight inputs of APIs"] == 3   # embedding, norm and lm_head weights
    assert skipped["backward entries"] == 1
    assert skipped["head inputs"] == 1
    with open_capture(tmp_path / "run.h5") as r:
        assert r.meta["runner"] == "msprobe-import" and r.meta["dtype"] == "float32"
        assert r.meta["tool"] == "accucheck" and r.meta["time"].endswith("+00:00")
        assert r.meta["store"] == "stats"
        m = r.meta["msprobe"]
        assert m["task"] == "statistics" and m["level"] == "mix" and m["records"] == res.records
        assert any(n.startswith("requests: not mapped") for n in m["notes"])
        assert r.requests == []
        kinds = {str(x.key): x.kind for x in r.rows}
        assert kinds["r0.s0:logits#0:out.0"] == "logits"
        assert kinds["r0.s0:model.layers.0#0/Tensor.__add__@0:out.0"] == "op"
        row = r.row("r0.s0:model.layers.0.input_layernorm#0:out.0")
        assert row.dtype == "float32" and row.shape == (1, 3, 8) and not row.has_data
        s = row.stats
        assert (s.min, s.max, s.mean, s.l2, s.absmax, s.numel) == (-2.0, 2.0, 0.02, 4.9, 2.0, 24)
        assert np.isnan(s.std) and s.nan == 0 and s.inf == 0
        ids = r.row("r0.s0:model#0:in.input_ids")
        assert ids.dtype == "int64" and np.isnan(ids.stats.mean)
        site = json.loads(r.row("r0.s0:model.layers.0.input_layernorm#0/Torch.rsqrt@1:out.0")
                          .extra)["site"]
        assert site == "transformers/models/llama/modeling_llama.py:64 in forward"
        assert json.loads(r.row("r0.s0:model.layers.0#0/Tensor.__add__@0:out.0").extra) == \
            {"site": "transformers/models/llama/modeling_llama.py:301 in forward"}


def test_call_site_skips_torch_and_msprobe_frames():
    frames = ["File /x/site-packages/msprobe/pytorch/hook.py, line 9, in wrap, \n f()",
              TORCH_FRAME, FRAME.format(77)]
    assert call_site(frames) == "transformers/models/llama/modeling_llama.py:77 in forward"
    assert call_site([TORCH_FRAME]) == "torch/nn/modules/module.py:1778 in _wrapped_call_impl"
    assert call_site(["File /home/me/run.py, line 3, in <module>, \n main()"]) == \
        "home/me/run.py:3 in <module>"
    assert call_site([]) == ""


def test_statistics_rows():
    row, ck = stats_row(t([2, 3], 4.0, -5.0, 0.5, 7.0), (2, 3))
    assert list(row[[0, 1, 2, 4, 5, 6, 7, 8, 9]]) == [-5.0, 4.0, 0.5, 5.0, 7.0, 0, 0, 0, 6]
    assert np.isnan(row[3]) and ck == 0
    row, _ = stats_row(t([4], float("nan"), float("nan"), float("nan"), float("nan")), (4,))
    assert row[6] == 1 and row[7] == 0           # at least one NaN
    row, _ = stats_row(t([4], "inf", -1.0, "inf", "inf"), (4,))
    assert row[7] == 1 and row[1] == np.inf
    row, _ = stats_row(t([4], 60000.0, -1.0, 1.0, "inf", dtype="torch.float16"), (4,))
    assert row[7] == 0 and np.isnan(row[5])      # a float16 norm that overflowed: unknown
    _, ck = stats_row(t([4], md5="00abcdef"), (4,))
    assert ck == 0xabcdef
    _, ck = stats_row({"type": "torch.Tensor", "dtype": "torch.float32", "shape": [4],
                       "md5": 12345}, (4,))           # xor mode: a checksum, no statistics
    assert ck == 12345
    row, _ = stats_row({"type": "torch.Tensor", "dtype": "torch.bool", "shape": [3],
                        "Max": True, "Min": False}, (3,))
    assert (row[0], row[1]) == (0.0, 1.0)


def test_steps_and_ranks(tmp_path):
    """step{N}/rank{R} -> step N of rank R; one rank per capture, the others named in meta."""
    root = tmp_path / "dump"
    for s in (0, 1):
        for rk in (0, 1):
            write_dump(root / f"step{s}" / f"rank{rk}", *small_dump())
    dirs = find_dumps(root)
    assert [(d.step, d.rank) for d in dirs] == [(0, "rank0"), (0, "rank1"), (1, "rank0"),
                                                (1, "rank1")]
    res = import_msprobe(root, tmp_path / "r0.h5")
    assert res.rank == "rank0" and res.steps == (0, 1)
    ks = keys(tmp_path / "r0.h5")
    assert ks[:len(EXPECTED_KEYS)] == EXPECTED_KEYS
    assert ks[len(EXPECTED_KEYS):] == [k.replace("r0.s0:", "r0.s1:") for k in EXPECTED_KEYS]
    with open_capture(tmp_path / "r0.h5") as r:
        assert r.meta["msprobe"]["ranks_found"] == ["rank0", "rank1"]
        assert any("not imported: rank1" in n for n in r.meta["msprobe"]["notes"])
    res = import_msprobe(root, tmp_path / "r1.h5", rank=1, steps=[1])
    assert res.rank == "rank1" and res.steps == (1,)
    assert import_msprobe(root / "step1" / "rank1" / "dump.json", tmp_path / "one.h5").steps \
        == (1,)
    with pytest.raises(UserError, match="no rank7 folder"):
        import_msprobe(root, tmp_path / "x.h5", rank=7)
    with pytest.raises(UserError, match="no step5 folder"):
        import_msprobe(root, tmp_path / "x.h5", steps=[5])
    proc = tmp_path / "proc"
    write_dump(proc / "step3" / "proc4242", *small_dump())
    res = import_msprobe(proc, tmp_path / "p.h5")
    assert res.rank == "proc4242" and res.steps == (3,)


def test_npu_aten_distributed_apis_and_the_older_stack_layout(tmp_path):
    """NPU.* (a tuple output), Aten.* (an overload in the name), Distributed.* (no tensor
    output) APIs under one module call; stack.json as {name: [frames]} (older msprobe)."""
    mod = "Module.model.norm.RMSNorm.forward.0"
    data = {
        "NPU.npu_rms_norm.0.forward": {"input_args": [H0, W_NORM], "input_kwargs": {
            "epsilon": {"type": "float", "value": 1e-6}}, "output": [N0, t([1, 3, 1])]},
        "Aten.mul.Tensor.0.forward": {"input_args": [N0, N0], "input_kwargs": {},
                                      "output": [H1]},
        "Distributed.all_reduce.0.forward": {"input_args": [H1], "input_kwargs": {},
                                             "output": [None]},
        mod: {"input_args": [H0], "input_kwargs": {}, "output": [H1],
              "parameters": {"weight": W_NORM}},
    }
    construct = {k: mod for k in data if k != mod}
    construct[mod] = None
    stack = {"Aten.mul.Tensor.0.forward": [FRAME.format(9)]}
    write_dump(tmp_path / "d", {"task": "statistics", "level": "mix", "data": data}, construct,
               stack)
    res = import_msprobe(tmp_path / "d", tmp_path / "n.h5")
    assert keys(res.path) == [
        "r0.s0:model.norm#0:in.0",
        "r0.s0:model.norm#0/NPU.npu_rms_norm@0:in.0",
        "r0.s0:model.norm#0/NPU.npu_rms_norm@0:out.0",
        "r0.s0:model.norm#0/NPU.npu_rms_norm@0:out.1",
        "r0.s0:model.norm#0/Aten.mul.Tensor@1:in.0",
        "r0.s0:model.norm#0/Aten.mul.Tensor@1:in.1",
        "r0.s0:model.norm#0/Aten.mul.Tensor@1:out.0",
        "r0.s0:model.norm#0/Distributed.all_reduce@2:in.0",
        "r0.s0:model.norm#0:out.0",
    ]
    assert dict(res.skipped)["APIs without a tensor output"] == 1
    with open_capture(res.path) as r:
        assert json.loads(r.row("r0.s0:model.norm#0/Aten.mul.Tensor@1:out.0").extra)["site"] \
            == "transformers/models/llama/modeling_llama.py:9 in forward"


def test_output_is_never_overwritten_or_deleted_without_force(tmp_path):
    write_dump(tmp_path / "d")
    out = tmp_path / "run.h5"
    out.write_bytes(b"keep me")
    with pytest.raises(UserError, match="--force"):
        import_msprobe(tmp_path / "d", out)
    assert out.read_bytes() == b"keep me"
    assert import_msprobe(tmp_path / "d", out, force=True).records == len(EXPECTED_KEYS)


def test_checksum_only_dump_is_refused(tmp_path):
    dump, construct, stack = small_dump()

    def strip(obj):
        if isinstance(obj, dict):
            if obj.get("type") == "torch.Tensor":
                return {k: v for k, v in obj.items() if k not in ("Max", "Min", "Mean", "Norm")}
            return {k: strip(v) for k, v in obj.items()}
        return [strip(v) for v in obj] if isinstance(obj, list) else obj
    write_dump(tmp_path / "x", strip(dump), construct, stack)
    with pytest.raises(UserError, match="checksums only"):
        import_msprobe(tmp_path / "x", tmp_path / "x.h5")
    assert not (tmp_path / "x.h5").exists()


def test_l1_dump_without_construct_puts_apis_under_top(tmp_path):
    dump, _, _ = small_dump()
    dump["level"] = "L1"
    dump["data"] = {k: v for k, v in dump["data"].items() if not k.startswith("Module.")}
    write_dump(tmp_path / "d", dump, {}, None)
    ks = keys(import_msprobe(tmp_path / "d", tmp_path / "l1.h5").path)
    assert ks[:3] == ["r0.s0:<top>#0/Functional.embedding@0:in.0",
                      "r0.s0:<top>#0/Functional.embedding@0:in.1",  # no module: no weight known
                      "r0.s0:<top>#0/Functional.embedding@0:out.0"]
    assert ks[-1] == "r0.s0:<top>#0/Tensor.__getitem__@7:out.0"


def test_identical_and_changed_small_dumps_through_diff(tmp_path):
    from accucheck.verdict.locate import analyze

    write_dump(tmp_path / "a")
    write_dump(tmp_path / "b")
    dump, construct, stack = small_dump()
    bad = dict(N0, Norm=6.0, Max=2.5)  # the norm's last op and output changed
    dump["data"]["Tensor.__mul__.1.forward"]["output"] = [bad]
    dump["data"][NORM0]["output"] = [bad]
    write_dump(tmp_path / "c", dump, construct, stack)
    ra, rb, rc = (import_msprobe(tmp_path / x, tmp_path / f"{x}.h5").path for x in "abc")
    assert analyze(ra, rb).exit_code == 0
    an = analyze(ra, rc)
    assert an.exit_code == 1
    fd = an.location.first_divergence
    assert fd.key.module == "model.layers.0.input_layernorm"
    assert fd.key.op == "Tensor.__mul__" and fd.key.op_index == 3
    assert an.diff.record(fd.key).basis == "stats"


def _cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "accucheck", *map(str, args)],
                          capture_output=True, text=True, cwd=cwd, timeout=300)


def _one_line_exit_3(p):
    assert p.returncode == 3, (p.returncode, p.stdout, p.stderr)
    assert "Traceback" not in p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("accucheck: error:")]
    assert len(lines) == 1, p.stderr
    assert not [ln for ln in p.stderr.splitlines() if ln and not ln.startswith(
        ("accucheck: error:", "import:", "msprobe dump", "diff "))], p.stderr
    return lines[0]


def test_malformed_and_truncated_dumps_exit_3_in_one_line(tmp_path):
    good = write_dump(tmp_path / "good")
    text = (good / "dump.json").read_text()
    cut = write_dump(tmp_path / "cut")
    (cut / "dump.json").write_text(text[: len(text) // 2])
    msg = _one_line_exit_3(_cli("import", "msprobe", cut, "-o", tmp_path / "x.h5"))
    assert "invalid JSON" in msg and "truncated" in msg
    assert not (tmp_path / "x.h5").exists()
    # the same through `accucheck diff DIR DIR`
    msg = _one_line_exit_3(_cli("diff", good, cut))
    assert "dump.json" in msg and "truncated" in msg
    dump, construct, stack = small_dump()
    dump["data"][NORM0]["output"][0] = dict(N0, shape=[1, "x"])
    _one_line_exit_3(_cli("import", "msprobe", write_dump(tmp_path / "shape", dump, construct,
                                                          stack), "-o", tmp_path / "y.h5"))
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "not an msprobe dump" in _one_line_exit_3(_cli("diff", empty, good))
    (tmp_path / "nodata").mkdir()
    (tmp_path / "nodata" / "dump.json").write_text('{"task": "statistics"}')
    assert "no \"data\"" in _one_line_exit_3(_cli("import", "msprobe", tmp_path / "nodata",
                                                  "-o", tmp_path / "z.h5"))


def test_import_and_diff_do_not_import_torch_for_statistics_dumps(tmp_path):
    """`accucheck diff DIR DIR` on statistics dumps: no torch, no msprobe, and the temporary
    captures are removed afterwards."""
    write_dump(tmp_path / "a")
    write_dump(tmp_path / "b")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    code = ("import sys; from accucheck.cli import main\n"
            "try:\n    main(['diff', sys.argv[1], sys.argv[2]])\n"
            "except SystemExit as e:\n    code = e.code\n"
            "print(code, 'torch' in sys.modules, any(m.startswith('msprobe') for m in "
            "sys.modules))")
    p = subprocess.run([sys.executable, "-c", code, str(tmp_path / "a"), str(tmp_path / "b")],
                       capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, TMPDIR=str(tmp)))
    assert p.stdout.strip().splitlines()[-1] == "0 False False", p.stderr
    assert "temporary capture" in p.stderr
    assert list(tmp.iterdir()) == []


# ----------------------------------------------------------------------------- tensor mode

def test_tensor_mode_reads_only_plain_tensors(tmp_path):
    """Tensor files are read with torch.load(weights_only=True) only: the values land in the
    capture bit-exact (bfloat16 too), with accucheck's own statistics; a pickle holding
    anything but tensors, a truncated file or a missing one is refused (exit 3, one line)."""
    torch = pytest.importorskip("torch")
    d = tmp_path / "t"
    (d / "dump_tensor_data").mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, generator=g)
    y = torch.randn(2, 5, generator=g).to(torch.bfloat16)
    data = {}
    for name, ten in (("Module.a.Linear.forward.0.input.0.pt", x),
                      ("Module.a.Linear.forward.0.output.0.pt", y)):
        torch.save(ten, d / "dump_tensor_data" / name)
    np.save(d / "dump_tensor_data" / "Module.b.Act.forward.0.output.0.npy",
            np.arange(6, dtype=np.float32).reshape(2, 3))
    data["Module.a.Linear.forward.0"] = {
        "input_args": [t([2, 5], data_name="Module.a.Linear.forward.0.input.0.pt")],
        "input_kwargs": {},
        "output": [t([2, 5], dtype="torch.bfloat16",
                     data_name="Module.a.Linear.forward.0.output.0.pt")]}
    data["Module.b.Act.forward.0"] = {
        "input_args": [], "input_kwargs": {},
        "output": [t([2, 3], data_name="Module.b.Act.forward.0.output.0.npy")]}
    dump = {"task": "tensor", "level": "L0", "framework": "pytorch", "data": data}
    write_dump(d, dump, {}, {})
    res = import_msprobe(d, tmp_path / "full.h5")
    assert res.store == "full" and res.dtype in ("float32", "bfloat16")
    with open_capture(tmp_path / "full.h5") as r:
        assert np.array_equal(r.read("r0.s0:a#0:in.0"), x.numpy())
        assert np.array_equal(r.read("r0.s0:a#0:out.0"), y.float().numpy())
        row = r.row("r0.s0:a#0:in.0")
        assert row.stats.std == pytest.approx(float(x.double().std()), rel=1e-6)
        assert row.sample is not None
        assert np.array_equal(r.read("r0.s0:b#0:out.0"), np.arange(6.0).reshape(2, 3))
    # --store stats on a tensor dump: msprobe's statistics, no tensor file read
    assert import_msprobe(d, tmp_path / "st.h5", store="stats").store == "stats"

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned > " + str(tmp_path / "pwned"),))

    out = d / "dump_tensor_data" / "Module.a.Linear.forward.0.input.0.pt"
    out.write_bytes(pickle.dumps(Evil()))
    msg = _one_line_exit_3(_cli("import", "msprobe", d, "-o", tmp_path / "evil.h5"))
    assert "weights_only=True" in msg and not (tmp_path / "pwned").exists()
    assert "unsupported" in msg.lower()  # torch's reason ("Unsupported operand 149", ...)
    assert "weights_only=False" not in msg   # never the advice to unpickle it anyway
    torch.save(x, out)
    out.write_bytes(out.read_bytes()[:100])
    with pytest.raises(UserError, match="weights_only=True"):
        import_msprobe(d, tmp_path / "trunc.h5")
    assert not (tmp_path / "trunc.h5").exists()  # no half-written capture left behind
    before = (tmp_path / "full.h5").read_bytes()
    with pytest.raises(UserError, match="weights_only=True"):
        import_msprobe(d, tmp_path / "full.h5", force=True)
    assert (tmp_path / "full.h5").read_bytes() == before  # a failed --force keeps the old one
    torch.save(torch.zeros(3, 3), out)
    with pytest.raises(UserError, match="dump.json says float32 \\[2, 5\\]"):
        import_msprobe(d, tmp_path / "shape.h5")
    out.unlink()
    with pytest.raises(UserError, match="tensor file missing"):
        import_msprobe(d, tmp_path / "miss.h5")
    data["Module.a.Linear.forward.0"]["input_args"][0]["data_name"] = "../../etc/passwd"
    write_dump(d, dump, {}, {})
    with pytest.raises(UserError, match="not a plain file name"):
        import_msprobe(d, tmp_path / "path.h5")


# ----------------------------------------------------------------------------- msprobe's dumper

def _bench():
    sys.path.insert(0, str(BENCH.parent))
    try:
        import bench_msprobe
    finally:
        sys.path.remove(str(BENCH.parent))
    return bench_msprobe


def _dump(tmp_path_factory, name, task, level, variants, tiny_dir, steps=1):
    pytest.importorskip("msprobe")
    out = tmp_path_factory.mktemp(name)
    _bench().dump_in_subprocess(out, task=task, level=level, variants=variants,
                                     steps=steps, model_dir=str(tiny_dir))
    return out


@pytest.fixture(scope="module")
def stats_mix(tmp_path_factory, tiny_dir):
    """msprobe statistics dumps, mix level, prefill + one decode step."""
    return _dump(tmp_path_factory, "stats_mix", "statistics", "mix",
                 ("ref", "same", "fault", "fused", "bf16"), tiny_dir, steps=2)


@pytest.fixture(scope="module")
def tensor_mix(tmp_path_factory, tiny_dir):
    return _dump(tmp_path_factory, "tensor_mix", "tensor", "mix", ("ref", "same", "fault",
                                                                   "fused"), tiny_dir)


@pytest.fixture(scope="module")
def stats_l0(tmp_path_factory, tiny_dir):
    return _dump(tmp_path_factory, "stats_l0", "statistics", "L0", ("ref", "same", "fault"),
                 tiny_dir)


@pytest.fixture(scope="module")
def tensor_l0(tmp_path_factory, tiny_dir):
    return _dump(tmp_path_factory, "tensor_l0", "tensor", "L0", ("ref", "same", "fault"),
                 tiny_dir)


DUMPS = ["stats_mix", "tensor_mix", "stats_l0", "tensor_l0"]


def _imports(request, dumps, tmp_path, *variants):
    root = request.getfixturevalue(dumps)
    return [import_msprobe(root / v, tmp_path / f"{v}.h5") for v in variants]


@pytest.mark.slow
@pytest.mark.parametrize("dumps", DUMPS)
def test_msprobe_identical_runs_pass(request, dumps, tmp_path):
    from accucheck.verdict.locate import analyze

    ref, same = _imports(request, dumps, tmp_path, "ref", "same")
    assert ref.store == ("full" if dumps.startswith("tensor") else "stats")
    assert ref.dtype == "float32" and ref.records == same.records > 50
    an = analyze(ref.path, same.path)
    assert an.exit_code == 0 and an.verdict == "pass" and an.culprit is None
    assert an.diff.basis == ("tensor" if dumps.startswith("tensor") else "stats")
    if dumps == "stats_mix":
        assert ref.steps == (0, 1)
        ks = keys(ref.path)
        assert "r0.s1:logits#0:out.0" in ks
        assert any("/Functional.linear@0:out.0" in k for k in ks)
    if dumps.endswith("l0"):
        assert not any("/" in k.split(":", 1)[1] for k in keys(ref.path))


@pytest.mark.slow
@pytest.mark.parametrize("dumps", DUMPS)
def test_msprobe_planted_fault_names_the_module(request, dumps, tmp_path):
    from accucheck.verdict.locate import analyze

    ref, fault = _imports(request, dumps, tmp_path, "ref", "fault")
    an = analyze(ref.path, fault.path)
    assert an.exit_code == 1
    fd = an.location.first_divergence
    assert fd.key.module == NORM and fd.key.op is None and fd.key.step == 0
    assert fd.cause == "introduced"
    assert an.culprit.where == f"{NORM}#0"


@pytest.mark.slow
@pytest.mark.parametrize("dumps", ["stats_mix", "tensor_mix"])
def test_msprobe_fused_norm_no_error_rows_where_msprobe_compare_reports_many(
        request, dumps, tmp_path):
    """Every RMSNorm as one F.rms_norm call (no API msprobe hooks): msprobe compare pairs ops by
    their global per-API counter and reports error rows; accucheck aligns ops inside each module
    call and finds none."""
    from accucheck.verdict.locate import analyze

    ref, fused = _imports(request, dumps, tmp_path, "ref", "fused")
    an = analyze(ref.path, fused.path)
    assert an.exit_code == 0 and not an.diff.failed
    assert an.diff.ops is not None and len(an.diff.ops.one_sided) >= 6 * 9  # 9 norms x 6 ops
    root = request.getfixturevalue(dumps)
    n_err = msprobe_compare_errors(root / "ref" / "step0", root / "fused" / "step0",
                                   tmp_path / "cmp")
    assert n_err >= 20, n_err


def msprobe_compare_errors(golden: Path, target: Path, out: Path) -> int:
    """`msprobe compare` (its CLI) on the two step folders' dump.json: its "error" rows."""
    return _bench().msprobe_compare(golden, target, out).errors


@pytest.mark.slow
def test_msprobe_bf16_run_sets_the_meta_dtype(request, tmp_path):
    ref, bf = _imports(request, "stats_mix", tmp_path, "ref", "bf16")
    assert bf.dtype == "bfloat16"
    from accucheck.verdict.locate import analyze

    an = analyze(ref.path, bf.path)
    assert an.diff.compute_dtypes == ("float32", "bfloat16")
    assert {r.tolerance.rel_l2 for r in an.diff.records if r.ref_dtype == "float32"} == {5e-2}


@pytest.mark.slow
def test_msprobe_cli_import_and_diff_directories(stats_mix, tmp_path):
    p = _cli("import", "msprobe", stats_mix / "ref", "-o", tmp_path / "ref.h5")
    assert p.returncode == 0, p.stderr
    assert "imported" in p.stderr and (tmp_path / "ref.h5").is_file()
    p = _cli("import", "msprobe", stats_mix / "ref", "-o", tmp_path / "ref.h5")
    assert p.returncode == 3 and "--force" in p.stderr
    p = _cli("diff", stats_mix / "ref", stats_mix / "fault")
    assert p.returncode == 1, p.stderr
    assert p.stdout.startswith(f"FAIL: divergence starts at step 0, {NORM} (out.0)")
    p = _cli("diff", tmp_path / "ref.h5", stats_mix / "same")
    assert p.returncode == 0 and p.stdout.startswith("PASS"), p.stderr
