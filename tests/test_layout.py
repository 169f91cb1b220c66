"""The package tree is the pipeline, and imports only go down it. Read from the source with ast
(nothing is imported), every import statement counted: module level, inside functions, under
`if TYPE_CHECKING:`, and `importlib.import_module("name")` / `__import__("name")` with a literal.

Stages, bottom to top: bottom (store, keys, errors, numbers, prompts, paths, coverage, the
package itself) < compare < verdict < report < matrix < signoff < top (cli, demo, replay,
__main__). capture and importers are a side branch over the bottom: capture imports the bottom
only, importers the bottom and capture; impact (swaps recorded tensors into a model run) the
bottom and capture, and only signoff (its [impact] run) and the top layer import it; matrix and
signoff may use capture (to run engines and capture runs), the top layer anything.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "accucheck"

BOTTOM = {"accucheck", "accucheck.store", "accucheck.store.format", "accucheck.store.reader",
          "accucheck.store.writer", "accucheck.store.sketch", "accucheck.keys", "accucheck.errors",
          "accucheck.numbers", "accucheck.prompts", "accucheck.paths", "accucheck.coverage"}
TOP = {"accucheck.cli", "accucheck.demo", "accucheck.replay",
       "accucheck.__main__"}
PACKAGES = ("capture", "importers", "impact", "compare", "verdict", "report", "matrix", "signoff")
# stage -> the stages its modules may import (its own included)
ALLOWED = {
    "bottom": {"bottom"},
    "capture": {"bottom", "capture"},
    "importers": {"bottom", "capture", "importers"},
    "impact": {"bottom", "capture", "impact"},
    "compare": {"bottom", "compare"},
    "verdict": {"bottom", "compare", "verdict"},
    "report": {"bottom", "compare", "verdict", "report"},
    "matrix": {"bottom", "compare", "verdict", "report", "capture", "matrix"},
    "signoff": {"bottom", "compare", "verdict", "report", "matrix", "signoff", "capture",
                "impact"},
    "top": {"bottom", "compare", "verdict", "report", "matrix", "signoff", "capture",
            "importers", "impact", "top"},
}
# no torch (nor anything that imports it: capture) on the diff path
TORCH_FREE = {"bottom", "compare", "verdict", "report"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def stage(mod: str) -> str:
    if mod in BOTTOM:
        return "bottom"
    if mod in TOP:
        return "top"
    parts = mod.split(".")
    if len(parts) > 1 and parts[1] in PACKAGES:
        return parts[1]
    raise AssertionError(f"{mod} is in no stage: add it to BOTTOM, TOP or a stage package")


def imports(mod: str) -> list[tuple[str, int]]:
    """(imported module, line) for every import in `mod`'s source, resolved to absolute names:
    `from pkg import name` gives pkg.name when that is a module of ours, else pkg."""
    path = MODULES[mod]
    tree = ast.parse(path.read_text(), str(path))
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module
            for a in node.names:
                sub = f"{name}.{a.name}"
                out.append((sub if sub in MODULES else name, node.lineno))
        elif (isinstance(node, ast.Call) and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and ((isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                   or (isinstance(node.func, ast.Name)
                       and node.func.id in ("import_module", "__import__")))):
            out.append((node.args[0].value, node.lineno))
    return out


def internal(name: str) -> str | None:
    """Our module `name` refers to (a name inside a module resolves to that module)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def graph() -> dict[str, set[str]]:
    g: dict[str, set[str]] = {m: set() for m in MODULES}
    for m in MODULES:
        for name, _ in imports(m):
            if name == "accucheck" or name.startswith("accucheck."):
                target = internal(name)
                assert target is not None, f"{m} imports {name}, which is no module here"
                if target != m:
                    g[m].add(target)
    return g


def test_every_module_has_a_stage():
    for m in MODULES:
        stage(m)
    assert {stage(m) for m in MODULES} == set(ALLOWED)


def offending_stage_imports() -> list[str]:
    bad = []
    for m in MODULES:
        for name, line in imports(m):
            if name == "accucheck" or name.startswith("accucheck."):
                t = internal(name)
                if stage(t) not in ALLOWED[stage(m)]:
                    bad.append(f"{MODULES[m].relative_to(ROOT)}:{line}: {stage(m)} module {m} "
                               f"imports {t} ({stage(t)})")
    return bad


def test_imports_only_go_down_the_pipeline():
    assert offending_stage_imports() == []


def top_level(name: str) -> str:
    return name.split(".")[0]


@pytest.mark.parametrize("dist, allowed", [
    ("h5py", {"accucheck.store.format", "accucheck.store.reader", "accucheck.store.writer"}),
    ("torch_npu", {"accucheck.capture.device"}),
])
def test_only_one_module_imports(dist, allowed):
    users = {m for m in MODULES for name, _ in imports(m) if top_level(name) == dist}
    assert users <= allowed, f"{dist} imported by {sorted(users - allowed)}"
    assert users, f"nothing imports {dist} any more: update this test"


def test_the_store_is_imported_one_way():
    """accucheck.store's parts (format, reader, writer) are imported by the package alone:
    everything else imports accucheck.store."""
    bad = [f"{MODULES[m].relative_to(ROOT)}:{line}: {name}" for m in MODULES
           if not m.startswith("accucheck.store") for name, line in imports(m)
           if name.startswith("accucheck.store.")]
    assert bad == []


def test_the_diff_path_never_imports_torch():
    bad = [f"{MODULES[m].relative_to(ROOT)}:{line}: {name}" for m in MODULES
           if stage(m) in TORCH_FREE for name, line in imports(m)
           if top_level(name) in ("torch", "torch_npu")]
    assert bad == []


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of g (as a path that returns to its start), or None."""
    state: dict[str, int] = {}   # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for t in sorted(g[m]):
            if state.get(t) == 1:
                return path[path.index(t):] + [t]
            if t not in state and (c := visit(t)):
                return c
        path.pop()
        state[m] = 2
        return None

    for m in sorted(g):
        if m not in state and (c := visit(m)):
            return c
    return None


def test_no_import_cycle():
    """Every import statement counts, function-level ones too; a package's __init__ counts
    only where it is imported by name (not as the parent of each of its modules)."""
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


# Inside capture (issue 35): record/ is what a hook does with a tensor (recorder, ops, shadow,
# links, selection, statistics, graph taps, compile progress, MoE routing, rank copies); the
# runners (HF, vLLM, batched rows, control) drive a model and feed a capture file. What records
# never depends on who runs the model.
CAPTURE_INNER = {"record": {"runners", "session"}, "session": {"runners"},
                 "options": {"runners", "session"}}


def capture_part(mod: str) -> str | None:
    """The part of capture a module is in: record, runners, session, ... (None: outside)."""
    parts = mod.split(".")
    return parts[2] if len(parts) >= 3 and parts[:2] == ["accucheck", "capture"] else None


def test_record_never_imports_the_runners():
    bad = []
    for m in MODULES:
        forbidden = CAPTURE_INNER.get(capture_part(m) or "", set())
        for name, line in imports(m):
            t = internal(name) if name.startswith("accucheck") else None
            if t is not None and capture_part(t) in forbidden:
                bad.append(f"{MODULES[m].relative_to(ROOT)}:{line}: {m} imports {t}")
    assert bad == []


def test_the_capture_rule_sees_a_runner_import():
    assert capture_part("accucheck.capture.runners.hf") == "runners"
    assert capture_part("accucheck.capture.record.stats") == "record"
    assert capture_part("accucheck.capture.session") == "session"
    assert capture_part("accucheck.store") is None
