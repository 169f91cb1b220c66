"""What the vLLM workers report about themselves and what the front end does with it (issue 34),
through `capture_vllm` on the fake engine of tests/vllm_fakes.py (its worker in this process):
a sampler that ignores the engine's logprobs_mode is refused before generating; the front end
never asks torch.cuda / torch.npu for device facts (the workers do); each worker's determinism
switches, compile / graph state, attention backend and fusion passes (vLLM's pass_config,
vllm-ascend's ascend_compilation_config) land in meta "workers"; in graph mode meta
"fusion_passes" says which passes the taps may undo, from both engines' match counts."""
from __future__ import annotations

import enum
import os
import sys
import types
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

import vllm_fakes as fk  # noqa: E402
from accucheck.capture.options import CaptureOptions  # noqa: E402
from accucheck.errors import UserError  # noqa: E402

PROMPTS = [[5, 6, 7], [8, 9, 10, 11]]
CompilationMode = enum.IntEnum("CompilationMode", "NONE VLLM_COMPILE")  # as vLLM's
CUDAGraphMode = enum.Enum("CUDAGraphMode", "NONE PIECEWISE FULL_AND_PIECEWISE")


@pytest.fixture
def engine(monkeypatch):
    return fk.install_engine(monkeypatch)


def _capture(tiny_dir, out, **opts):
    from accucheck.capture.runners.vllm import capture_vllm

    return capture_vllm(tiny_dir, PROMPTS, out, CaptureOptions(max_new_tokens=1, **opts))


def _meta(path) -> dict:
    from accucheck.store import open_capture

    with open_capture(path) as c:
        assert c.complete
        return c.meta


def test_a_sampler_that_ignores_logprobs_mode_is_refused(engine, tiny_dir, tmp_path,
                                                         monkeypatch):
    """vllm-ascend's AscendSampler is built without the engine's logprobs_mode (raw_logprobs):
    one line naming the class and the mode, exit 3, before generating, no file. Before: the
    engine generated, and only the check of the returned rows (logsumexp about 0) could
    refuse them afterwards, without naming the sampler (the fake's rows are raw: it passes)."""
    monkeypatch.setattr(engine, "make_runner", staticmethod(lambda: fk.Runner(
        fk.MoEModel("vllm"), sampler=fk.AscendSampler("raw_logprobs"))))
    out = tmp_path / "x.h5"
    with pytest.raises(UserError, match="rank 0's sampler AscendSampler computes "
                                        "logprobs_mode=raw_logprobs, not the raw_logits") as e:
        _capture(tiny_dir, out, logits="full")
    assert e.value.exit_code == 3 and "\n" not in str(e.value)
    assert "--logits topk:K" in str(e.value)   # what this sampler can give
    assert not engine.started[-1].generated and not out.exists()


def test_a_sampler_in_raw_logits_mode_is_recorded(engine, tiny_dir, tmp_path):
    meta = _meta(_capture(tiny_dir, tmp_path / "x.h5", logits="full"))
    assert meta["workers"]["0"]["sampler"] == {"class": "Sampler", "logprobs_mode": "raw_logits"}


def test_the_ascend_sampler_gives_the_default_top_k_logits(engine, tiny_dir, tmp_path,
                                                            monkeypatch):
    """The default stats capture keeps top-k log-probabilities (--logits auto), which is what
    vllm-ascend's AscendSampler computes whatever the engine asks: not refused, and the file
    holds each position's following token and top-k as the engine returned them."""
    from accucheck.store import open_capture

    monkeypatch.setattr(engine, "make_runner", staticmethod(lambda: fk.Runner(
        fk.MoEModel("vllm"), sampler=fk.AscendSampler("raw_logprobs"))))
    out = _capture(tiny_dir, tmp_path / "x.h5")
    with open_capture(out) as c:
        assert c.meta["workers"]["0"]["sampler"]["logprobs_mode"] == "raw_logprobs"
        assert c.meta["options"]["logits"] == "topk:32"
        q = c.requests[0]
        values = c.read("r0.s1:logits#0:out.0")
        ids = c.read("r0.s1:logits#0:out.1")
        assert values.shape == ids.shape == (1, 1, 33)
        first = c.read("r0.s0:logits#0:out.1")[0, :, 0].tolist()
        assert first == list(q.prompt_ids[1:]) + [int(q.generated_ids[0])]
        assert np.all(np.diff(values[0, 0, 1:]) <= 0) and np.all(values[0, 0, 1:] <= 0)


