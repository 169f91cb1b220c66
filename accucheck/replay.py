"""Op replay from a capture file: the per-op referee. Imports torch, keys, store, metrics,
tolerances; torch_npu only through the device layer (lazily, for --device npu).

`replay_ops(ref_path, ops=[...], device="cpu", golden=True)` -> `ReplayResult`:
each selected op call of REF (a `--level op --store full --inputs` capture) is called again,
from its recorded inputs and its recorded arguments (/index/extra "args" / "kwargs"):

- here: on `device`, inputs in their recorded dtypes;
- golden (default): on the CPU with every floating input, and every floating dtype argument,
  in float64 (a cast to bfloat16 in the op becomes a float64 no-op: the golden is ideal math).

and reports err(recorded ref device, golden), err(here, golden) and err(here, recorded), as
rel_l2 (accucheck.compare.metrics), with a referee label: "here worse" / "ref worse" / "both within
noise" (RMSE ratio above GOLDEN_MULTIPLIER plus a noise floor, like the diff's golden labels).

Selection: `ops` are record keys or globs matched against the op call
("r0.s0:model.layers.1.mlp#0/aten.silu.default@1"), any of its record keys, or the op name
("aten.silu*"). Ops that cannot be called here (a torch_npu op on a GPU box, arguments the
capture could only describe by repr) are listed with the reason, never crash the run.
"""
from __future__ import annotations

import fnmatch
import json
import math
import os
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from accucheck.errors import UserError
from accucheck.compare.metrics import tensor_metrics
from accucheck.compare.opmatch import OpCall, op_calls
from accucheck.store import CaptureReader, open_capture
from accucheck.compare.tolerances import GOLDEN_MULTIPLIER, DEFAULT_REL_L2, loosest_dtype

LABELS = ("here worse", "ref worse", "both within noise")


@dataclass(frozen=True)
class OpReplay:
    ident: str                    # op call: "r0.s0:model.layers.1.mlp#0/aten.silu.default@1"
    op: str
    dtype: str                    # recorded dtype of the first output
    site: str
    ran: bool
    why: str | None               # why it did not run (ran False)
    here_vs_recorded: float | None    # rel_l2(recorded output, output here)
    ref_vs_golden: float | None       # rel_l2(golden, recorded output)
    here_vs_golden: float | None      # rel_l2(golden, output here)
    label: str | None                 # one of LABELS, None without golden

    @property
    def within(self) -> bool:
        return self.label != "here worse"


@dataclass(frozen=True)
class ReplayResult:
    ref_path: str
    device: str
    ops: tuple[OpReplay, ...]

    @property
    def within(self) -> bool:
        return all(o.within for o in self.ops)

    def __bool__(self) -> bool:
        return self.within

    @property
    def exit_code(self) -> int:
        return 0 if self.within else 1


def _resolve(name: str):
    import torch

    ns, rest = name.split(".", 1)
    opname, overload = rest.rsplit(".", 1) if "." in rest else (rest, "default")
    try:
        return getattr(getattr(getattr(torch.ops, ns), opname), overload)
    except (AttributeError, RuntimeError):
        raise LookupError(f"operator {name} is not available here (its library, e.g. "
                          f"torch_npu or vLLM, is not loaded)") from None


