"""msprobe (MindStudio Probe) PyTorch dumps -> one accucheck capture. Imports errors, keys and
store; torch only to read tensor-mode data (lazily); never msprobe.

`import_msprobe(DUMP, OUT)` reads a dump written by msprobe's `PrecisionDebugger` (task
"statistics" or "tensor", level L0, mix or L1) and writes an ordinary capture file:

    DUMP/[step{N}/][rank{R} | proc{PID} | rank/]{dump.json, construct.json, stack.json,
                                                   dump_tensor_data/*.pt | *.npy}

DUMP may be the dump root, one step folder, one rank / proc folder or a dump.json file.

What maps (every record of one msprobe step lands in accucheck step N, request 0):

- `Module.{path}.{Class}.forward.{n}` -> module records `{path}#{n}`: its `input_args[i]` /
  `input_kwargs[name]` -> role "in", slot "i" / "name" (nested lists add ".j", dicts ".key",
  as accucheck's own captures do); `output` -> role "out", slot "0", "1", ... msprobe's
  module call index n counts calls of that module in the step, like accucheck's.
- the model head: `lm_head` (vLLM: `logits_processor`, when present) -> its output is the
  `logits#{n}:out.0` record (kind "logits"), as in accucheck captures.
- API entries `{Functional|Tensor|Torch|NPU|Aten|Distributed|...}.{api}.{k}.forward` -> op
  records `{module}#{n}/{Prefix}.{api}@{i}`: the enclosing module call comes from
  construct.json (an API with no enclosing module -> module "<top>", call 0), and `i`
  counts the dumped APIs inside that module call, in dump order. msprobe's own per-API counter
  `k` is global to the step and is NOT used: accucheck aligns the op sequences of each module
  call (accucheck.compare.opmatch), so one fused kernel does not shift every later op. The call site
  ("transformers/models/llama/modeling_llama.py:64 in forward", the innermost frame outside
  torch and msprobe) comes from stack.json.
- statistics-mode dumps -> statistics records: min / max / mean / l2 from msprobe's Min / Max /
  Mean / Norm, absmax from them, numel from the shape, std unknown (NaN), NaN / Inf counts 1
  when Max / Min are NaN / infinite (msprobe reduces over all elements) else 0, zero counts 0
  (not dumped); md5 mode's CRC32 (xor mode's checksum) becomes the checksum. accucheck's diff
  then uses its statistics lower bound (basis "stats"): a failure is certain, a pass is
  weaker. A dump with checksums only (summary_mode xor) is refused: no error can be measured.
- tensor-mode dumps -> full records: the tensors, with accucheck's own statistics.
- execution order: a module's input records come before everything inside it, op records at
  their dump position, a module's output records after its ops and submodules.

What does not map, skipped and counted in the capture's meta ("msprobe"): backward entries,
weights (a module's `parameters`; an API input identical to a parameter of its enclosing
module, i.e. the weight a Functional.linear receives), non-tensor arguments, the lm_head's input
(it is the final norm's output). Requests: msprobe does not dump token ids apart from tensors,
and a vLLM step batches every request into one tensor: every record is request 0 and the
capture holds no /requests (so `accucheck diff` cannot check that two imports ran the same
prompt; a differing prompt shows as an error on the integer input_ids records). Ranks: one
rank per capture (`rank`, default the first; the others are listed in meta). Graph-mode
(ACL graph / torchair) dumps record nothing inside the graph; msprobe records a module's output
before forward hooks that were registered before the module's first call.

Security, the one exception to accucheck's no-pickle rule: msprobe writes tensors with
`torch.save`, which is pickle. They are read ONLY with `torch.load(weights_only=True)` (torch's
restricted unpickler: tensors, storages and plain containers, never arbitrary objects or code),
`.npy` files with `numpy.load(allow_pickle=False)`; a file that needs anything more is refused
(exit 3). The JSON files are data. A malformed, truncated or inconsistent dump raises UserError
(one line, exit 3), never a traceback.
"""
from __future__ import annotations

import json
import math
import os
import re
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from accucheck.errors import UserError
from accucheck.keys import LOGITS_MODULE, RecordKey, clean_slot
from accucheck.store import CaptureWriter, meta_header

