"""The diff on Ray (compare.ray_tasks, `accucheck diff --ray ADDRESS`) gives the serial verdict
bit for bit, and a task that fails gives one line, exit 3, no verdict. A local Ray instance
(2 CPUs) started once for the module, as a library caller's Ray; the CLI test starts its own
with `--ray local`. All `slow`: Ray takes 5-15 s to start on 2 shared cores."""
from __future__ import annotations

import os
import subprocess
import sys

import h5py
import pytest

from accucheck.compare import parallel
from accucheck.compare.diff import diff_captures
from accucheck.errors import UserError
from test_diff_parallel import FAULTS, _noisy_pair, analyze, planted, same  # noqa: F401

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ray_local():
    ray = pytest.importorskip("ray")
    import logging

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             logging_level=logging.ERROR)
    yield ray
    ray.shutdown()


@pytest.fixture
def ray_on(ray_local, monkeypatch):
    monkeypatch.delenv(parallel.TEST_DIE_ENV, raising=False)
    return ray_local


@pytest.mark.parametrize("kind", FAULTS)
def test_ray_verdict_equals_serial_on_every_planted_fault(planted, ray_on, kind):
    ref, cands = planted
    serial = analyze(ref, cands[kind])
    on_ray = analyze(ref, cands[kind], ray="auto", jobs=None)
    assert on_ray.diff.io["jobs"] == 2 and serial.diff.io["jobs"] == 1  # the cluster's CPUs
    same(serial.diff, on_ray.diff)
    assert repr(serial.verdict) == repr(on_ray.verdict) and serial.exit_code == on_ray.exit_code
    assert ray_on.is_initialized()  # a caller's Ray is left running


def test_ray_golden_and_control_diffs_equal_serial(planted, ray_on):
    ref, cands = planted
    kw = dict(golden=cands["fp64"], controls=[cands["fp32_dither"]])
    serial = diff_captures(ref, cands["norm_bf16"], **kw)
    on_ray = diff_captures(ref, cands["norm_bf16"], ray="auto", jobs=1, **kw)
    assert any(r.golden is not None for r in on_ray.records)
    assert any(r.control is not None for r in on_ray.records)
    same(serial, on_ray)


def test_a_record_a_ray_task_cannot_read_is_one_user_error(tmp_path, ray_on):
    a, b = _noisy_pair(tmp_path)
    with h5py.File(b, "a") as f:  # a damaged tensor in an otherwise valid file
        name = sorted(f["tensors"])[5]
        del f["tensors"][name]
        f["tensors"][name] = [0.0, 0.0, 0.0]
    with pytest.raises(UserError, match="damaged capture.*cannot|damaged capture.*shape") as e:
        diff_captures(a, b, ray="auto", jobs=None)
    assert "\n" not in str(e.value) and "Traceback" not in str(e.value)


def test_a_ray_worker_that_dies_is_one_user_error_no_verdict(tmp_path, ray_on, monkeypatch):
    a, b = _noisy_pair(tmp_path)
    monkeypatch.setenv(parallel.TEST_DIE_ENV, "1")  # the worker measuring chunk 1 exits
    with pytest.raises(UserError, match="Ray diff task failed.*no verdict") as e:
        diff_captures(a, b, ray="auto", jobs=None)
    assert "\n" not in str(e.value)
    monkeypatch.delenv(parallel.TEST_DIE_ENV)
    assert diff_captures(a, b, ray="auto", jobs=None).records  # the cluster serves on


def test_cli_ray_local_gives_the_serial_report_and_stops_its_ray(tmp_path):
    a, b = _noisy_pair(tmp_path)
    serial = subprocess.run([sys.executable, "-m", "accucheck", "diff", str(a), str(b),
                             "--jobs", "1", "--format", "json"], capture_output=True, text=True)
    on_ray = subprocess.run([sys.executable, "-m", "accucheck", "diff", str(a), str(b),
                             "--ray", "local", "--jobs", "2", "--format", "json"],
                            capture_output=True, text=True, timeout=300)
    assert on_ray.returncode == serial.returncode == 1, on_ray.stderr
    import json

    s, r = json.loads(serial.stdout), json.loads(on_ray.stdout)
    assert r["io"].pop("jobs") == 2 and s["io"].pop("jobs") == 1
    assert r == s
    assert "Traceback" not in on_ray.stderr


def test_cli_ray_address_misuse_is_usage_and_a_dead_address_one_line_exit_3(tmp_path):
    """A malformed address: exit 2 before a capture is opened; an address where nothing
    listens: exit 3 in one line at once (Ray itself would retry it for minutes)."""
    a, b = _noisy_pair(tmp_path)
    for address, code, words in (("nonsense", 2, "give local, auto, HOST:PORT"),
                                 ("127.0.0.1:1", 3, "nothing answers at 127.0.0.1:1")):
        p = subprocess.run([sys.executable, "-m", "accucheck", "diff", str(a), str(b),
                            "--ray", address], capture_output=True, text=True, timeout=120)
        assert p.returncode == code, p.stderr
        assert p.stdout == "" and p.stderr.strip().splitlines() == [
            next(x for x in p.stderr.strip().splitlines() if words in x)], p.stderr
        assert p.stderr.startswith("accucheck: error:")