def _decode(obj: Any, tensors: dict, golden: bool):
    import torch

    if isinstance(obj, list):
        return [_decode(v, tensors, golden) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "t" in obj:
        if obj["t"] not in tensors:
            raise LookupError(f"input {obj['t']} was not recorded (capture with --inputs)")
        return tensors[obj["t"]]
    if "dtype" in obj:
        dt = getattr(torch, obj["dtype"])
        return torch.float64 if golden and dt.is_floating_point else dt
    if "device" in obj:
        return None if golden else torch.device(obj["device"])
    if "layout" in obj:
        return getattr(torch, obj["layout"])
    if "memory_format" in obj:
        return getattr(torch, obj["memory_format"])
    if "float" in obj:
        return float(obj["float"])
    raise LookupError(f"argument {obj.get('repr', obj)!r} cannot be rebuilt from the capture")


def _first_output(out) -> Any:
    import torch

    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise LookupError("the op returned no tensor")


def _select(calls: list[OpCall], patterns: Sequence[str]) -> list[OpCall]:
    if not patterns:
        return calls
    out = []
    for c in calls:
        names = [c.ident, c.op] + [str(r.key) for r in c.outs + c.ins]
        if any(fnmatch.fnmatchcase(n, p) for p in patterns for n in names):
            out.append(c)
    return out


def replay_ops(ref: str | os.PathLike, ops: Sequence[str] = (), *, device: str = "cpu",
               golden: bool = True, limit: int | None = 50) -> ReplayResult:
    """Replay the selected op calls of `ref` here (and in float64 on the CPU); see the module
    docstring. Raises UserError when the capture has no replayable op records, nothing
    matches `ops`, or none of the selected ops could run (nothing checked is not a pass)."""
    from accucheck.capture import device as dev

    if limit is not None and limit < 1:
        raise UserError.usage(f"--limit {limit}: replay at least one op")
    spec = dev.parse_device(device)
    tdev = dev.torch_device(spec)
    with open_capture(ref) as R:
        if R.store_mode != "full":
            raise UserError(f"{ref}: statistics only; replay needs a capture made with "
                            f"--level op --store full --inputs")
        groups = op_calls(R.rows)
        calls = [c for seq in groups.values() for c in seq]
        if not calls:
            raise UserError(f"{ref}: no op records; capture with --level op --store full --inputs")
        chosen = _select(calls, ops)
        if not chosen:
            raise UserError(f"no op in {ref} matches {', '.join(ops)}: run `accucheck inspect "
                            f"{ref} --filter '*/aten.*'` to list op records")
        if limit is not None and len(chosen) > limit:
            chosen = chosen[:limit]
        results = [_replay_one(R, c, tdev, golden) for c in chosen]
    ran = [o for o in results if o.ran]
    if not ran:
        why = results[0].why if results else "nothing selected"
        raise UserError(f"nothing replayed: none of the {len(results)} selected op call(s) of "
                        f"{ref} could run here (first: {why}); capture the reference with "
                        f"--level op --store full --inputs")
    if golden and not any(o.label is not None for o in ran):
        raise UserError(f"nothing refereed: {len(ran)} op call(s) of {ref} ran here but none "
                        f"could be run in float64 on the CPU; pass --no-golden to compare with "
                        f"the recorded outputs only")
    return ReplayResult(str(ref), str(spec), tuple(results))


def _replay_one(R: CaptureReader, c: OpCall, tdev, golden: bool) -> OpReplay:
    import torch

    out_row = c.outs[0]
    base = dict(ident=c.ident, op=c.op, dtype=out_row.dtype, site=c.site)
    try:
        extra = json.loads(out_row.extra) if out_row.extra else None
        if not extra or "args" not in extra:
            raise LookupError("no recorded arguments (captured by an older accucheck)")
        func = _resolve(c.op)
        recorded = R.read(out_row.key)
        ins = {r.key.slot: (R.read(r.key), r.dtype) for r in c.ins if r.has_data}

        def tensors(on, golden_mode: bool) -> dict:
            out = {}
            for slot, (arr, dt) in ins.items():
                t = torch.from_numpy(np.ascontiguousarray(arr))
                want = getattr(torch, dt)
                if golden_mode and want.is_floating_point:
                    want = torch.float64
                out[slot] = t.to(device=on, dtype=want)
            return out

        def call(on, golden_mode: bool) -> np.ndarray:
            ts = tensors(on, golden_mode)
            a = [_decode(v, ts, golden_mode) for v in extra["args"]]
            kw = {k: _decode(v, ts, golden_mode) for k, v in extra["kwargs"].items()}
            if golden_mode:
                kw = {k: v for k, v in kw.items() if not (k == "device" and v is None)}
            with torch.no_grad():
                t = _first_output(func(*a, **kw))
            return t.detach().to("cpu", torch.float64 if t.is_floating_point() else t.dtype
                                 ).numpy()

        here = call(tdev, False)
    except (LookupError, RuntimeError, TypeError, ValueError) as e:
        return OpReplay(**base, ran=False, why=str(e).splitlines()[0][:200],
                        here_vs_recorded=None, ref_vs_golden=None, here_vs_golden=None,
                        label=None)
    hr = tensor_metrics(recorded, here, out_row.dtype, out_row.dtype).rel_l2
    rg = hg = label = None
    if golden:
        try:
            g = call(torch.device("cpu"), True)
        except (LookupError, RuntimeError, TypeError, ValueError):
            g = None
        if g is not None and g.shape == recorded.shape:
            rg = tensor_metrics(g, recorded, "float64", out_row.dtype).rel_l2
            hg = tensor_metrics(g, here, "float64", out_row.dtype).rel_l2
            label = _label(g, recorded, here, out_row.dtype)
    return OpReplay(**base, ran=True, why=None, here_vs_recorded=hr, ref_vs_golden=rg,
                    here_vs_golden=hg, label=label)


def _label(g: np.ndarray, ref: np.ndarray, here: np.ndarray, dtype: str) -> str:
    g64, r64, h64 = (np.asarray(x, dtype=np.float64).reshape(-1) for x in (g, ref, here))
    m = np.isfinite(g64) & np.isfinite(r64) & np.isfinite(h64)
    g64, r64, h64 = g64[m], r64[m], h64[m]
    n = max(g64.size, 1)
    er = math.sqrt(float(np.dot(r64 - g64, r64 - g64)) / n)
    eh = math.sqrt(float(np.dot(h64 - g64, h64 - g64)) / n)
    gg = math.sqrt(float(np.dot(g64, g64)) / n)
    d = loosest_dtype([dtype])
    mult = GOLDEN_MULTIPLIER.get(d, 3.0)
    floor = 0.1 * DEFAULT_REL_L2.get(d, 0.0) * gg
    if eh > mult * er + floor:
        return "here worse"
    if er > mult * eh + floor:
        return "ref worse"
    return "both within noise"


def render(result: ReplayResult, fmt: str = "table") -> str:
    if fmt == "json":
        def num(x):
            return x if not (isinstance(x, float) and not math.isfinite(x)) else repr(x)
        return json.dumps({"ref": result.ref_path, "device": result.device,
                           "verdict": "pass" if result.within else "fail",
                           "ops": [{k: num(v) for k, v in o.__dict__.items()}
                                   for o in result.ops]}, indent=1) + "\n"
    from tabulate import tabulate

    def g(x):
        return "-" if x is None else ("0" if x == 0 else f"{x:.3g}")
    rows = [[o.ident, o.dtype, g(o.ref_vs_golden), g(o.here_vs_golden), g(o.here_vs_recorded),
             o.label or ("-" if o.ran else f"not run: {o.why}")] for o in result.ops]
    worse = [o for o in result.ops if o.label == "here worse"]
    ran = sum(o.ran for o in result.ops)
    skipped = f" ({len(result.ops) - ran} could not run, listed below)" if ran < len(result.ops) \
        else ""
    head = (f"PASS: {ran} op(s) replayed on {result.device}{skipped}: none computes further "
            f"from float64 than the reference device") if result.within else \
        (f"FAIL: {len(worse)} of {len(result.ops)} op(s) compute further from float64 on "
         f"{result.device} than on the reference device; first {worse[0].ident} "
         f"({worse[0].site})")
    return head + "\n" + tabulate(rows, ["op call", "dtype", "ref vs f64", "here vs f64",
                                         "here vs ref", "referee"], tablefmt="simple",
                                  disable_numparse=True) + "\n"