RUNNER = "msprobe-import"
TOP_MODULE = "<top>"            # the enclosing "module" of APIs outside every dumped module
HEAD_NAMES = ("logits_processor", "lm_head")  # first present: its output is the logits record
_MODULE_RE = re.compile(r"^Module\.(?P<path>.+)\.(?P<cls>[^.]+)\.(?P<dir>forward|backward)"
                        r"\.(?P<n>\d+)$")
_API_RE = re.compile(r"^(?P<prefix>[A-Za-z][A-Za-z0-9_]*)\.(?P<api>.+)\.(?P<k>\d+)"
                     r"\.(?P<dir>forward|backward)$")
_STEP_RE = re.compile(r"^step(\d+)$")
_RANK_RE = re.compile(r"^(?:rank(\d*)|proc(\d+))$")
_FRAME_RE = re.compile(r"^File (?P<file>.+?), line (?P<line>\d+), in (?P<fn>[^,\s]+)")
_SKIP_FRAMES = (f"{os.sep}torch{os.sep}", f"{os.sep}msprobe{os.sep}")
PROGRESS_EVERY = 500


@dataclass(frozen=True)
class DumpDir:
    """One dump.json folder: msprobe step N (0 without a step folder) of one rank / process."""
    path: Path
    step: int
    rank: str        # "rank0", "proc1234", "rank" (msprobe's folder when the rank is unknown), ""


@dataclass(frozen=True)
class ImportResult:
    path: Path                        # the capture written
    store: str                        # "stats" | "full"
    records: int
    steps: tuple[int, ...]
    rank: str
    dtype: str | None                 # the run's dominant floating dtype (meta "dtype")
    skipped: tuple[tuple[str, int], ...] = ()   # what was left out, and how many
    notes: tuple[str, ...] = ()


@dataclass
class _Rec:
    key: RecordKey
    kind: str
    leaf: dict
    where: Path                       # the dump.json folder (tensor files are under it)
    sort: tuple
    site: str = ""


@dataclass
class _Counts:
    skipped: Counter = field(default_factory=Counter)
    tasks: set = field(default_factory=set)     # dump.json "task" values seen
    levels: set = field(default_factory=set)    # dump.json "level" values seen


# ----------------------------------------------------------------------------- discovery

def find_dumps(root: str | os.PathLike) -> list[DumpDir]:
    """Every dump.json folder under `root` (itself, a step / rank folder, or a dump.json file),
    sorted by step then rank. UserError when there is none."""
    p = Path(root)
    if p.is_file() and p.name == "dump.json":
        p = p.parent
    if not p.is_dir():
        raise UserError(f"{root}: no such msprobe dump directory (expected a folder with "
                        f"dump.json, or step*/rank*/dump.json under it)")
    found = []
    for f in sorted(_walk_dump_json(p, depth=3)):
        d = f.parent
        step, rank = 0, ""
        names = [x.name for x in (d, d.parent, d.parent.parent)]
        if _RANK_RE.match(names[0]):
            rank = names[0]
            m = _STEP_RE.match(names[1])
            step = int(m.group(1)) if m else 0
        else:
            m = _STEP_RE.match(names[0])
            step = int(m.group(1)) if m else 0
        found.append(DumpDir(d, step, rank))
    if not found:
        raise UserError(f"{root}: not an msprobe dump: no dump.json in it or in its step*/rank*"
                        f" folders; point at the dump_path of msprobe's config")
    return sorted(found, key=lambda x: (x.step, _rank_order(x.rank), str(x.path)))


def _walk_dump_json(d: Path, depth: int) -> Iterator[Path]:
    f = d / "dump.json"
    if f.is_file():
        yield f
        return
    if depth <= 0:
        return
    try:
        subs = sorted(x for x in d.iterdir() if x.is_dir() and x.name != "dump_tensor_data")
    except OSError as e:
        raise UserError(f"{d}: cannot list it ({e.strerror})") from None
    for s in subs:
        yield from _walk_dump_json(s, depth - 1)


def _rank_order(rank: str) -> tuple:
    m = _RANK_RE.match(rank) if rank else None
    if not m:
        return (0, -1, rank)
    num = m.group(1) or m.group(2)
    return (0 if rank.startswith("rank") else 1, int(num) if num else -1, rank)


# ----------------------------------------------------------------------------- JSON files