def test_the_front_end_asks_the_workers_not_the_device(engine, tiny_dir, tmp_path,
                                                       monkeypatch):
    """--device cuda: torch.cuda's device-name / capability / count calls raise unless a
    worker method is running (vllm-ascend #10711: the front end initialising the device
    runtime). The capture's environment has the worker's device facts, and says so. Before:
    device.fingerprint called torch.cuda.get_device_name in the front end."""
    from accucheck.capture.runners import vllm as vllm_runner, vllm_plugin

    def worker_only(value):
        def call(*_a, **_k):
            if not engine.in_worker:
                raise AssertionError("the front end asked the device")
            return value
        return call
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", worker_only("NVIDIA H200 (fake)"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", worker_only((9, 0)))
    monkeypatch.setattr(torch.cuda, "device_count", worker_only(1))
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda _s: None)
    monkeypatch.setattr(vllm_runner, "_check_platform", lambda spec: None)
    monkeypatch.setattr(vllm_plugin, "runner_import_error", lambda kind: None)

    def cuda_runner():
        runner = fk.Runner(fk.MoEModel("vllm"))
        runner.device = torch.device("cuda", 0)  # what the worker says it runs on
        return runner
    monkeypatch.setattr(engine, "make_runner", staticmethod(cuda_runner))
    env = _meta(_capture(tiny_dir, tmp_path / "x.h5", device="cuda"))["environment"]
    assert env["device_name"] == "NVIDIA H200 (fake)"
    assert env["device_capability"] == [9, 0] and env["device_count"] == 1
    assert env["device_source"] == "vLLM worker rank 0 (cuda:0)"


def test_each_worker_reports_its_determinism_and_compile_state(engine, tiny_dir, tmp_path,
                                                               monkeypatch):
    """meta "workers": the deterministic variables the worker sees, torch's deterministic
    flag there, the compilation mode, cudagraph mode and backend of the engine's config, the
    attention backend the runner built. Before: meta held the front end's settings only."""
    monkeypatch.setenv("HCCL_DETERMINISTIC", "true")
    monkeypatch.setenv("ATB_MATMUL_SHUFFLE_K_ENABLE", "0")
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)

    def runner():
        r = fk.Runner(fk.MoEModel("vllm"), config=fk.vllm_config(
            mode=CompilationMode.VLLM_COMPILE, cudagraph_mode=CUDAGraphMode.PIECEWISE,
            backend="inductor"))
        backend = SimpleNamespace(get_name=lambda: "CPU_ATTN")
        r.attn_groups = [[SimpleNamespace(backend=backend)]]
        return r
    monkeypatch.setattr(engine, "make_runner", staticmethod(runner))
    w = _meta(_capture(tiny_dir, tmp_path / "x.h5"))["workers"]["0"]
    assert w["determinism"]["env"] == {"HCCL_DETERMINISTIC": "true",
                                       "ATB_MATMUL_SHUFFLE_K_ENABLE": "0"}
    assert w["determinism"]["torch.are_deterministic_algorithms_enabled"] is \
        torch.are_deterministic_algorithms_enabled()
    assert {k: w["compilation"][k] for k in ("mode", "cudagraph_mode", "backend",
                                             "attention_backend")} == {
        "mode": "VLLM_COMPILE", "cudagraph_mode": "PIECEWISE", "backend": "inductor",
        "attention_backend": ["CPU_ATTN"]}
    assert w["device"]["device"] == "cpu"


def test_compile_facts_of_an_older_vllm_and_a_configured_backend():
    """vLLM before 0.11 says `level`, not `mode`; without built attention groups the
    configured attention backend is reported; nothing reachable: None."""
    from accucheck.capture.runners.vllm_facts import compilation_facts

    config = fk.vllm_config(level=3)
    config.attention_config = SimpleNamespace(backend="FLASH_ATTN")
    facts = compilation_facts(SimpleNamespace(vllm_config=config))
    assert facts["level"] == 3 and facts["mode"] is None
    assert facts["attention_backend"] == ["FLASH_ATTN"]
    assert compilation_facts(SimpleNamespace())["attention_backend"] is None


def test_deterministic_reaches_each_worker(engine, tiny_dir, tmp_path, monkeypatch):
    """--deterministic: torch's switch is per process, so each worker turns it on itself.
    The fake's worker resets it as a worker process starts (off). Before: only the front
    end's process had it on, and meta "determinism" said so for the workers too."""
    was = torch.are_deterministic_algorithms_enabled()

    def fresh_worker():
        torch.use_deterministic_algorithms(False)  # a new process: off
        return fk.Runner(fk.MoEModel("vllm"))
    monkeypatch.setattr(engine, "make_runner", staticmethod(fresh_worker))
    try:
        meta = _meta(_capture(tiny_dir, tmp_path / "x.h5", deterministic=True))
    finally:
        torch.use_deterministic_algorithms(was)
    assert meta["workers"]["0"]["determinism"][
        "torch.are_deterministic_algorithms_enabled"] is True
    assert meta["determinism"]["torch.use_deterministic_algorithms"] is True


