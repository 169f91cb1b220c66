"""Capture overhead and file size on the built-in tiny Llama (module level), with Huawei msprobe
measured beside it in the same run. Not a test.

    python bench/bench_capture.py [--threads 1] [--repeats 20] [--seqs 64,512] [--no-msprobe]
    python bench/bench_capture.py --arch qwen3_moe --no-msprobe    # the tiny mixture of experts

For each sequence length, one prefill forward (no KV cache) of the tiny Llama (4 layers, hidden
256, 2.9M parameters) on the CPU:

- plain: the forward alone;
- accucheck stats, coarse selection: statistics of the embeddings, each decoder layer, its
  attention, MLP and norms, the final norm and the logits (the default before the leaves were
  recorded), plus the "in" records the producer links need;
- accucheck stats / full, every module: the default selection (down to the leaf Linear, the
  activation, the norms, rotary), statistics only / tensors too; and stats without the sketch
  (accucheck.store.sketch): what it costs;
- msprobe statistics / tensor L0 (mindstudio-probe's PrecisionDebugger, level L0: every
  module's forward inputs and outputs), when it is installed: each in a child process of its
  own (msprobe patches torch process-wide), on the same model and token ids.

With `--arch qwen3_moe` (the tiny Qwen3-MoE, accucheck.capture.tiny) the routers' three
outputs keep their values in stats mode, as a capture does (accucheck.capture.record.moe), and one
more row measures stats mode without them: what the routing records cost.

Times are medians over `--repeats` forwards, the captured forward alternating with a plain one
(so a change of machine load hits both), reported as ratios to the plain forward of the same
process. Sizes are bytes written per forward. The load average before and after is printed:
on a shared machine the numbers are only as good as that.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # runnable from a source checkout
    sys.path.insert(0, str(ROOT))

MIB = 1024 * 1024


def load_model(threads: int, arch: str = "llama"):
    import torch
    from transformers import AutoModelForCausalLM

    from accucheck.capture.tiny import tiny_model_dir

    torch.set_num_threads(threads)
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir(arch=arch),
                                                local_files_only=True).eval()


def token_ids(model, seq: int):
    import torch

    return torch.randint(0, model.config.vocab_size, (1, seq),
                         generator=torch.Generator().manual_seed(seq))


def median_time(fn, repeats: int) -> float:
    """Median seconds of `fn` over `repeats` calls after one warm-up (bench/bench_ops.py)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def alternate(plain, captured, repeats: int) -> tuple[float, float, float]:
    """(median wall seconds of `plain`, of `captured`, ratio of their median CPU seconds), run
    alternately after one warm-up each. The CPU time of this process is what a loaded machine
    disturbs least (waiting for a core is not in it)."""
    plain(), captured()
    p, c, pc, cc = [], [], [], []
    for _ in range(repeats):
        for fn, out, cpu in ((plain, p, pc), (captured, c, cc)):
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            out.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    return statistics.median(p), statistics.median(c), statistics.median(cc) / statistics.median(pc)


def coarse_modules(model) -> list[str]:
    """The default selection before it reached the leaves: embeddings, layer blocks, their
    attention / MLP / norms, the final norm."""
    keep = ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")
    out = []
    for name, _ in model.named_modules():
        parts = name.split(".")
        if name in ("model.embed_tokens", "model.norm") or (
                len(parts) == 3 and parts[1] == "layers") or (
                len(parts) == 4 and parts[1] == "layers" and parts[3] in keep):
            out.append(name)
    return out