def _read_json(path: Path, required: bool) -> Any:
    if not path.is_file():
        if required:
            raise UserError(f"{path}: missing; an msprobe dump folder holds dump.json, "
                            f"construct.json and stack.json: re-run the msprobe dump")
        return None
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise UserError(f"{path}: not UTF-8 JSON; the dump is corrupt: re-run the msprobe "
                        f"dump") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: invalid JSON at line {e.lineno} column {e.colno} ({e.msg}); "
                        f"the dump is truncated or corrupt (was msprobe stopped before "
                        f"debugger.stop()?): re-run the msprobe dump") from None
    except OSError as e:
        raise UserError(f"{path}: cannot read it ({e.strerror})") from None


def _load_dump(dd: DumpDir) -> tuple[dict, dict[str, str | None], dict[str, list[str]]]:
    """(dump.json, construct.json as name -> parent, stack.json as name -> frames)."""
    f = dd.path / "dump.json"
    dump = _read_json(f, required=True)
    if not isinstance(dump, dict) or not isinstance(dump.get("data"), dict):
        raise UserError(f"{f}: not an msprobe dump.json (no \"data\" object)")
    fw = dump.get("framework", "pytorch")
    if fw != "pytorch":
        raise UserError(f"{f}: framework {fw!r}: only msprobe's PyTorch dumps are read "
                        f"(MindSpore cells are not nn.Module paths)")
    construct = _read_json(dd.path / "construct.json", required=False) or {}
    if not isinstance(construct, dict) or not all(
            isinstance(v, str) or v is None for v in construct.values()):
        raise UserError(f"{dd.path / 'construct.json'}: expected an object of "
                        f"\"name\": \"parent module\" | null")
    stack = _read_json(dd.path / "stack.json", required=False) or {}
    return dump, construct, _stack_map(stack, dd.path / "stack.json")


def _stack_map(stack: Any, path: Path) -> dict[str, list[str]]:
    """name -> frames. msprobe writes {"0": [[names...], [frames...]], ...} (frames shared by
    names with the same stack); older versions {name: [frames...]}."""
    out: dict[str, list[str]] = {}
    if not isinstance(stack, dict):
        raise UserError(f"{path}: expected a JSON object")
    for k, v in stack.items():
        if isinstance(v, list) and len(v) == 2 and all(isinstance(x, list) for x in v):
            for name in v[0]:
                out[str(name)] = [str(s) for s in v[1]]
        elif isinstance(v, list):
            out[str(k)] = [str(s) for s in v]
    return out


def call_site(frames: Sequence[str]) -> str:
    """The innermost frame outside torch and msprobe, as accucheck writes call sites:
    "transformers/models/llama/modeling_llama.py:64 in forward"; "" when there is none."""
    parsed = []
    for fr in frames:
        m = _FRAME_RE.match(fr.strip())
        if m:
            parsed.append((m.group("file"), m.group("line"), m.group("fn")))
    pick = next((f for f in parsed if not any(s in f[0] for s in _SKIP_FRAMES)),
                parsed[0] if parsed else None)
    if pick is None:
        return ""
    path, line, fn = pick
    i = path.rfind("site-packages" + os.sep)
    if i < 0:
        i = path.rfind("dist-packages" + os.sep)
    short = path[i + 14:] if i >= 0 else os.sep.join(path.split(os.sep)[-3:])
    return f"{short}:{line} in {fn}"


# ----------------------------------------------------------------------------- entries

def _module_of(name: str | None) -> tuple[str, int] | None:
    """"Module.model.layers.0.mlp.LlamaMLP.forward.3" -> ("model.layers.0.mlp", 3)."""
    if not name:
        return None
    m = _MODULE_RE.match(name)
    if not m or m.group("dir") != "forward":
        return None
    return m.group("path"), int(m.group("n"))


def _is_tensor(leaf: dict) -> bool:
    t = leaf.get("type", "")
    return ("Tensor" in t or "Parameter" in t) and "shape" in leaf and "dtype" in leaf


def _leaves(obj: Any, prefix: str) -> Iterator[tuple[str, dict]]:
    """(slot, tensor description) inside an msprobe argument structure. Non-tensor leaves
    ({"type": "int", "value": 3}, null, ...) are skipped."""
    if isinstance(obj, dict):
        if isinstance(obj.get("type"), str) or "class_type" in obj:
            if _is_tensor(obj):
                yield prefix or "0", obj
            return
        for k, v in obj.items():
            s = clean_slot(k)
            yield from _leaves(v, f"{prefix}.{s}" if prefix else s)
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _leaves(v, f"{prefix}.{i}" if prefix else str(i))


