"""The torch.compile backend of --mode graph (issue 34, item 8): inductor on every device, NPU
included (torch_npu's documented graph mode, its NPU inductor); TorchAir's GE backend only when
asked with --compile-backend torchair; and whatever loading TorchAir raises (not only
ImportError: torch_npu's lazy `torchair` re-raises the real error, RuntimeError / OSError /
AttributeError when CANN is missing) said in one line. On the CPU, with fake `torchair`
modules: nothing here needs torch_npu or an NPU."""
from __future__ import annotations

import sys
import types

import pytest

from accucheck.capture.record.compiling import backend_for
from accucheck.capture.device import DeviceSpec, parse_device
from accucheck.errors import UserError

NPU = parse_device("npu:0")
CANN_MISSING = "libascendcl.so: cannot open shared object file: No such file or directory"


def _fake_torchair(monkeypatch, get_npu_backend) -> types.ModuleType:
    mod = types.ModuleType("torchair")
    mod.CompilerConfig = lambda: "default config"
    mod.get_npu_backend = get_npu_backend
    monkeypatch.setitem(sys.modules, "torchair", mod)
    return mod


class _LazyTorchair:
    """torch_npu's stand-in for `torchair` in sys.modules (torch_npu/dynamo/__init__.py): the
    import succeeds, the first attribute read loads the real package and raises what it met."""

    def __getattr__(self, name):
        raise RuntimeError(CANN_MISSING)


def test_the_npu_default_is_inductor_even_with_torchair_installed(monkeypatch):
    """Before: on NPU the default was TorchAir's GE backend whenever torchair imported."""
    _fake_torchair(monkeypatch, lambda compiler_config: "the GE backend")
    assert backend_for(NPU, None) == ("inductor", "inductor")
    assert backend_for(DeviceSpec("npu"), None) == ("inductor", "inductor")
    assert backend_for(DeviceSpec("cuda"), None) == ("inductor", "inductor")


def test_the_npu_default_never_loads_torchair(monkeypatch):
    """A torchair that cannot load does not matter unless it is asked for. Before: its
    RuntimeError escaped the default path as a traceback (only ImportError was caught)."""
    monkeypatch.setitem(sys.modules, "torchair", _LazyTorchair())
    assert backend_for(NPU, None) == ("inductor", "inductor")


def test_torchair_when_asked_is_its_npu_backend(monkeypatch):
    """--compile-backend torchair maps to torchair.get_npu_backend(CompilerConfig()), though
    dynamo's list_backends does not list that name. Before: refused as unknown."""
    seen = []

    def get_npu_backend(compiler_config):
        seen.append(compiler_config)
        return "the GE backend"
    _fake_torchair(monkeypatch, get_npu_backend)
    assert backend_for(NPU, "torchair") == ("torchair", "the GE backend")
    assert seen == ["default config"]


def _one_line_refusal(spec, backend: str = "torchair") -> str:
    with pytest.raises(UserError) as e:
        backend_for(spec, backend)
    msg = str(e.value)
    assert "\n" not in msg and e.value.exit_code == 3
    assert msg.startswith("--compile-backend torchair: TorchAir did not load (")
    assert "leave --compile-backend out for inductor" in msg
    return msg


def test_a_torchair_that_raises_runtimeerror_on_import(monkeypatch, tmp_path):
    """The package's own import raises RuntimeError (CANN's libraries absent): one line that
    names it. Before: the RuntimeError passed `except ImportError` with its traceback."""
    pkg = tmp_path / "torchair"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(f"raise RuntimeError({CANN_MISSING!r})\n")
    monkeypatch.delitem(sys.modules, "torchair", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    msg = _one_line_refusal(NPU)
    assert f"(RuntimeError: {CANN_MISSING})" in msg


def test_torch_npus_lazy_torchair_raising_at_first_use(monkeypatch):
    """`import torchair` succeeds (torch_npu's lazy stand-in), get_npu_backend raises."""
    monkeypatch.setitem(sys.modules, "torchair", _LazyTorchair())
    assert f"(RuntimeError: {CANN_MISSING})" in _one_line_refusal(NPU)


@pytest.mark.parametrize("error", [OSError("libge_runner.so: undefined symbol: aclrtX"),
                                   AttributeError("module 'torchair' has no attribute 'ge'")])
def test_get_npu_backend_raising_anything_is_one_line(monkeypatch, error):
    def get_npu_backend(compiler_config):
        raise error
    _fake_torchair(monkeypatch, get_npu_backend)
    msg = _one_line_refusal(NPU)
    assert f"({type(error).__name__}: {error})" in msg


def test_a_multi_line_torchair_error_stays_one_line(monkeypatch):
    """torch_npu's import errors span lines (the error code on its own line)."""
    def get_npu_backend(compiler_config):
        raise RuntimeError("An error occurred when import `torchair`\n[ERROR] ERR00005 PTA")
    _fake_torchair(monkeypatch, get_npu_backend)
    assert "import `torchair` [ERROR] ERR00005 PTA)" in _one_line_refusal(NPU)


def test_an_unknown_backend_lists_torchair_among_the_known(monkeypatch):
    with pytest.raises(UserError, match=r"knows no such backend here; use one of .*"
                                        r"inductor.*torchair") as e:
        backend_for(NPU, "nosuchbackend")
    assert "\n" not in str(e.value)