def bench_accucheck(model, seq: int, repeats: int, tmp: Path) -> dict:
    import torch

    from accucheck.capture.record.moe import find_routers
    from accucheck.capture.record.recorder import Recorder
    from accucheck.capture.record.selection import select_modules
    from accucheck.store import CaptureWriter, open_capture

    gates = [r.gate for r in find_routers(model)]
    ids = token_ids(model, seq)
    plain_model = copy.deepcopy(model)  # never hooked: the plain forward runs no hook at all

    def plain():
        with torch.no_grad():
            plain_model(input_ids=ids, use_cache=False)

    out: dict = {"seq": seq}
    runs = [("coarse", coarse_modules(model), "stats", gates),
            ("stats", select_modules(model), "stats", gates),
            ("full", select_modules(model), "full", gates)]
    if gates:  # what keeping the routing records' values costs
        runs.append(("stats, no routing values", select_modules(model), "stats", []))
    runs.append(("stats, no sketch", select_modules(model), "stats", gates))  # what the
    # sketch costs (accucheck.store.sketch: one log1p per element)
    for label, modules, store, keep in runs:
        path = tmp / f"bench-{label}-{seq}.h5"
        writer = CaptureWriter(path, meta={"bench": True}, store=store, force=True)
        rec = Recorder(model, writer, modules, keep=keep)
        if label == "stats, no sketch":
            rec.stats.sketch = False
        counter = {"req": 0}

        def captured():
            rec.begin_step(counter["req"], 0)
            with torch.no_grad():
                o = model(input_ids=ids, use_cache=False)
            rec.end_step(o.logits)
            counter["req"] += 1

        with rec.hooks():
            p, c, cpu = alternate(plain, captured, repeats)
        writer.close()
        n = counter["req"]
        out[label] = {"ratio": c / p, "cpu_ratio": cpu, "plain_s": p,
                      "records": writer.n_records // n,
                      "bytes_per_forward": path.stat().st_size / n}
        if store == "full":
            with open_capture(path) as r:
                held = sum(int(torch.tensor(row.shape).prod()) * (2 if "16" in row.dtype else 4)
                           for row in r.rows)
            out[label]["activation_bytes_per_forward"] = held / n
        path.unlink()
    return out


# -- msprobe (child processes) -----------------------------------------------------------------
def msprobe_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("mindstudio-probe")
    except Exception:
        return None


def msprobe_child(task: str, seq: int, repeats: int, threads: int) -> dict:
    """In a process of its own: plain forward (on a copy msprobe never touches) alternating
    with the msprobe-dumped forward; bytes of the dump per forward."""
    import torch

    model = load_model(threads)
    plain_model = copy.deepcopy(model)
    ids = token_ids(model, seq)
    work = Path(tempfile.mkdtemp(prefix="bench-msprobe-"))
    try:
        dump = work / "dump"
        cfg = {"task": task, "dump_path": str(dump), "rank": [], "step": [], "level": "L0",
               "async_dump": False,
               "statistics": {"scope": [], "list": [], "data_mode": ["all"],
                              "summary_mode": "statistics"},
               "tensor": {"scope": [], "list": [], "data_mode": ["all"]}}
        (work / "config.json").write_text(json.dumps(cfg))
        from msprobe.pytorch import PrecisionDebugger

        dbg = PrecisionDebugger(config_path=str(work / "config.json"))
        forwards = [0]

        def plain():
            with torch.no_grad():
                plain_model(input_ids=ids, use_cache=False)

        def dumped():
            dbg.start(model)
            with torch.no_grad():
                model(input_ids=ids, use_cache=False)
            dbg.stop()
            dbg.step()
            forwards[0] += 1

        p, c, cpu = alternate(plain, dumped, repeats)
        size = sum(f.stat().st_size for f in dump.rglob("*") if f.is_file())
        return {"ratio": c / p, "cpu_ratio": cpu, "plain_s": p,
                "bytes_per_forward": size / forwards[0]}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def bench_msprobe(task: str, seq: int, repeats: int, threads: int) -> dict | str:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--msprobe-child", task,
           "--seqs", str(seq), "--repeats", str(repeats), "--threads", str(threads)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH",
                                                                                  "")]))
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env=env)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode or not lines:
        return f"failed ({p.returncode}): {(p.stderr or p.stdout).strip()[-300:]}"
    return json.loads(lines[-1])