def _io(entry: dict, name: str, f: Path) -> tuple[list[tuple[str, dict]], list[tuple[str, dict]]]:
    """(inputs, outputs) of one dump.json entry as (slot, leaf) lists."""
    args, kwargs, out = entry.get("input_args", []), entry.get("input_kwargs", {}), \
        entry.get("output", [])
    if not isinstance(args, list) or not isinstance(kwargs, dict):
        raise UserError(f"{f}: entry {name!r}: input_args must be a list and input_kwargs an "
                        f"object; the dump is corrupt: re-run the msprobe dump")
    ins = list(_leaves(args, ""))
    for k, v in kwargs.items():
        ins += list(_leaves(v, clean_slot(k)))
    if isinstance(out, dict) and isinstance(out.get("type"), str):
        out = [out]  # a single tensor
    outs = list(_leaves(out, "")) if out is not None else []
    return ins, outs


def _dtype(leaf: dict, name: str, f: Path) -> str:
    d = leaf.get("dtype")
    if not isinstance(d, str) or not d:
        raise UserError(f"{f}: entry {name!r}: a tensor without a dtype string")
    return d.replace("torch.", "")


def _shape(leaf: dict, name: str, f: Path) -> tuple[int, ...]:
    s = leaf.get("shape")
    if not isinstance(s, list) or not all(isinstance(x, int) and not isinstance(x, bool)
                                          and x >= 0 for x in s):
        raise UserError(f"{f}: entry {name!r}: tensor shape {s!r} is not a list of "
                        f"non-negative integers; the dump is corrupt")
    return tuple(s)


def _num(v: Any, name: str, f: Path) -> float:
    if v is None:
        return math.nan
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            pass
    raise UserError(f"{f}: entry {name!r}: statistic {v!r} is not a number")


def _signature(leaf: dict) -> tuple:
    return (leaf.get("dtype"), json.dumps(leaf.get("shape")), repr(leaf.get("Max")),
            repr(leaf.get("Min")), repr(leaf.get("Mean")), repr(leaf.get("Norm")),
            leaf.get("md5"))


def stats_row(leaf: dict, shape: tuple[int, ...], name: str = "?", f: Path = Path("?")
              ) -> tuple[np.ndarray, int]:
    """(index statistics row, checksum) from msprobe's Max / Min / Mean / Norm (/ md5)."""
    mx, mn = _num(leaf.get("Max"), name, f), _num(leaf.get("Min"), name, f)
    mean, l2 = _num(leaf.get("Mean"), name, f), _num(leaf.get("Norm"), name, f)
    numel = int(np.prod(shape)) if shape else 1
    # msprobe reduces over every element in the tensor's dtype: a NaN element makes Max / Min
    # NaN, an infinite one makes them infinite; an infinite Mean / Norm with finite Max / Min
    # is the statistic overflowing (float16), not data: unknown
    nan = 1.0 if any(math.isnan(v) for v in (mx, mn)) and numel else 0.0
    inf = 1.0 if any(math.isinf(v) for v in (mx, mn)) else 0.0
    if not inf:
        mean, l2 = (math.nan if math.isinf(v) else v for v in (mean, l2))
    absmax = max(abs(mx), abs(mn)) if not (math.isnan(mx) or math.isnan(mn)) else math.nan
    row = np.array([mn, mx, mean, math.nan, absmax, l2, nan, inf, 0.0, float(numel)],
                   dtype=np.float64)
    md5 = leaf.get("md5")  # CRC32 hex in md5 mode, the XOR checksum in xor mode
    checksum = 0
    if isinstance(md5, int) and not isinstance(md5, bool):
        checksum = md5 % (1 << 52)
    elif isinstance(md5, str):
        try:
            checksum = int(md5, 16) % (1 << 52)
        except ValueError:
            checksum = 0
    return row, checksum


def _has_stats(leaf: dict) -> bool:
    return any(leaf.get(k) is not None for k in ("Max", "Min", "Norm"))