def test_deterministic_sets_the_npu_variables_the_workers_start_with(monkeypatch, tmp_path):
    """On NPU, --deterministic puts HCCL / LCCL determinism and ATB's shuffled-K matmul and
    LCOC overlap off into the environment the workers inherit (a value the user set wins),
    and restores the environment after. Before: ATB's two were never set."""
    from accucheck.capture import device as dev
    from accucheck.capture.runners.vllm_plugin import PluginConfig
    from accucheck.capture.runners.vllm import _capture_env

    for k in dev.DETERMINISTIC_ENV["npu"]:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HCCL_DETERMINISTIC", "strict")
    opts = CaptureOptions(device="npu", deterministic=True)
    with _capture_env(dev.parse_device("npu"), "bfloat16", opts, PluginConfig(), 1,
                      tmp_path / "x.h5") as spill:
        seen = {k: os.environ.get(k) for k in dev.DETERMINISTIC_ENV["npu"]}
        assert os.environ["VLLM_BATCH_INVARIANT"] == "1"
        # the workers are told where to write their tensors: beside the output
        assert PluginConfig.from_env().spill == spill and Path(spill).parent == tmp_path
    assert not Path(spill).exists()  # removed with the capture
    assert seen == {"HCCL_DETERMINISTIC": "strict", "LCCL_DETERMINISTIC": "1",
                    "ATB_MATMUL_SHUFFLE_K_ENABLE": "0", "ATB_LLM_LCOC_ENABLE": "0"}
    assert "ATB_LLM_LCOC_ENABLE" not in os.environ


@dataclass
class PassConfig:
    """vLLM 0.32's PassConfig (vllm/config/compilation.py), a dataclass: fusion switches True,
    False or None (undecided), and fields that are no switch."""
    fuse_norm_quant: bool | None = True
    fuse_act_quant: bool | None = False
    fuse_allreduce_rms: bool | None = None
    enable_qk_norm_rope_fusion: bool | None = True
    eliminate_noops: bool = True
    rope_kvcache_fusion_max_token_num: int = 256


class AscendCompilationConfig:
    """vllm-ascend's (vllm_ascend/ascend_config.py, main and v0.25.1rc1): a plain class."""

    def __init__(self):
        self.fuse_norm_quant, self.fuse_qknorm_rope, self.fuse_muls_add = True, False, True
        self.enable_npugraph_ex, self.enable_static_kernel = True, False


def _fake_vllm_ascend(monkeypatch) -> None:
    mod = types.ModuleType("vllm_ascend.ascend_config")
    config = SimpleNamespace(ascend_compilation_config=AscendCompilationConfig(),
                             ascend_fusion_config=SimpleNamespace(
                                 fusion_ops_gmmswigluquant=True))
    mod.get_ascend_config = lambda: config
    monkeypatch.setitem(sys.modules, "vllm_ascend.ascend_config", mod)


def test_each_worker_reports_its_fusion_passes(engine, tiny_dir, tmp_path, monkeypatch):
    """meta "workers" <rank> "fusion": the switches of vLLM's pass_config and of
    vllm-ascend's ascend_compilation_config / ascend_fusion_config, read by name, and the
    fusion passes on. Before: no fusion facts at all."""
    _fake_vllm_ascend(monkeypatch)

    def runner():
        return fk.Runner(fk.MoEModel("vllm"), config=fk.vllm_config(
            mode="NONE", cudagraph_mode="NONE", pass_config=PassConfig()))
    monkeypatch.setattr(engine, "make_runner", staticmethod(runner))
    fusion = _meta(_capture(tiny_dir, tmp_path / "x.h5"))["workers"]["0"]["fusion"]
    assert fusion["vllm"] == {"fuse_norm_quant": True, "fuse_act_quant": False,
                              "fuse_allreduce_rms": None, "enable_qk_norm_rope_fusion": True}
    assert fusion["vllm_ascend"] == {
        "fuse_norm_quant": True, "fuse_qknorm_rope": False, "fuse_muls_add": True,
        "enable_npugraph_ex": True, "enable_static_kernel": False,
        "fusion_ops_gmmswigluquant": True}
    assert fusion["enabled"] == [
        "vllm.enable_qk_norm_rope_fusion", "vllm.fuse_norm_quant",
        "vllm_ascend.fuse_muls_add", "vllm_ascend.fuse_norm_quant",
        "vllm_ascend.fusion_ops_gmmswigluquant"]


