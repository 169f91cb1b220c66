"""CLI: capture / inspect / tiny-model, and every bad input of issue 2 (one line, exit 3).

Signals during a capture: tests/test_signals.py; more bad input: tests/test_bad_input.py."""
from __future__ import annotations

import json
import os

import pytest

from accucheck.cli import main


def run(args, capsys):
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in args])
    out, err = capsys.readouterr()
    return e.value.code, out, err


def one_line_error(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith("accucheck: error:")]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def test_capture_and_inspect(tiny_dir, tmp_path, capsys):
    out = tmp_path / "run.h5"
    code, _, err = run(["capture", tiny_dir, "--prompt", "hello there", "--prompt", "fox",
                        "--max-new-tokens", "2", "--store", "full", "-o", out], capsys)
    assert code == 0, err
    code, text, _ = run(["inspect", out, "--filter", "*layers.1*", "--step", "0"], capsys)
    assert code == 0
    assert "complete         yes" in text and "r1.s0:model.layers.1.mlp#0:out.0" in text
    assert "r0.s1:" not in text
    code, text, _ = run(["inspect", out, "--format", "json", "--limit", "3"], capsys)
    info = json.loads(text)
    assert info["complete"] and len(info["record_list"]) == 3 and info["dtype"] == "float32"


def test_prompts_file_text_and_jsonl(tiny_dir, tmp_path, capsys):
    (tmp_path / "p.txt").write_text("first prompt\n\nsecond prompt\n")
    (tmp_path / "p.jsonl").write_text('{"prompt": "first prompt"}\n{"text": "second prompt"}\n')
    for name in ("p.txt", "p.jsonl"):
        code, _, err = run(["capture", tiny_dir, "--prompts", tmp_path / name,
                            "-o", tmp_path / f"{name}.h5"], capsys)
        assert code == 0, err
    from accucheck.store import open_capture

    with open_capture(tmp_path / "p.txt.h5") as a, open_capture(tmp_path / "p.jsonl.h5") as b:
        assert [r.prompt for r in a.requests] == ["first prompt", "second prompt"]
        assert [r.prompt for r in b.requests] == ["first prompt", "second prompt"]


@pytest.mark.parametrize("case", [
    "missing_dir", "not_a_model", "npu_without_torch_npu", "cuda_without_gpu", "output_exists",
    "empty_prompts", "malformed_jsonl", "unknown_dtype", "unknown_mode", "tokens_from_other_model",
    "tokens_from_missing", "no_prompts",
])
def test_bad_input_is_one_line_exit_3(case, tiny_dir, tmp_path, capsys):
    out = tmp_path / "out.h5"
    base = ["capture", tiny_dir, "--prompt", "hi", "-o", out]
    precious = None
    if case == "missing_dir":
        args, msg = ["capture", tmp_path / "nope", "--prompt", "hi", "-o", out], "does not exist"
    elif case == "not_a_model":
        (tmp_path / "empty").mkdir()
        args, msg = ["capture", tmp_path / "empty", "--prompt", "hi", "-o", out], "no config.json"
    elif case == "npu_without_torch_npu":
        args, msg = base + ["--device", "npu"], "torch_npu"
    elif case == "cuda_without_gpu":
        args, msg = base + ["--device", "cuda:0"], "no CUDA GPU"
    elif case == "output_exists":
        out.write_bytes(b"keep me")
        precious = b"keep me"
        args, msg = base, "--force"
    elif case == "empty_prompts":
        (tmp_path / "p.txt").write_text("\n\n")
        args, msg = ["capture", tiny_dir, "--prompts", tmp_path / "p.txt", "-o", out], "empty"
    elif case == "malformed_jsonl":
        (tmp_path / "p.jsonl").write_text('{"prompt": "ok"}\n{"prompt": \n')
        args, msg = ["capture", tiny_dir, "--prompts", tmp_path / "p.jsonl", "-o", out], "p.jsonl:2"
    elif case == "unknown_dtype":
        args, msg = base + ["--dtype", "float8"], "unknown dtype"
    elif case == "unknown_mode":
        args, msg = base + ["--mode", "turbo"], "unknown mode"
    elif case == "tokens_from_other_model":
        from accucheck.capture.tiny import write_tiny_model

        other = write_tiny_model(tmp_path / "other", seed=0, num_hidden_layers=1)
        code, _, err = run(["capture", other, "--prompt", "hi", "-o", tmp_path / "o.h5"], capsys)
        assert code == 0, err
        args, msg = base + ["--tokens-from", tmp_path / "o.h5"], "another model"
    elif case == "tokens_from_missing":
        args, msg = base + ["--tokens-from", tmp_path / "none.h5"], "no such capture"
    else:
        args, msg = ["capture", tiny_dir, "-o", out], "no prompts"
    code, _, err = run(args, capsys)
    # flag misuse is a usage error (exit 2), bad input data exit 3 (accucheck.errors)
    assert code == (2 if case in ("unknown_dtype", "unknown_mode", "no_prompts") else 3), err
    assert msg in one_line_error(err)
    if precious is not None:
        assert out.read_bytes() == precious
    else:
        assert not out.exists()