def step_records(dd: DumpDir, counts: _Counts | None = None) -> list[_Rec]:
    """The records of one dump.json folder, in execution order."""
    counts = counts if counts is not None else _Counts()
    dump, construct, stacks = _load_dump(dd)
    f = dd.path / "dump.json"
    counts.tasks.add(str(dump.get("task")))
    counts.levels.add(str(dump.get("level")))
    data: dict = dump["data"]
    names = list(data)
    pos = {n: i for i, n in enumerate(names)}

    # module calls dumped here, and their start positions (first entry inside them)
    start: dict[tuple[str, int], int] = {}
    for i, n in enumerate(names):
        seen = 0
        mc = _module_of(n)
        if mc is not None:
            start[mc] = min(start.get(mc, i), i)
        parent = construct.get(n)
        while parent is not None and seen < 256:
            pm = _module_of(parent)
            if pm is not None:
                start[pm] = min(start.get(pm, i), i)
            parent = construct.get(parent)
            seen += 1
    heads = {mc[0] for mc in start if mc[0].rsplit(".", 1)[-1] in HEAD_NAMES}
    head = next((h for leaf in HEAD_NAMES for h in sorted(heads)
                 if h.rsplit(".", 1)[-1] == leaf), None)

    params: dict[tuple[str, int], set] = {}
    for n in names:
        mc = _module_of(n)
        e = data[n]
        if mc is not None and isinstance(e, dict) and isinstance(e.get("parameters"), dict):
            params[mc] = {_signature(leaf) for _, leaf in _leaves(e["parameters"], "")}

    recs: list[_Rec] = []
    op_count: Counter = Counter()
    for n in names:
        try:
            recs += _entry_records(n, data[n], pos[n], dd, f, construct, stacks, start, head,
                                   params, op_count, counts)
        except ValueError as e:  # a key accucheck cannot build from this entry's names
            raise UserError(f"{f}: entry {n!r}: {e}") from None
    recs.sort(key=lambda r: r.sort)
    return recs


def _entry_records(n: str, e: Any, i: int, dd: DumpDir, f: Path, construct: dict,
                   stacks: dict, start: dict, head: str | None, params: dict,
                   op_count: Counter, counts: _Counts) -> list[_Rec]:
    recs: list[_Rec] = []
    step = dd.step
    if not isinstance(e, dict):
        raise UserError(f"{f}: entry {n!r} is not an object; the dump is corrupt: re-run "
                        f"the msprobe dump")
    m = _MODULE_RE.match(n)
    a = None if m else _API_RE.match(n)
    if m is None and (a is None or a.group("prefix") in ("Module", "Cell")):
        counts.skipped["unrecognised entries"] += 1
        return recs
    if (m or a).group("dir") == "backward":
        counts.skipped["backward entries"] += 1
        return recs
    if isinstance(e.get("parameters"), dict):
        counts.skipped["weights (parameters)"] += sum(1 for _ in _leaves(e["parameters"], ""))
    ins, outs = _io(e, n, f)
    if m is not None:
        path, call = m.group("path"), int(m.group("n"))
        depth = path.count(".")
        if path == head:
            counts.skipped["head inputs"] += len(ins)
            recs += [_rec(RecordKey(0, step, LOGITS_MODULE, call, "out", slot), "logits",
                          leaf, dd, (i, 2, 0, j), n, f)
                     for j, (slot, leaf) in enumerate(outs[:1])]
            counts.skipped["head outputs beyond the first"] += len(outs[1:])
            return recs
        s = start.get((path, call), i)
        recs += [_rec(RecordKey(0, step, path, call, "in", slot), "module", leaf, dd,
                      (s, 0, depth, j), n, f) for j, (slot, leaf) in enumerate(ins)]
        recs += [_rec(RecordKey(0, step, path, call, "out", slot), "module", leaf, dd,
                      (i, 2, 0, j), n, f) for j, (slot, leaf) in enumerate(outs)]
        return recs
    parent = _module_of(construct.get(n))
    mod, call = parent if parent is not None else (TOP_MODULE, 0)
    op = f"{a.group('prefix')}.{a.group('api')}"
    idx = op_count[(mod, call)]
    op_count[(mod, call)] += 1
    weights = params.get((mod, call), set())
    kept = []
    for slot, leaf in ins:
        if weights and _signature(leaf) in weights:
            counts.skipped["weight inputs of APIs"] += 1
        else:
            kept.append((slot, leaf))
    site = call_site(stacks.get(n, ()))
    recs += [_rec(RecordKey(0, step, mod, call, "in", slot, op, idx), "op", leaf, dd,
                  (i, 1, 0, j), n, f) for j, (slot, leaf) in enumerate(kept)]
    outr = [_rec(RecordKey(0, step, mod, call, "out", slot, op, idx), "op", leaf, dd,
                 (i, 2, 0, j), n, f) for j, (slot, leaf) in enumerate(outs)]
    if outr:
        outr[0].site = site
    else:
        counts.skipped["APIs without a tensor output"] += 1
    recs += outr
    return recs