def test_an_older_pass_config_and_an_unreadable_ascend_config():
    """vLLM before 0.12 named its switches enable_fusion / enable_noop (read as they are); a
    vllm-ascend whose config is not initialised in this process is said, not raised."""
    from accucheck.capture.runners.vllm_facts import fusion_facts

    old = SimpleNamespace(pass_config=SimpleNamespace(enable_fusion=True, enable_noop=True,
                                                      dump_graph_dir="/tmp"))
    mp = pytest.MonkeyPatch()
    mod = types.ModuleType("vllm_ascend.ascend_config")

    def not_initialised():
        raise RuntimeError("Ascend config is not initialized.")
    mod.get_ascend_config = not_initialised
    mp.setitem(sys.modules, "vllm_ascend.ascend_config", mod)
    try:
        facts = fusion_facts(SimpleNamespace(vllm_config=SimpleNamespace(
            compilation_config=old)))
    finally:
        mp.undo()
    assert facts["vllm"] == {"enable_fusion": True, "enable_noop": True}
    assert facts["enabled"] == ["vllm.enable_fusion"]
    assert facts["vllm_ascend_error"] == "RuntimeError: Ascend config is not initialized."


def test_graph_mode_meta_says_the_taps_may_undo_fusions(engine, tiny_dir, tmp_path,
                                                        monkeypatch):
    """Graph mode, meta "fusion_passes": the passes on, and vLLM's pattern-match counts of
    the untapped and the tapped engine. Both engines run in this process (the fake's), so the
    tapped count is what it added: 1 match against the untapped engine's 2 names the pass.
    Before: no such entry, and the untapped engine was never asked."""
    from accucheck.capture.runners.vllm_facts import MATCH_TABLE_MODULES

    table = defaultdict(int)
    matcher = SimpleNamespace(match_table=table)
    monkeypatch.setitem(sys.modules, MATCH_TABLE_MODULES[0],
                        SimpleNamespace(VllmPatternMatcherPass=matcher))
    started = []

    def runner():  # the untapped engine compiles first and matches twice, the tapped once
        started.append(1)
        table["RMSNormQuantFusionPass"] += 2 if len(started) == 1 else 1
        table["QKNormRoPEFusionPass"] += 1
        return fk.Runner(fk.MoEModel("vllm"), config=fk.vllm_config(
            mode=CompilationMode.VLLM_COMPILE, cudagraph_mode=CUDAGraphMode.PIECEWISE,
            pass_config=PassConfig()))
    monkeypatch.setattr(engine, "make_runner", staticmethod(runner))
    meta = _meta(_capture(tiny_dir, tmp_path / "g.h5", mode="graph"))
    fp = meta["fusion_passes"]
    assert fp["enabled"] == ["vllm.enable_qk_norm_rope_fusion", "vllm.fuse_norm_quant"]
    assert fp["matches"] == {
        "untapped": {"QKNormRoPEFusionPass": 1, "RMSNormQuantFusionPass": 2},
        "tapped": {"QKNormRoPEFusionPass": 1, "RMSNormQuantFusionPass": 1}}
    assert fp["unfused_by_taps"] == ["RMSNormQuantFusionPass"]
    assert fp["note"].startswith("2 fusion pass(es) on: the taps add readers")
    assert "meta observer_effect measures" in fp["note"]
    assert meta["observer_effect"]["bitwise"]
    # the stats store's top-k logits (--logits auto): the untapped engine's, the tapped ones
    # measured against them at every step
    assert meta["options"]["logits"] == "topk:32" and len(meta["observer_effect"]["steps"]) == 4


def test_eager_meta_has_no_fusion_note(engine, tiny_dir, tmp_path):
    meta = _meta(_capture(tiny_dir, tmp_path / "e.h5"))
    assert "fusion_passes" not in meta
    assert meta["workers"]["0"]["fusion"]["enabled"] == []


def test_a_full_disk_while_a_worker_writes_its_tensors_is_one_line(engine, tiny_dir, tmp_path,
                                                                    monkeypatch):
    """issue 36: the workers write their tensors to disk (capture.record.spill). A disk that
    fills up there is one line, exit 3, saying what the file is left as; before the fix it was
    a RuntimeError "vLLM capture hooks failed" with a traceback. The spill directory goes."""
    import errno as errnos

    from accucheck.capture.record.spill import Spill
    from accucheck.store import open_capture

    def full(self, data):
        raise OSError(errnos.ENOSPC, "No space left on device")
    monkeypatch.setattr(Spill, "put", full)
    out = tmp_path / "x.h5"
    with pytest.raises(UserError, match="no room left on the disk for the workers' tensors "
                                        r"\(rank 0: disk full: OSError: \[Errno 28\]") as e:
        _capture(tiny_dir, out, store="full")
    assert e.value.exit_code == 3 and "\n" not in str(e.value)
    assert "incomplete" in str(e.value)
    with open_capture(out, allow_incomplete=True) as c:
        assert not c.complete
    assert [p.name for p in tmp_path.iterdir()] == ["x.h5"]   # no spill directory left


