"""Bad input and faults, for every command (issue 10): one line on stderr, no traceback, the
right exit code (2 usage error, 3 bad input), and nothing lost: every file that existed before
a refused command is byte-identical afterwards, and a refused command leaves nothing behind.

Signals during a capture: tests/test_signals.py.
"""
from __future__ import annotations

import inspect

import json
import os
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import h5py
import numpy as np
import pytest

import accucheck
from accucheck.cli import main

REPO = str(Path(accucheck.__file__).resolve().parent.parent)
PROGRESS = ("capturing ", "capture: prompt ", "diff ", "diff: ", "signoff: ", "wrote ")


# ----------------------------------------------------------------------------- helpers

def run(args, capsys):
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in args])
    out, err = capsys.readouterr()
    return e.value.code, out, err


def one_line(err: str, alone: bool = True) -> str:
    """The one error line; `alone`: nothing else on stderr (else only progress lines)."""
    assert "Traceback" not in err and "Exception ignored" not in err, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("accucheck: error:")]
    assert len(errors) == 1, err
    if alone:
        assert lines == errors, err
    else:
        assert all(ln.startswith(PROGRESS) for ln in lines if ln not in errors), err
    return errors[0]


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under `root` (hidden ones too) with its bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


def refused(args, capsys, root: Path, code: int, match: str, alone: bool = True) -> str:
    """Run a command that must be refused: exit `code`, one line containing `match`, and
    nothing under `root` created, changed or deleted."""
    before = snapshot(root)
    got, _, err = run(args, capsys)
    line = one_line(err, alone)
    assert got == code, err
    assert match in line, line
    assert snapshot(root) == before, "files changed by a refused command"
    return line


def env() -> dict:
    e = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    e["PYTHONPATH"] = REPO + (os.pathsep + e["PYTHONPATH"] if e.get("PYTHONPATH") else "")
    return e


@pytest.fixture(scope="module")
def caps(tiny, tmp_path_factory):
    """Small captures of the tiny model: full with inputs, stats only, and one of another
    model (1 layer instead of 4)."""
    from accucheck.capture.runners.hf import capture_dir, capture_model
    from accucheck.capture.options import CaptureOptions
    from accucheck.capture.tiny import write_tiny_model

    d = tmp_path_factory.mktemp("caps")
    model, tok = tiny
    capture_model(model, ["hello there"], d / "full.h5", tokenizer=tok, store="full",
                  record_inputs=True, max_new_tokens=1)
    capture_model(model, ["hello there"], d / "stats.h5", tokenizer=tok, max_new_tokens=1)
    other = write_tiny_model(d / "other-model", seed=0, num_hidden_layers=1)
    capture_dir(other, ["hello there"], d / "other.h5",
                CaptureOptions(store="full", max_new_tokens=1))
    return d


@pytest.fixture
def work(tmp_path, caps):
    """A fresh folder with copies of the captures and a precious file."""
    for name in ("full.h5", "stats.h5", "other.h5"):
        shutil.copy(caps / name, tmp_path / name)
    (tmp_path / "keep.h5").write_bytes((caps / "full.h5").read_bytes())
    (tmp_path / "afile").write_text("a file, not a folder")
    return tmp_path


def model_copy(tiny_dir: Path, dest: Path) -> Path:
    shutil.copytree(tiny_dir, dest)
    return dest


# ----------------------------------------------------------------------------- capture: exit 3

def _config_list(d):
    (d / "config.json").write_text("[1, 2]")


def _config_not_json(d):
    (d / "config.json").write_text("{not json")