def _rec(key: RecordKey, kind: str, leaf: dict, dd: DumpDir, sort: tuple, name: str,
         f: Path) -> _Rec:
    _dtype(leaf, name, f)  # validated here, once: a malformed entry is named in the error
    _shape(leaf, name, f)
    return _Rec(key, kind, leaf, dd.path, sort)


# ----------------------------------------------------------------------------- tensors

def _tensor_file(where: Path, leaf: dict) -> Path | None:
    name = leaf.get("data_name")
    if not isinstance(name, str) or not name:
        return None
    if name.startswith("name:"):
        name = name.split(":", 1)[1]
    if "/" in name or "\\" in name or name in (".", "..") or "\0" in name:
        raise UserError(f"{where / 'dump.json'}: data_name {name!r} is not a plain file name; "
                        f"refusing to read outside dump_tensor_data/")
    return where / "dump_tensor_data" / name


def load_tensor(path: Path):
    """One msprobe tensor file as a torch tensor, read ONLY with torch's restricted unpickler
    (`torch.load(weights_only=True)`) or, for .npy, `numpy.load(allow_pickle=False)`. Anything
    else in the file is refused (UserError). Imports torch."""
    import pickle

    import torch

    if not path.is_file():
        raise UserError(f"{path}: tensor file missing (dump.json names it); the dump is "
                        f"incomplete: re-run the msprobe dump, or import it with --store stats")
    try:
        with warnings.catch_warnings():  # e.g. "Detected pickle protocol 4": refused below
            warnings.simplefilter("ignore")
            if path.suffix == ".npy":
                t = torch.from_numpy(np.load(path, allow_pickle=False))
            else:
                t = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, OSError,
            AttributeError, TypeError) as e:
        first = _torch_reason(str(e))
        raise UserError(f"{path}: not readable as a plain tensor with "
                        f"torch.load(weights_only=True) ({e.__class__.__name__}: {first}); "
                        f"truncated, or it holds more than tensors (accucheck never runs an "
                        f"unrestricted unpickler)") from None
    if not isinstance(t, torch.Tensor):
        raise UserError(f"{path}: holds a {type(t).__name__}, not a tensor")
    return t


_TORCH_BOILERPLATE = ("Weights only load failed", "Please file an issue", "Check the documentation",
                      "Re-running `torch.load`")


def _torch_reason(text: str) -> str:
    """The informative line of a torch.load error ("Trying to load unsupported GLOBAL
    posix.system ...", "Unsupported operand 149", "... failed finding central directory"),
    without torch's advice to retry with weights_only=False."""
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(_TORCH_BOILERPLATE):
            return line[:160]
    return text.strip().splitlines()[0][:80] if text.strip() else ""


def _tensor_row(t) -> tuple[np.ndarray, int, np.ndarray, str]:
    """(statistics row + sample, checksum, stored array, dtype name), as accucheck's recorder
    computes them."""
    from accucheck.capture.record.recorder import finish_stats
    from accucheck.capture.record.stats import tensor_stats, to_host

    raw = tensor_stats(t).cpu().numpy()
    host, dtype = to_host(t)
    row = finish_stats(raw, t.numel(), host)
    return row, int(raw[7]), host, dtype


# ----------------------------------------------------------------------------- import