def test_an_engine_option_the_platform_overrode_is_said_and_kept_in_meta(capsys):
    """A capture's engine arguments the started engine does not run as asked: one note on
    stderr each and meta "engine_not_in_effect" (vLLM's config is read in the front end)."""
    from types import SimpleNamespace

    from accucheck.capture.runners.vllm import _not_in_effect

    cfg = SimpleNamespace(cache_config=SimpleNamespace(block_size=16),
                          scheduler_config=SimpleNamespace(max_num_seqs=4))
    llm = SimpleNamespace(llm_engine=SimpleNamespace(vllm_config=cfg))
    got = _not_in_effect(llm, {"block_size": 64, "max_num_seqs": 4, "gpu_memory_utilization": 0.3})
    assert got == {"block_size": {"asked": 64, "runs": 16}}
    err = capsys.readouterr().err
    assert err == ("note: engine option block_size=64 is not in effect: this engine runs "
                   "block_size=16 (the platform overrides it)\n")


def test_what_a_worker_noted_survives_its_death_a_forward_at_a_time(tmp_path):
    """record.spill, here for vllm_plugin.Record (which imports vLLM). Each forward's records
    are one line of rank<r>.idx, written after their tensors are flushed: the front end reads
    back every whole line and drops a line cut short (a worker that died writing it), and a
    row gives back the record (key, statistics, where its tensor lies) with its tensor
    readable."""
    from accucheck.capture.record.spill import Spill, SpillReader
    from accucheck.capture.runners.vllm_plugin import Record

    spill = Spill(str(tmp_path), 1)
    t = np.arange(6, dtype=np.float32).reshape(1, 2, 3)
    stats = np.array([1.0, np.nan, np.inf, -2.5])
    rec = Record(0, 0, "model.layers.0.mlp", 0, "out", "0", "float32", (1, 2, 3), stats,
                 2**63 + 5, None, 0, 1, spill.put(t))
    spill.note([rec.to_row()])
    spill.note([Record(0, 1, "model.layers.0.mlp", 0, "out", "0", "float32", (1, 2, 3), stats,
                       7, None, 0, 1, spill.put(t + 1)).to_row()])
    spill.close()
    with open(tmp_path / "rank1.idx", "a") as f:
        f.write('[[0, 2, "model.layers.0.mlp", 0, "o')  # the third forward, cut short
    noted = SpillReader(str(tmp_path)).noted(range(2))
    assert list(noted) == [0, 1] and noted[0] == [] and len(noted[1]) == 2
    back = [Record.from_row(row) for row in noted[1]]
    assert [(b.req, b.step) for b in back] == [(0, 0), (0, 1)]
    assert back[0].checksum == 2**63 + 5 and back[0].shape == (1, 2, 3)
    np.testing.assert_array_equal(back[0].stats, stats)
    reader = SpillReader(str(tmp_path))
    np.testing.assert_array_equal(reader.data(back[0]), t)
    np.testing.assert_array_equal(reader.data(back[1]), t + 1)


def test_an_engine_death_is_one_line_even_when_keeping_records_fails(tmp_path):
    """The records of the completed forwards are written before the one-line error; if that
    itself fails, the error still says the engine died (and why the records were not kept)."""
    from accucheck.capture.runners.vllm import _generate
    from accucheck.errors import UserError

    class EngineDeadError(RuntimeError):
        pass

    def dies(*_a, **_k):
        raise EngineDeadError("EngineCore encountered an issue")

    llm = SimpleNamespace(generate=dies)
    writer = SimpleNamespace(replacing=False, path=tmp_path / "x.h5", n_records=3)
    kept = []
    with pytest.raises(UserError, match=r"a worker process died .* left incomplete \(3 records\)$"):
        _generate(llm, [[1, 2]], [None], 1, None, writer, {}, lambda: kept.append(1))
    assert kept == [1]

    def fails():
        raise OSError(28, "No space left on device")

    with pytest.raises(UserError, match="could not be kept: .*No space left on device"):
        _generate(llm, [[1, 2]], [None], 1, None, writer, {}, fails)
