"""Shared fixtures: the tiny model built once per test session, offline."""
from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """Directory of the built-in tiny Llama (seed 0), built once per session."""
    from accucheck.capture.tiny import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="session")
def tiny(tiny_dir):
    """(model, tokenizer) of the tiny Llama in float32 on the CPU. Do not mutate it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, local_files_only=True).eval()
    return model, AutoTokenizer.from_pretrained(tiny_dir, local_files_only=True)


@pytest.fixture(autouse=True, scope="session")
def _offline():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """In CI (ACCUCHECK_NO_SKIP=1, set by .ci/run) a skipped test is a failure: nothing that was
    not run is counted as passing."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and os.environ.get("ACCUCHECK_NO_SKIP") == "1" \
            and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        report.longrepr = f"skipped in CI (ACCUCHECK_NO_SKIP=1): {report.longrepr}"


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of the real SmolLM2-135M-Instruct in float32 (tests/smollm2.py). Slow
    tests only. Do not mutate it."""
    import smollm2 as s
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = s.model_dir()
    model = AutoModelForCausalLM.from_pretrained(d, local_files_only=True,
                                                 attn_implementation="eager").eval()
    return model, AutoTokenizer.from_pretrained(d, local_files_only=True)


@pytest.fixture(scope="module")
def vllm_in_process():
    """vLLM's engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) for a test
    module's engines (`pytestmark = pytest.mark.usefixtures("vllm_in_process")`): faster to
    start; tests/test_vllm_tp.py shows it records the same as vLLM's default process model."""
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    yield
    mp.undo()


# Under pytest-xdist (`-n N`, as .ci/run runs the suite), each worker gets its share of the
# cores for torch's intra-op threads, set before torch is imported (the vLLM engines and CLI
# subprocesses a test starts inherit it): N workers at the machine's default thread count
# would oversubscribe the cores. An OMP_NUM_THREADS the caller set is kept.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (_cores or 1) // _WORKERS)))


def pytest_collection_modifyitems(config, items):
    """Groups for `--dist loadgroup`: a test module runs on one worker (its module-scoped
    captures are made once), and every module with a vLLM test on the same worker, so one
    vLLM engine runs at a time (memory, ports)."""
    vllm_modules = {item.nodeid.split("::")[0] for item in items
                    if item.get_closest_marker("vllm")}
    for item in items:
        module = item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group("vllm" if module in vllm_modules else module))