def import_msprobe(dump: str | os.PathLike, out: str | os.PathLike, *,
                   rank: int | str | None = None, steps: Sequence[int] | None = None,
                   store: str | None = None, force: bool = False, compression: str | None = None,
                   progress: Callable[[str], None] | None = None) -> ImportResult:
    """Write the capture `out` from the msprobe dump `dump` (see the module docstring).

    `rank`: the rank to import (an int for rank{R} folders, or a folder name such as
    "proc1234"); default the first one found, the others are listed in meta. `steps`: only
    these msprobe steps. `store`: "full" (default for tensor-mode dumps: the tensors) or "stats"
    (statistics only: msprobe's own for a statistics dump, accucheck's computed from the tensors
    would need them loaded, so "stats" on a tensor dump keeps msprobe's statistics and reads no
    tensor file). Raises UserError (exit 3) for a missing, malformed or truncated dump.
    """
    chosen, ranks, by_step = _chosen_dumps(dump, rank, steps)
    counts = _Counts()
    recs: list[_Rec] = []
    for s in sorted(by_step):
        recs += step_records(by_step[s][0], counts)
    if len(counts.tasks) > 1:
        raise UserError(f"{dump}: mixes msprobe tasks {sorted(counts.tasks)}: import the "
                        f"statistics and the tensor dumps separately")
    store = _store_mode(dump, recs, counts, store)
    dt = Counter(r.leaf.get("dtype", "").replace("torch.", "") for r in recs
                 if r.key.role == "out" and _floating(r.leaf.get("dtype", "")))
    dominant = dt.most_common(1)[0][0] if dt else None
    notes = _notes(store, len(by_step), ranks, chosen)
    meta = {
        **meta_header(RUNNER), "device": "unknown (msprobe dump)", "dtype": dominant,
        "mode": "unknown (msprobe dump)", "environment": {},
        "msprobe": _msprobe_meta(dump, counts, chosen, ranks, by_step, dt, notes),
    }
    out = Path(out)
    n_written, skipped = _write_capture(out, meta, recs, counts, store, force=force,
                                        compression=compression, progress=progress)
    return ImportResult(out, store, n_written, tuple(sorted(by_step)), chosen, dominant,
                        tuple(skipped.items()), tuple(notes))


def _chosen_dumps(dump: str | os.PathLike, rank: int | str | None,
                  steps: Sequence[int] | None) -> tuple[str, list[str], dict[int, list[DumpDir]]]:
    """The rank imported, every rank found, and the chosen rank's dump folders by step (one
    each: two for one step is refused, as are a rank or a step not found)."""
    dirs = find_dumps(dump)
    ranks = sorted({d.rank for d in dirs}, key=_rank_order)
    if rank is None:
        chosen = ranks[0]
    else:
        want = rank if isinstance(rank, str) and not str(rank).isdigit() else f"rank{int(rank)}"
        if want not in ranks:
            found = ", ".join(r or "-" for r in ranks)
            raise UserError(f"{dump}: no {want} folder (found: {found}); choose with --rank")
        chosen = want
    dirs = [d for d in dirs if d.rank == chosen]
    if steps is not None:
        wanted = {int(s) for s in steps}
        missing = sorted(wanted - {d.step for d in dirs})
        if missing:
            raise UserError(f"{dump}: no step{missing[0]} folder for {chosen or 'the dump'} "
                            f"(found steps {', '.join(str(d.step) for d in dirs)})")
        dirs = [d for d in dirs if d.step in wanted]
    by_step: dict[int, list[DumpDir]] = {}
    for d in dirs:
        by_step.setdefault(d.step, []).append(d)
    dup = [s for s, ds in by_step.items() if len(ds) > 1]
    if dup:
        raise UserError(f"{dump}: step {dup[0]} has {len(by_step[dup[0]])} dump.json folders "
                        f"for {chosen or 'one rank'}: point at one of them")
    return chosen, ranks, by_step


def _store_mode(dump: str | os.PathLike, recs: list[_Rec], counts: _Counts,
                store: str | None) -> str:
    """`store` checked, default "full" when the dump names tensor files, else "stats".
    Refuses a dump without forward tensors and a statistics import of checksums only; counts
    the floating records without statistics in `counts.skipped`."""
    has_data = any(isinstance(r.leaf.get("data_name"), str) for r in recs)
    if store is None:
        store = "full" if has_data else "stats"
    if store not in ("stats", "full"):
        raise UserError(f"unknown store mode {store!r}: use stats or full")
    if not recs:
        raise UserError(f"{dump}: the dump holds no forward tensor (only {dict(counts.skipped)}"
                        f"): dump with task statistics or tensor and level L0, mix or L1")

    floating = [r for r in recs if _floating(r.leaf.get("dtype", ""))]
    bare = sum(not _has_stats(r.leaf) for r in floating)
    if store == "stats" and floating and bare == len(floating):
        raise UserError(f"{dump}: msprobe dumped no Max / Min / Mean / Norm (checksums only: "
                        f"summary_mode xor?): accucheck cannot measure an error from them; "
                        f"re-dump with summary_mode statistics or md5, or task tensor")
    if bare and store == "stats":
        counts.skipped["floating records without statistics (compared by shape only)"] = bare
    return store