def test_usage_error_exits_2(capsys):
    code, _, _ = run(["capture"], capsys)
    assert code == 2


def test_tiny_model_command_refuses_non_empty_dir(tmp_path, capsys):
    d = tmp_path / "m"
    d.mkdir()
    (d / "mine.txt").write_text("x")
    code, _, err = run(["tiny-model", d], capsys)
    assert code == 3 and "not empty" in one_line_error(err)
    code, _, err = run(["tiny-model", tmp_path / "fresh", "--seed", "3"], capsys)
    assert code == 0 and (tmp_path / "fresh" / "model.safetensors").is_file()


def test_list_modules(tiny_dir, capsys):
    code, out, _ = run(["capture", tiny_dir, "-o", "unused.h5", "--list-modules",
                        "--exclude", "*.mlp"], capsys)
    assert code == 0
    mods = out.split()
    assert "model.layers.3.self_attn" in mods and "model.layers.3.mlp" not in mods
    assert not os.path.exists("unused.h5")


def test_collective_and_backend_variables_are_recorded(tiny_dir, tmp_path, capsys, monkeypatch):
    """NCCL / HCCL / LCCL / ATB variables (collective algorithms, Ascend Transformer Boost
    kernels) and vLLM's attention backend / breakable CUDA graph switches change numerics on
    real devices: each one lands in meta environment.env (issue 34)."""
    from accucheck.store import open_capture

    wanted = {"NCCL_ALGO": "Ring", "HCCL_OP_EXPANSION_MODE": "AIV", "LCCL_PARALLEL": "0",
              "ATB_MATMUL_SHUFFLE_K_ENABLE": "0", "VLLM_ATTENTION_BACKEND": "TORCH_SDPA",
              "VLLM_USE_BREAKABLE_CUDAGRAPH": "1", "INF_NAN_MODE_FORCE_DISABLE": "1",
              "TORCH_TRANSFER_TO_NPU": "0"}
    for k, v in wanted.items():
        monkeypatch.setenv(k, v)
    out = tmp_path / "c.h5"
    code, _, err = run(["capture", tiny_dir, "--prompt", "hi", "--include", "model.layers.0.mlp",
                        "--max-new-tokens", "1", "-o", out], capsys)
    assert code == 0, err
    with open_capture(out) as c:
        env = c.meta["environment"]
    assert {k: env["env"].get(k) for k in wanted} == wanted
    assert "device_note" not in env and "TORCH_TRANSFER_TO_NPU" not in err