# -- report ------------------------------------------------------------------------------------
def table(rows: list[dict], have_msprobe: bool, key: str = "ratio") -> str:
    def x(v):
        return f"{v:.2f}×"

    r0 = rows[0]
    head = ["seq", f"accucheck stats, coarse selection ({r0['coarse']['records']} records)",
            f"accucheck stats, every module ({r0['stats']['records']})",
            "msprobe statistics L0", "accucheck full, every module", "msprobe tensor L0"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        ms, mt = r.get("msprobe statistics"), r.get("msprobe tensor")

        def m(v, size=False):
            if not have_msprobe:
                return "not installed"
            if not isinstance(v, dict):
                return "failed"
            return x(v[key]) + (f", {v['bytes_per_forward'] / MIB:.1f} MiB" if size else "")
        full = r["full"]
        lines.append("| " + " | ".join([
            str(r["seq"]), x(r["coarse"][key]), x(r["stats"][key]), m(ms),
            f"{x(full[key])}, {full['bytes_per_forward'] / MIB:.1f} MiB/forward",
            m(mt, size=True)]) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--seqs", default="64,512")
    ap.add_argument("--no-msprobe", action="store_true", help="measure accucheck only")
    ap.add_argument("--arch", default="llama", help="tiny architecture (accucheck tiny-model "
                    "--arch): llama, qwen3_moe, ...")
    ap.add_argument("--msprobe-child", choices=["statistics", "tensor"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    seqs = [int(s) for s in args.seqs.split(",")]
    if args.msprobe_child:
        print(json.dumps(msprobe_child(args.msprobe_child, seqs[0], args.repeats, args.threads)))
        return
    import torch

    from accucheck.capture.record.stats import kernel_status

    model = load_model(args.threads, args.arch)
    version = None if args.no_msprobe or args.arch != "llama" else msprobe_version()
    said = version or ("not measured (--no-msprobe)" if args.no_msprobe else
                       "not installed (pip install mindstudio-probe to measure it beside "
                       "accucheck); accucheck only")
    load0 = os.getloadavg()
    print(f"tiny {args.arch}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, "
          f"{args.threads} thread(s), {args.repeats} repeats, torch {torch.__version__}, "
          f"CPU statistics kernel: {kernel_status()['cpu']}, msprobe: {said}")
    print(f"load average before: {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f} "
          f"({os.cpu_count()} CPUs)")
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for seq in seqs:
            r = bench_accucheck(model, seq, args.repeats, Path(d))
            if version:
                for task in ("statistics", "tensor"):
                    r[f"msprobe {task}"] = bench_msprobe(task, seq, args.repeats, args.threads)
            rows.append(r)
            full = r["full"]
            print(f"seq {seq:4d}: plain {r['stats']['plain_s'] * 1e3:7.2f} ms | stats coarse "
                  f"{r['coarse']['ratio']:.2f}x, every module {r['stats']['ratio']:.2f}x "
                  f"(CPU {r['stats']['cpu_ratio']:.2f}x) | full {full['ratio']:.2f}x "
                  f"(CPU {full['cpu_ratio']:.2f}x), "
                  f"{full['bytes_per_forward'] / MIB:.2f} MiB/forward "
                  f"(activations its records hold "
                  f"{full['activation_bytes_per_forward'] / MIB:.2f} MiB, file / activations "
                  f"{full['bytes_per_forward'] / full['activation_bytes_per_forward']:.2f}) | "
                  f"stats file {r['stats']['bytes_per_forward'] / 1024:.1f} KiB/forward",
                  flush=True)
            bare = r.get("stats, no routing values")
            if bare is not None:
                print(f"  routing records: stats mode with their values {r['stats']['ratio']:.2f}x"
                      f" (CPU {r['stats']['cpu_ratio']:.2f}x), "
                      f"{r['stats']['bytes_per_forward'] / 1024:.1f} KiB/forward; without "
                      f"{bare['ratio']:.2f}x (CPU {bare['cpu_ratio']:.2f}x), "
                      f"{bare['bytes_per_forward'] / 1024:.1f} KiB/forward", flush=True)
            nosk = r["stats, no sketch"]
            print(f"  sketch: stats mode with it {r['stats']['ratio']:.2f}x "
                  f"(CPU {r['stats']['cpu_ratio']:.2f}x), "
                  f"{r['stats']['bytes_per_forward'] / 1024:.1f} KiB/forward; without "
                  f"{nosk['ratio']:.2f}x (CPU {nosk['cpu_ratio']:.2f}x), "
                  f"{nosk['bytes_per_forward'] / 1024:.1f} KiB/forward", flush=True)
            for task in ("statistics", "tensor"):
                v = r.get(f"msprobe {task}")
                if isinstance(v, str):
                    print(f"  msprobe {task}: {v}")
    load1 = os.getloadavg()
    print(f"load average after: {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f}")
    print("\nwall clock, median (the ratio to a plain forward of the same process):\n")
    print(table(rows, bool(version)))
    print("\nCPU time of the process, median (less disturbed by other work on the machine):\n")
    print(table(rows, bool(version), "cpu_ratio"))


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