def _notes(store: str, n_steps: int, ranks: list[str], chosen: str) -> list[str]:
    """What the import maps and how (meta "msprobe" "notes", ImportResult.notes)."""
    notes = [
        "requests: not mapped (msprobe dumps no token ids; a vLLM step batches every request): "
        "every record is request 0 and the capture holds no /requests",
        f"steps: msprobe step N -> accucheck step N ({n_steps} imported)",
        "op records: enclosing module from construct.json, op index counted inside each module "
        "call; msprobe's global per-API counters are not used for matching",
    ]
    if store == "stats":
        notes.append("statistics: min/max/mean/l2 from msprobe's Min/Max/Mean/Norm; std, zero "
                     "counts not dumped; NaN/Inf counts are 1 when a statistic is NaN/Inf")
    if len(ranks) > 1:
        notes.append(f"ranks: imported {chosen}; not imported: "
                     f"{', '.join(r for r in ranks if r != chosen)}")
    return notes


def _msprobe_meta(dump: str | os.PathLike, counts: _Counts, chosen: str, ranks: list[str],
                  by_step: dict[int, list[DumpDir]], dt: Counter, notes: list[str]) -> dict:
    """The capture's meta "msprobe" before the write (records and skipped are added after)."""
    task = next(iter(counts.tasks), None)
    levels = counts.levels
    return {
        "source": str(Path(dump).resolve()), "task": task,
        "level": sorted(levels) if len(levels) > 1 else next(iter(levels), None),
        "rank": chosen, "ranks_found": ranks, "steps": sorted(by_step),
        "dump_dirs": [str(by_step[s][0].path) for s in sorted(by_step)],
        "dtypes": dict(dt), "notes": notes,
    }


def _write_capture(out: Path, meta: dict, recs: list[_Rec], counts: _Counts, store: str, *,
                   force: bool, compression: str | None,
                   progress: Callable[[str], None] | None) -> tuple[int, dict[str, int]]:
    """Write `recs` to `out` (a duplicate key is skipped and counted); the records written and
    what was skipped, also in meta. A failed write leaves no new file behind."""
    n_written = 0
    seen: set[str] = set()
    w = CaptureWriter(out, meta=meta, store=store, force=force, compression=compression)
    try:  # from here on the file is ours: a failed import leaves none behind
        for k, r in enumerate(recs):
            sk = str(r.key)
            if sk in seen:
                counts.skipped["duplicate keys"] += 1
                continue
            seen.add(sk)
            _write(w, r, store)
            n_written += 1
            if progress and k and k % PROGRESS_EVERY == 0:
                progress(f"import: {k}/{len(recs)} records")
        skipped = {k: v for k, v in sorted(counts.skipped.items()) if v}
        w.update_meta(msprobe=dict(meta["msprobe"], records=n_written, skipped=skipped))
    except BaseException:
        # replacing a file (--force): the writer discards the new one and the old one stays;
        # else the file is this import's own, half written: removed
        w.close(complete=False)
        if not getattr(w, "replacing", False):
            out.unlink(missing_ok=True)
        raise
    w.close(complete=True)
    return n_written, skipped


def _write(w: CaptureWriter, r: _Rec, store: str) -> None:
    leaf, name, f = r.leaf, str(r.key), r.where / "dump.json"
    shape = _shape(leaf, name, f)
    dtype = _dtype(leaf, name, f)
    extra = json.dumps({"site": r.site}) if r.site else ""
    tf = _tensor_file(r.where, leaf) if store == "full" else None
    if tf is not None:
        t = load_tensor(tf)
        row, checksum, host, tdtype = _tensor_row(t)
        if tuple(t.shape) != shape or tdtype != dtype:
            raise UserError(f"{tf}: holds a {tdtype} tensor of shape {list(t.shape)}, dump.json "
                            f"says {dtype} {list(shape)}; the dump is inconsistent")
        w.add(r.key, r.kind, dtype, shape, row, checksum, host, extra=extra)
        return
    row, checksum = stats_row(leaf, shape, str(r.key), f)
    w.add(r.key, r.kind, dtype, shape, row, checksum, None, extra=extra)


def _floating(dtype: str) -> bool:
    d = dtype.replace("torch.", "")
    return d.startswith(("float", "bfloat", "half", "double")) or d in ("bfloat16",)