def _weights_truncated(d):
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[:len(data) // 2])


def _weights_random(d):
    (d / "model.safetensors").write_bytes(np.random.default_rng(0).bytes(4096))


def _pickle_only(d):
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(b"a pickle that must never be loaded")


def _no_weights(d):
    (d / "model.safetensors").unlink()


def _no_tokenizer(d):
    for p in d.glob("tokenizer*"):
        p.unlink()


def _custom_code(d):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(model_type="accucheck_custom", architectures=["CustomForCausalLM"],
               auto_map={"AutoConfig": "configuration_custom.CustomConfig",
                         "AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"})
    (d / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("damage, match", [
    (_config_list, "is a JSON list, not an object"),
    (_config_not_json, "config.json cannot be read"),
    (_weights_truncated, "not a readable safetensors file"),
    (_weights_random, "not a readable safetensors file"),
    (_pickle_only, "pickle weights only (pytorch_model.bin): accucheck loads safetensors only"),
    (_no_weights, "has no weights"),
    (_no_tokenizer, "has no tokenizer (tokenizer.json or tokenizer_config.json): save"),
    (_custom_code, "pass --trust-remote-code if you trust the code"),
], ids=lambda x: getattr(x, "__name__", "")[1:])
def test_capture_of_a_broken_model_dir(damage, match, tiny_dir, work, capsys):
    d = model_copy(tiny_dir, work / "model")
    damage(d)
    line = refused(["capture", d, "--prompt", "hi", "-o", work / "out.h5"], capsys, work, 3,
                   match)
    if damage is _pickle_only:
        assert "save_pretrained" in line and "safe_serialization=True" in line


def test_pickle_weights_are_never_loaded(tiny_dir, tmp_path, monkeypatch):
    """Even past the directory check, transformers is asked for safetensors only: a pickle
    that would run code when loaded is never opened."""
    import pickle

    import torch

    import accucheck.capture.models as hf
    from accucheck.errors import UserError

    class Payload:
        def __reduce__(self):
            return (Path.touch, (tmp_path / "pickle-ran",))

    d = model_copy(tiny_dir, tmp_path / "model")
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(pickle.dumps(Payload()))
    monkeypatch.setattr(hf, "_check_weights", lambda path: None)
    with pytest.raises(UserError, match="cannot load the model"):
        hf.load_model_dir(d, torch.float32, torch.device("cpu"))
    assert not (tmp_path / "pickle-ran").exists()


@pytest.mark.parametrize("case", ["parent_is_a_file", "missing_parent",
                                  "exists", "compile_backend", "shadow_stats_force",
                                  "shadow_stats_fresh", "tokens_from_damaged"])
def test_capture_refused_before_any_output(case, tiny_dir, work, capsys):
    base = ["capture", tiny_dir, "--prompt", "hi"]
    args, match = {
        "parent_is_a_file": (base + ["-o", work / "afile" / "x.h5"], "is a file, not a folder"),
        "missing_parent": (base + ["-o", work / "nope" / "x.h5"], "does not exist"),
        "exists": (base + ["-o", work / "keep.h5"], "--force"),
        "compile_backend": (base + ["--mode", "graph", "--compile-backend", "nosuchbackend",
                                    "-o", work / "out.h5"], "no such backend"),
        "shadow_stats_force": (base + ["-o", work / "keep.h5", "--force", "--shadow",
                                       work / "stats.h5"], "statistics only"),
        "shadow_stats_fresh": (base + ["-o", work / "out.h5", "--shadow", work / "stats.h5"],
                               "statistics only"),
        "tokens_from_damaged": (base + ["-o", work / "out.h5", "--tokens-from", work / "afile"],
                                "not a readable HDF5 file"),
    }[case]
    refused(args, capsys, work, 3, match, alone=case in (
        "parent_is_a_file", "missing_parent", "exists", "shadow_stats_fresh",
        "shadow_stats_force", "tokens_from_damaged"))


@pytest.mark.parametrize("flag", ["--shadow", "--tokens-from"])
def test_an_input_is_never_the_output(flag, tiny_dir, work, capsys):
    refused(["capture", tiny_dir, "--prompt", "hi", "-o", work / "full.h5", "--force", flag,
             work / "full.h5"], capsys, work, 2, "an input is never an output")
    os.symlink(work / "full.h5", work / "alias.h5")
    refused(["capture", tiny_dir, "--prompt", "hi", "-o", work / "alias.h5", "--force", flag,
             work / "full.h5"], capsys, work, 2, "an input is never an output")


def test_force_replaces_an_existing_capture_only_when_complete(tiny_dir, work, capsys):
    os.chmod(work / "keep.h5", 0o640)
    code, _, err = run(["capture", tiny_dir, "--prompt", "replaced", "-o", work / "keep.h5",
                        "--force"], capsys)
    assert code == 0, err
    assert (work / "keep.h5").stat().st_mode & 0o777 == 0o640  # the replaced file's mode
    from accucheck.store import open_capture

    with open_capture(work / "keep.h5") as r:
        assert r.requests[0].prompt == "replaced"
    assert not list(work.glob(".*partial"))


# ----------------------------------------------------------------------------- usage: exit 2

@pytest.mark.parametrize("extra, match", [
    (["--dtype", "float8"], "unknown dtype"),
    (["--mode", "turbo"], "unknown mode"),
    (["--device", "tpu"], "unknown device"),
    (["--device", "cpu:1"], "cpu takes no index"),
    (["--mode", "graph", "--level", "op"], "need --mode eager"),
    (["--max-new-tokens", "-1"], "--max-new-tokens must be >= 0"),
    (["--compile-backend", "inductor"], "--compile-backend is for --mode graph"),
    (["--engine-arg", "a=1"], "--engine-arg is for --runner vllm"),
    (["--engine-arg", "a"], "use KEY=VALUE"),
    # the vLLM runner's clashes, refused before vLLM is imported (capture.options.check_runner)
    (["--runner", "vllm", "--level", "op"], "--level op and --shadow are not available"),
    (["--runner", "vllm", "--dtype", "float64"], "vLLM does not run float64"),
    (["--runner", "vllm", "--mode", "graph", "--compile-backend", "inductor"],
     "--compile-backend is for --runner hf"),
    (["--runner", "vllm", "--engine-arg", "enforce_eager=false"], "contradicts --mode eager"),
    (["--runner", "vllm", "--engine-arg", "enable_prefix_caching=true"],
     "enable_prefix_caching=True needs --positions last:1 or decode"),
    (["--runner", "vllm", "--engine-arg", "enable_prefix_caching=true", "--positions",
      "last:2"], "enable_prefix_caching=True needs --positions last:1 or decode"),
    (["--store", "everything"], "Invalid value for '--store'"),
    (["--no-such-flag"], "No such option"),
    (["-o", "."], "is a directory"),  # click's own check of a path argument
])
def test_capture_usage_errors_exit_2(extra, match, tiny_dir, work, capsys):
    refused(["capture", tiny_dir, "--prompt", "hi", "-o", work / "out.h5"] + extra, capsys,
            work, 2, match)


def test_no_prompts_and_no_output_are_usage_errors(tiny_dir, work, capsys):
    refused(["capture", tiny_dir, "-o", work / "out.h5"], capsys, work, 2, "no prompts")
    refused(["capture", tiny_dir, "--prompt", "hi"], capsys, work, 2, "capture needs -o")
    refused(["capture"], capsys, work, 2, "Missing argument 'MODEL'")
    refused(["nosuchcommand"], capsys, work, 2, "No such command")


def test_list_modules_needs_no_output(tiny_dir, work, capsys):
    before = snapshot(work)
    code, out, err = run(["capture", tiny_dir, "--list-modules"], capsys)
    assert code == 0, err
    assert "model.layers.0.mlp" in out.split()
    assert snapshot(work) == before


# ----------------------------------------------------------------------------- damaged captures

def _attr(name, value):
    def f(h):
        h.attrs[name] = value
    f.__name__ = f"_{name}_{value!r}"
    return f


def _delete(path):
    def f(h):
        del h[path]
    f.__name__ = f"_no_{path.strip('/').replace('/', '_')}"
    return f


def _meta(text):
    def f(h):
        del h["meta"]
        h.create_dataset("meta", data=text, dtype=h5py.string_dtype("utf-8"))
    f.__name__ = f"_meta_{text[:6]}"
    return f


def _bad_key(h):
    h["index/key"][3] = "garbage"


def _nan_count(h):
    h["index/stats"][2, 8] = np.nan


def _tensor_shape(h):
    ds = h["tensors/00000004"]
    data = ds[()]
    del h["tensors/00000004"]
    t = h["tensors"].create_dataset("00000004", data=data.reshape(-1)[: data.size // 2])
    t.attrs["dtype"] = "float32"


def _short_column(h):
    h["index/kind"].resize((3,))


DAMAGE = [
    (_attr("schema_version", "one"), "schema_version is 'one', not an integer"),
    (_attr("schema_version", 1.5), "schema_version is 1.5, not an integer"),
    (_delete("meta"), "/meta is missing"),
    (_meta("{not json"), "/meta is not JSON"),
    (_meta("[1, 2]"), "/meta is not a JSON object"),
    (_delete("index"), "/index is missing"),
    (_delete("index/stats"), "/index/stats is missing"),
    (_delete("requests"), "/requests is missing"),
    (_delete("requests/0/prompt_ids"), "/requests/0/prompt_ids is missing"),
    (_delete("tensors/00000011"), "its tensor /tensors/00000011 is missing"),
    (_bad_key, "/index/key row 3 is 'garbage', not a record key"),
    (_nan_count, "/index/stats row 2 has counts"),
    (_short_column, "the /index columns have different lengths"),
]


@pytest.mark.parametrize("damage, match", DAMAGE, ids=[d.__name__[1:] for d, _ in DAMAGE])
def test_damaged_capture_is_named_by_diff_and_inspect(damage, match, work, capsys):
    bad = work / "bad.h5"
    shutil.copy(work / "full.h5", bad)
    with h5py.File(bad, "a") as h:
        damage(h)
    line = refused(["diff", work / "full.h5", bad], capsys, work, 3, match)
    assert str(bad) in line  # which of the two files
    refused(["inspect", bad], capsys, work, 3, match)
    line = refused(["diff", bad, work / "full.h5"], capsys, work, 3, match)
    assert str(bad) in line


def test_tensor_disagreeing_with_its_index_row(work, capsys):
    bad = work / "bad.h5"
    shutil.copy(work / "full.h5", bad)
    with h5py.File(bad, "a") as h:
        _tensor_shape(h)
    line = refused(["diff", work / "full.h5", bad], capsys, work, 3,
                   "/tensors/00000004 has shape", alone=False)
    assert str(bad) in line and "the index says" in line


@pytest.mark.parametrize("how, match", [
    ("truncated", "cut short"), ("random", "not a readable HDF5 file"), ("empty", "empty file"),
    ("missing", "no such capture file")])
def test_unreadable_files(how, match, work, capsys):
    bad = work / "bad.h5"
    if how == "truncated":
        data = (work / "full.h5").read_bytes()
        bad.write_bytes(data[: len(data) // 2])
    elif how == "random":
        bad.write_bytes(np.random.default_rng(1).bytes(10000))
    elif how == "empty":
        bad.write_bytes(b"")
    refused(["inspect", bad], capsys, work, 3, match)
    refused(["diff", work / "full.h5", bad], capsys, work, 3, match)


def test_a_directory_where_a_capture_file_is_expected_is_a_usage_error(work, capsys):
    refused(["inspect", work], capsys, work, 2, "is a directory")
    from accucheck.errors import UserError
    from accucheck.store import open_capture

    with pytest.raises(UserError, match="not a file"):  # the library says so too (exit 3)
        open_capture(work)


def test_inspect_of_a_capture_still_being_written(work, capsys):
    path = work / "busy.h5"
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, h5py
            f = h5py.File({str(path)!r}, "w")
            print("open", flush=True)
            sys.stdin.read()
        """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env())
    try:
        assert proc.stdout.readline().strip() == "open"
        code, _, err = run(["inspect", path], capsys)
        assert code == 3 and "in use by another process" in one_line(err)
    finally:
        proc.communicate("")


# ----------------------------------------------------------------------------- diff

def test_diff_report_output_checked_before_the_diff(work, capsys):
    a, b = work / "full.h5", work / "full.h5"
    refused(["diff", a, b, "-o", work / "nope" / "r.txt"], capsys, work, 3, "does not exist")
    refused(["diff", a, b, "-o", work / "afile" / "r.txt"], capsys, work, 3, "is a file")
    refused(["diff", a, b, "-o", work / "keep.h5"], capsys, work, 3, "--force")
    refused(["diff", a, work / "stats.h5", "-o", work / "stats.h5", "--force"], capsys, work, 2,
            "an input is never an output")
    code, _, err = run(["diff", a, b, "-o", work / "afile", "--force"], capsys)
    assert code == 0, err
    assert (work / "afile").read_text().startswith("PASS")
    assert not list(work.glob(".*partial"))


@pytest.mark.parametrize("extra, match", [
    (["--amplification", "0.5"], "0.5 is not in the range x>=1"),
    (["--rel-l2", "-1"], "a tolerance is a number >= 0"),
    (["--rtol", "1e-3"], "give --rtol and --atol together"),
    (["--tol", "nonsense"], "bad tolerance override"),
    (["--format", "xml"], "Invalid value for '--format'"),
])
def test_diff_usage_errors_exit_2(extra, match, work, capsys):
    refused(["diff", work / "full.h5", work / "full.h5"] + extra, capsys, work, 2, match)


def test_diff_of_different_models_is_refused(work, capsys):
    line = refused(["diff", work / "full.h5", work / "other.h5"], capsys, work, 3,
                   "were captured from different models", alone=False)
    assert "num_hidden_layers 4 vs 1" in line and "--allow-model-mismatch" in line
    line = refused(["diff", work / "full.h5", work / "full.h5", "--golden", work / "other.h5"],
                   capsys, work, 3, "(golden) were captured from different models", alone=False)
    code, out, err = run(["diff", work / "full.h5", work / "other.h5",
                          "--allow-model-mismatch"], capsys)
    assert code in (0, 1), err
    assert "Traceback" not in err


# ----------------------------------------------------------------------------- replay

@pytest.fixture(scope="module")
def op_capture_without_inputs(tiny, tmp_path_factory):
    from accucheck.capture.runners.hf import capture_model

    model, tok = tiny
    path = tmp_path_factory.mktemp("ops") / "ops.h5"
    capture_model(model, ["hi"], path, tokenizer=tok, level="op", store="full",
                  include=("model.layers.0.mlp",))
    return path


def test_replay_with_nothing_replayed_is_not_a_pass(op_capture_without_inputs, work, capsys):
    shutil.copy(op_capture_without_inputs, work / "ops.h5")
    refused(["replay", work / "ops.h5"], capsys, work, 3, "nothing replayed")
    refused(["replay", work / "ops.h5", "--limit", "0"], capsys, work, 2,
            "0 is not in the range x>=1")
    refused(["replay", work / "stats.h5"], capsys, work, 3, "statistics only")


# ----------------------------------------------------------------------------- signoff, demo

SCENARIO = """
name = "bad-input"
model = "@tiny"
prompts = ["hello there"]
max_new_tokens = 1
store = "stats"
[reference]
[candidate]
"""


@pytest.fixture
def scenario(work):
    p = work / "s.toml"
    p.write_text(SCENARIO)
    return p


def test_signoff_inputs_are_never_outputs(scenario, work, capsys):
    out = work / "OUT"
    (out / "captures").mkdir(parents=True)
    shutil.copy(work / "full.h5", out / "captures" / "candidate.h5")
    (out / "report.json").write_text('{"schema": "accucheck.signoff", "metrics": {}}')
    refused(["signoff", scenario, "--ref", out / "captures" / "candidate.h5", "-o", out,
             "--force"], capsys, work, 2, "an input is never an output")
    refused(["signoff", scenario, "--previous", out / "report.json", "-o", out, "--force"],
            capsys, work, 2, "an input is never an output")
    refused(["signoff", scenario, "--ref", work / "full.h5", "--cand", work / "full.h5",
             "--previous", out / "report.json", "-o", out, "--force"], capsys, work, 2,
            "an input is never an output")


@pytest.mark.parametrize("case, code, match", [
    ("capture_only_golden", 3, "has no golden run"),
    ("out_under_a_file", 3, "is a file, not a directory"),
    ("out_is_a_file", 2, "is a file"),  # click's own check of the path argument
    ("not_empty", 3, "is not empty"),
    ("previous_missing", 3, "does not exist"),
    ("previous_not_a_report", 3, "is not an accucheck sign-off report.json"),
    ("ref_damaged", 3, "not a readable HDF5 file"),
    ("capture_only_bad_role", 2, "Invalid value for '--capture-only'"),
])
def test_signoff_refused_before_any_output(case, code, match, scenario, work, capsys):
    out = work / "OUT"
    args = ["signoff", scenario, "-o", out]
    if case == "capture_only_golden":  # a scenario that turns the default referee off
        scenario.write_text(SCENARIO + "[golden]\nenabled = false\n")
        args += ["--capture-only", "golden"]
    elif case == "out_under_a_file":
        args[-1] = work / "afile" / "report"
    elif case == "out_is_a_file":
        args[-1] = work / "afile"
    elif case == "not_empty":
        out.mkdir()
        (out / "notes.txt").write_text("mine")
    elif case == "previous_missing":
        args += ["--previous", work / "nope.json"]
    elif case == "previous_not_a_report":
        (work / "prev.json").write_text("[]")
        args += ["--previous", work / "prev.json"]
    elif case == "ref_damaged":
        args += ["--ref", work / "afile"]
    elif case == "capture_only_bad_role":
        args += ["--capture-only", "everything"]
    refused(args, capsys, work, code, match)


@pytest.mark.slow
def test_signoff_force_keeps_inputs_and_what_it_does_not_write(scenario, work, capsys):
    """--ref inside OUT/captures and foreign files in OUT survive --force; the report is
    replaced."""
    out = work / "OUT"
    (out / "captures").mkdir(parents=True)
    ref = out / "captures" / "reference.h5"
    shutil.copy(work / "full.h5", ref)
    (out / "notes.txt").write_text("mine")
    (out / "report.md").write_text("last week's report")
    (out / "plots").mkdir()
    (out / "plots" / "stale.png").write_bytes(b"old plot")
    precious = {p: p.read_bytes() for p in (ref, out / "notes.txt")}
    code, _, err = run(["signoff", scenario, "--ref", ref, "-o", out, "--force", "-q"], capsys)
    assert code in (0, 1), err
    assert all(p.read_bytes() == b for p, b in precious.items())
    assert (out / "report.md").read_text() != "last week's report"
    assert not (out / "plots" / "stale.png").exists()
    assert (out / "captures" / "candidate.h5").is_file()
    assert not [p for p in out.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("cmd", ["tiny-model", "demo"])
def test_output_directory_under_a_file(cmd, work, capsys):
    args = ["tiny-model", work / "afile" / "sub"] if cmd == "tiny-model" else \
        ["demo", "--out-dir", work / "afile" / "demo"]
    refused(args, capsys, work, 3, "is a file, not a directory")


# ----------------------------------------------------------------------------- disk full

# Runs `accucheck capture` under RLIMIT_FSIZE (what `ulimit -f` sets; SIGXFSZ ignored, so a
# write past the limit fails with EFBIG as on a full disk), in one process, once per case:
#   stop     - the writer sees the limit coming and stops with room for a clean close
#   hit      - it cannot see it (free_bytes disabled): HDF5 hits the limit itself
#   replace  - an existing file with --force: it stays byte-identical
DISK_DRIVER = textwrap.dedent('''
    import json, os, resource, signal, sys
    from pathlib import Path

    model, work, limit = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    cases = json.loads(sys.argv[4])
    import accucheck.store.writer as store  # where CaptureWriter looks free_bytes up
    from accucheck.cli import main

    real_free_bytes = store.free_bytes
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    results = {}
    for name, out, blind, force in cases:
        store.free_bytes = (lambda *a, **k: None) if blind else real_free_bytes
        err_path = work / f"{name}.stderr"
        sys.stderr.flush()
        saved = os.dup(2)
        fd = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 2)
        os.close(fd)
        try:
            main(["capture", model, "--prompt", "a long enough prompt to fill the disk",
                  "--max-new-tokens", "40", "--store", "full", "-o", out]
                 + (["--force"] if force else []))
            code = 0
        except SystemExit as e:
            code = e.code
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        results[name] = {"code": code, "stderr": err_path.read_text()}
    (work / "results.json").write_text(json.dumps(results))
''')


@pytest.mark.slow
def test_disk_full_is_one_line_exit_3_and_an_incomplete_file(tiny_dir, work):
    from accucheck.store import open_capture

    precious = (work / "keep.h5").read_bytes()
    cases = [("stop", str(work / "stop.h5"), False, False),
             ("hit", str(work / "hit.h5"), True, False),
             ("replace", str(work / "keep.h5"), True, True)]
    (work / "driver.py").write_text(DISK_DRIVER)
    proc = subprocess.run([sys.executable, str(work / "driver.py"), str(tiny_dir), str(work),
                           str(1 << 20), json.dumps(cases)],
                          env=env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr  # no segmentation fault (exit 139 / -11)
    results = json.loads((work / "results.json").read_text())
    for name, *_ in cases:
        r = results[name]
        assert r["code"] == 3, (name, r)
        line = one_line(r["stderr"], alone=False)
        assert line.startswith("accucheck: error: disk full writing"), line
    for name in ("stop", "hit"):
        line = one_line(results[name]["stderr"], alone=False)
        assert "records written, file left incomplete" in line
        with open_capture(work / f"{name}.h5", allow_incomplete=True) as r:
            assert not r.complete
            n = len(r.rows)
        assert f": {n} records written" in line
    with open_capture(work / "stop.h5", allow_incomplete=True) as r:
        assert r.rows  # it stopped with the records flushed so far
    assert "is unchanged" in one_line(results["replace"]["stderr"], alone=False)
    assert (work / "keep.h5").read_bytes() == precious
    assert not list(work.glob(".*partial"))


# ----------------------------------------------------------------------------- transformers

def test_capture_passes_no_deprecated_argument(tiny, tmp_path):
    """No FutureWarning / DeprecationWarning from transformers during prefill + decode."""
    from accucheck.capture.runners.hf import capture_model

    model, tok = tiny
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        capture_model(model, ["hello"], tmp_path / "a.h5", tokenizer=tok, max_new_tokens=2)


def test_cache_argument_follows_a_renamed_parameter(tiny):
    """Should transformers rename `past_key_values` (deprecating the old name with its
    deprecate_kwarg decorator), the runner passes the cache under the new name."""
    import torch
    from transformers.utils.deprecation import deprecate_kwarg

    from accucheck.capture.models import cache_argument, greedy_run

    model, _ = tiny
    # the name this transformers takes (past_key_values up to 5.23, cache from 5.24)
    name = cache_argument(model)
    assert name in inspect.signature(model.forward).parameters
    assert name == ("cache" if "cache" in inspect.signature(model.forward).parameters
                    else "past_key_values")
    assert cache_argument(torch.compile(model)) == name

    class Renamed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        @deprecate_kwarg("past_key_values", new_name="cache", version="99.0")
        def forward(self, input_ids=None, cache: "Cache | None" = None, use_cache=None):  # noqa: F821
            return self.inner(input_ids=input_ids, use_cache=use_cache, **{name: cache})

    m = Renamed()
    assert cache_argument(m) == "cache"
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        got = greedy_run(m, [1, 2, 3], torch.device("cpu"), 2, on_step=lambda s: None,
                         on_logits=lambda x: None)
    assert len(got.generated_ids) == 2

    # a plain wrapper of the forward (`fwd(*a, **k)`, as tests/test_signals.py wraps it) hides
    # the parameters: the model's class says (issue 35: at transformers 5.25 the wrapped
    # forward was passed the deprecated past_key_values and warned)
    def fwd(*a, **k):
        return m(*a, **k)
    assert cache_argument(fwd) == "past_key_values" and cache_argument(fwd, m) == "cache"
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        got = greedy_run(fwd, [1, 2, 3], torch.device("cpu"), 2, on_step=lambda s: None,
                         on_logits=lambda x: None, model=m)
    assert len(got.generated_ids) == 2


# ----------------------------------------------------------------------------- documented once

def test_readme_documents_the_exit_codes_and_the_rule():
    from accucheck import errors

    text = (Path(REPO) / "README.md").read_text()
    section = text[text.index("## Exit codes"):text.index("## Python API")]
    for code, word in ((errors.EXIT_OK, "done"), (errors.EXIT_DIVERGENCE, "divergence"),
                       (errors.EXIT_USAGE, "usage error"), (errors.EXIT_BAD_INPUT, "bad input")):
        assert f"| {code} | {word}" in section
    for rule in ("checked before any output is created or touched", "an input is never an output",
                 "renamed into", "opens as incomplete"):
        assert rule in " ".join(section.split())
    for code in ("0", "1", "2", "3"):
        assert f"\n{code}  " in errors.__doc__


def test_a_device_backend_that_fails_at_import_torch_is_one_line(tmp_path):
    """issue 34: on an Ascend host `import torch` autoloads torch_npu (entry point group
    torch.backends); without CANN's set_env.sh it fails, and every command died with torch's
    traceback. A fake backend that fails the same way: one line naming set_env.sh and
    TORCH_DEVICE_BACKEND_AUTOLOAD=0, exit 3, nothing written."""
    import os
    import subprocess
    import sys

    (tmp_path / "fake_npu.py").write_text(
        "def autoload():\n    raise ImportError('libhccl.so: cannot open shared object file')\n")
    info = tmp_path / "fake_npu-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-npu\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[torch.backends]\nfake_npu = fake_npu:autoload\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    env.pop("TORCH_DEVICE_BACKEND_AUTOLOAD", None)
    out = tmp_path / "x.h5"
    p = subprocess.run([sys.executable, "-c", "from accucheck.cli import main; main()",
                        "capture", "@tiny", "--device", "cpu", "--prompt", "a", "-o", str(out)],
                       capture_output=True, text=True, env=env, timeout=300)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 3 and len(lines) == 1, p.stderr
    assert "importing torch failed" in lines[0] and "set_env.sh" in lines[0]
    assert "TORCH_DEVICE_BACKEND_AUTOLOAD=0" in lines[0] and "libhccl.so" in lines[0]
    assert not out.exists()
    env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"  # what the line says works
    q = subprocess.run([sys.executable, "-c", "import torch"], env=env, capture_output=True)
    assert q.returncode == 0