def test_cuda_that_transfer_to_npu_runs_on_an_npu_is_said(tiny_dir, tmp_path, capsys,
                                                          monkeypatch):
    """TORCH_TRANSFER_TO_NPU=1 makes torch_npu map torch.cuda onto the NPU: --device cuda is
    then an NPU capture. The summary line and meta environment.device_note say so (issue 34).
    Here torch_device is faked (no GPU or NPU): it answers as transfer_to_npu would."""
    import torch

    from accucheck.capture import device as dev
    from accucheck.store import open_capture

    monkeypatch.setenv("TORCH_TRANSFER_TO_NPU", "1")
    monkeypatch.setattr(dev, "torch_device", lambda spec: torch.device("cpu"))
    out = tmp_path / "c.h5"
    code, _, err = run(["capture", tiny_dir, "--device", "cuda", "--prompt", "hi", "--include",
                        "model.layers.0.mlp", "--max-new-tokens", "1", "-o", out], capsys)
    assert code == 0, err
    [line] = [ln for ln in err.splitlines() if "TORCH_TRANSFER_TO_NPU" in ln]
    assert "--device cuda runs on an Ascend NPU" in line
    with open_capture(out) as c:
        assert c.meta["environment"]["device_note"] == line
        assert c.meta["environment"]["env"]["TORCH_TRANSFER_TO_NPU"] == "1"
    assert dev.transfer_note(dev.parse_device("npu")) is None
    assert dev.transfer_note(dev.parse_device("cpu")) is None


def test_capture_flags_and_environment_are_recorded(tiny_dir, tmp_path, capsys, monkeypatch):
    """--compression, --deterministic, --seed, --include and the numerics environment
    variables, through the CLI: each one lands in the file."""
    import h5py
    import torch

    from accucheck.store import open_capture

    out = tmp_path / "c.h5"
    for k, v in (("HCCL_DETERMINISTIC", "true"), ("VLLM_BATCH_INVARIANT", "1"),
                 ("VLLM_ASCEND_ENABLE_NZ", "0"), ("ACCUCHECK_UNRELATED", "x")):
        monkeypatch.setenv(k, v)
    was = torch.are_deterministic_algorithms_enabled()
    try:
        code, _, err = run(["capture", tiny_dir, "--prompt", "hi there", "--store", "full",
                            "--compression", "gzip", "--deterministic", "--seed", "7",
                            "--include", "model.layers.0.mlp", "-o", out], capsys)
    finally:  # --deterministic switches torch for the whole process
        torch.use_deterministic_algorithms(was)
    assert code == 0, err
    with open_capture(out) as c:
        meta = c.meta
        keys = [str(x.key) for x in c.rows]
    recorded = meta["environment"]["env"]
    assert recorded["HCCL_DETERMINISTIC"] == "true" and recorded["VLLM_BATCH_INVARIANT"] == "1"
    assert recorded["VLLM_ASCEND_ENABLE_NZ"] == "0" and "ACCUCHECK_UNRELATED" not in recorded
    assert meta["determinism"]["torch.use_deterministic_algorithms"] is True
    assert meta["options"]["compression"] == "gzip" and meta["options"]["deterministic"] is True
    assert meta["seed"]["seed"] == 7 and meta["options"]["seed"] == 7
    assert "r0.s0:model.layers.0.mlp#0:out.0" in keys  # --include: that module (and logits)
    assert {k.split(":")[1].split("#")[0] for k in keys} == {"model.layers.0.mlp", "logits"}
    with h5py.File(out, "r") as f:
        ds = [f["tensors"][n] for n in f["tensors"]]
        assert ds and {d.compression for d in ds} == {"gzip"}
    # without the flags: nothing switched, nothing compressed
    code, _, err = run(["capture", tiny_dir, "--prompt", "hi there", "--store", "full",
                        "--include", "model.layers.0.mlp", "-o", tmp_path / "plain.h5"], capsys)
    assert code == 0, err
    with open_capture(tmp_path / "plain.h5") as c:
        assert c.meta["determinism"] == {} and c.meta["options"]["compression"] is None
    with h5py.File(tmp_path / "plain.h5", "r") as f:
        assert {f["tensors"][n].compression for n in f["tensors"]} == {None}
