"""Tensor-parallel records: every rank's copy checked, replicated tensors stored once, shards kept.

Used by accucheck.capture.runners.vllm after the workers' records came back; no torch, no vLLM
(tests/test_ranks.py runs it on hand-made records). A record here is anything with the
attributes of `Record` (req, step, module, call, role, slot, shape, stats, checksum, data,
order, rank): what a vLLM worker (capture.runners.vllm_plugin) records, sends and notes.

- replicated (the default modules' outputs: embeddings and row-parallel layers all-reduce, so
  every rank holds the whole tensor): the copies must be bit-identical (same shape, checksum
  and statistics). Equal: one record, rank 0's. Not equal: rank 0's under the record's key and
  every rank that differs from it under the slot `<slot>.rank<r>`, and a disagreement entry
  (ranks, relative L2 between the copies when the data was captured, else between their L2
  norms) -- a tensor-parallel bug (a wrong all-reduce, one rank computing its shard wrongly) is
  exactly that.
- sharded (column-parallel outputs, a row-parallel layer's input, the inner attention): each
  rank's shard under `<slot>.rank<r>` and an annotation per site (`shard_annotation`): the
  dimension the shards split and the rank order, or "packed" where the rank shards interleave
  several tensors (fused q/k/v, gate/up) and cannot be joined by concatenation.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from accucheck.keys import rank_slot


@dataclass
class Record:
    """One captured tensor of one request and step, ready for CaptureWriter.add."""
    req: int
    step: int
    module: str
    call: int           # how many times the module had already run in this forward
    role: str
    slot: str
    dtype: str
    shape: tuple[int, ...]
    stats: np.ndarray   # the 10 statistics
    checksum: int
    data: np.ndarray | None
    order: int          # execution order within the (req, step)
    rank: int = 0       # tensor-parallel rank that recorded it
    spilled: list | None = None  # where `data` lies in its rank's spill file (record.spill)

    def to_wire(self) -> list:
        """Primitives and bytes only (vLLM's RPC encoder refuses anything else without pickle)."""
        data = None if self.data is None else [self.data.dtype.str, self.data.tobytes()]
        return [self.req, self.step, self.module, self.call, self.role, self.slot, self.dtype,
                list(self.shape), np.asarray(self.stats, np.float64).tobytes(), self.checksum,
                data, self.order, self.rank, self.spilled]

    def to_row(self) -> list:
        """JSON-able, for the spill's index (record.spill `Spill.note`): its tensor is on disk
        (`spilled`) or not recorded (stats mode)."""
        return [int(self.req), int(self.step), self.module, int(self.call), self.role,
                self.slot, self.dtype, [int(x) for x in self.shape],
                [float(x) for x in np.asarray(self.stats, np.float64)], int(self.checksum),
                int(self.order), int(self.rank),
                None if self.spilled is None else [int(self.spilled[0]), self.spilled[1]]]

    @classmethod
    def from_row(cls, row: list) -> "Record":
        (req, step, module, call, role, slot, dtype, shape, stats, checksum, order, rank,
         spilled) = row
        return cls(int(req), int(step), module, int(call), role, slot, dtype,
                   tuple(int(x) for x in shape), np.asarray(stats, np.float64), int(checksum),
                   None, int(order), int(rank), spilled)

    @classmethod
    def from_wire(cls, w: list) -> "Record":
        (req, step, module, call, role, slot, dtype, shape, stats, checksum, data, order, rank,
         spilled) = w
        shape = tuple(int(x) for x in shape)
        arr = None if data is None else np.frombuffer(data[1], dtype=np.dtype(data[0])) \
            .reshape(shape)
        return cls(int(req), int(step), module, int(call), role, slot, dtype, shape,
                   np.frombuffer(stats, np.float64).copy(), int(checksum), arr, int(order),
                   int(rank), spilled)


# vLLM layer classes whose output each rank holds a part of (class-name suffixes), and how the
# parts sit: "concat" = contiguous along the last dimension in rank order, "packed" = several
# tensors per rank (q|k|v, gate|up), no concatenation gives the unsharded layout
SHARDED_OUT = {"QKVParallelLinear": "packed", "MergedColumnParallelLinear": "packed",
               "ColumnParallelLinear": "concat", "Attention": "concat",
               "AndMul": "concat"}  # SiluAndMul / GeluAndMul: this rank's intermediate columns
SHARDED_IN = {"RowParallelLinear": "concat",   # its input is this rank's part (input_is_parallel)
              "Attention": "concat",           # q, k, v: this rank's heads
              "AndMul": "packed"}              # gate|up: this rank's columns of each


def shard_layout(kind: str, role: str) -> str | None:
    """"concat" / "packed" for a sharded (class, role), None for a replicated one."""
    table = SHARDED_OUT if role == "out" else SHARDED_IN if role == "in" else {}
    for suffix, layout in table.items():
        if kind == suffix or (kind.endswith(suffix) and suffix != "Attention"):
            return layout
    return None


@dataclass
class Merged:
    """What to write: `records` as (slot, record) in writing order, and what meta says."""
    records: list = field(default_factory=list)
    disagreements: list[dict] = field(default_factory=list)
    shards: dict[str, dict] = field(default_factory=dict)
    verified: int = 0          # replicated records whose copies were compared and equal
    seen: list[tuple[int, int, int, str]] = field(default_factory=list)  # (rank, req, step, site)


def merge_ranks(by_rank: dict[int, list], kinds: dict[str, str], tp: int,
                load=lambda rec: rec.data) -> Merged:
    """Join the ranks' records of one capture (see the module docstring). `by_rank`: the
    records each rank returned; `kinds`: module path -> vLLM class name; `load(record)`: its
    tensor or None (default: its `data`; vllm_plugin.SpillReader reads it from disk)."""
    out = Merged()
    groups: dict[tuple, dict[int, object]] = {}
    first: dict[tuple, tuple] = {}
    for rank in sorted(by_rank):
        for rec in by_rank[rank]:
            site = (rec.req, rec.step, rec.module, rec.call, rec.role, rec.slot)
            groups.setdefault(site, {})[rank] = rec
            out.seen.append((rank, rec.req, rec.step,
                             f"{rec.module}#{rec.call}:{rec.role}.{rec.slot}"))
            first.setdefault(site, (rec.req, rec.step, rank, rec.order))
    for site in sorted(groups, key=lambda s: first[s]):
        copies = groups[site]
        req, step, module, call, role, slot = site
        layout = shard_layout(kinds.get(module, ""), role) if tp > 1 else None
        if layout is not None:
            for rank in sorted(copies):
                out.records.append((rank_slot(slot, rank), copies[rank]))
            out.shards[f"{module}#{call}:{role}.{slot}"] = {
                "dim": -1, "ranks": list(range(tp)), "layout": layout}
            continue
        base_rank = min(copies)
        base = copies[base_rank]
        out.records.append((slot, base))
        differ = [r for r in sorted(copies) if r != base_rank and not _same(base, copies[r])]
        if len(copies) > 1 and not differ:
            out.verified += 1
        for r in differ:
            out.records.append((rank_slot(slot, r), copies[r]))
            out.disagreements.append({
                "request": req, "step": step, "module": module, "call": call, "role": role,
                "slot": slot, "ranks": [base_rank, r],
                **_rel_l2(base, copies[r], load(base), load(copies[r]))})
    return out


def _same(a, b) -> bool:
    return (tuple(a.shape) == tuple(b.shape) and int(a.checksum) == int(b.checksum)
            and np.array_equal(np.asarray(a.stats), np.asarray(b.stats), equal_nan=True))


def _rel_l2(a, b, a_data, b_data) -> dict:
    """rel_l2: ||b - a|| / ||a|| from the data (basis "tensor"), or | ||b|| - ||a|| | / ||a||
    (a lower bound) from the statistics (field 5 is the L2 norm; basis "l2 norms"); None for
    different shapes."""
    tensors = a_data is not None and b_data is not None
    out = {"rel_l2": None, "basis": "tensor" if tensors else "l2 norms"}
    if tuple(a.shape) != tuple(b.shape):
        return out
    if tensors:
        x = _float(a_data, a.dtype)
        y = _float(b_data, b.dtype)
        den = float(np.sqrt(np.sum(x * x)))
        num = float(np.sqrt(np.sum((y - x) ** 2)))
    else:
        den, num = float(a.stats[5]), abs(float(b.stats[5]) - float(a.stats[5]))
    if not math.isfinite(num) or not math.isfinite(den):
        return dict(out, rel_l2=math.inf)
    return dict(out, rel_l2=num / den if den > 0 else (0.0 if num == 0 else math.inf))


def _float(data: np.ndarray, dtype: str) -> np.ndarray:
    from accucheck.store import bf16_bits_to_float32

    arr = bf16_bits_to_float32(data) if dtype == "bfloat16" else data
    return np.asarray(arr, dtype=np.float64).ravel()


def merge_weight_tables(tables: dict[int, dict | None], tp: int) -> dict:
    """One meta "weights" (accucheck.capture.record.stats.weight_table) from every rank's
    (accucheck.capture.runners.vllm_plugin.vllm_weight_table): a replicated weight from the lowest
    rank; a column- / row-split one with its checksums (exact bit-pattern sums mod 2**52)
    added across the ranks and its rows / columns joined; a vocabulary-parallel one (padded
    rows) only at TP 1. Entries keep "source" (where a fused weight's part comes from).
    k / v rows that `replicas` ranks hold alike (TP size above the KV heads: vLLM's
    num_kv_head_replicas) are taken once, from ranks 0, replicas, 2 * replicas, ...: adding
    every copy would count each head `replicas` times, and the diff would say WEIGHTS DIFFER
    against the unsharded model for no reason. Copies that differ are named in
    "replicas_differ" ([holder rank, rank]): compare.weights reports them."""
    ranks = sorted(r for r, t in tables.items() if t)
    if not ranks or (tp > 1 and len(ranks) != tp):
        return {}
    out: dict[str, dict] = {}
    for name, e0 in tables[ranks[0]].items():
        par = e0.get("parallel", "replicated")
        entry = {k: v for k, v in e0.items() if k not in ("parallel", "replicas")}
        if tp == 1 or par == "replicated":
            out[name] = entry
            continue
        parts = [tables[r].get(name) for r in ranks]
        dim = 0 if par in ("column", "vocab") else 1
        if par == "vocab" or any(p is None for p in parts) or len(e0["shape"]) <= dim:
            if len(e0["shape"]) <= dim and par == "row":  # a row-parallel bias: replicated
                out[name] = entry
            continue
        joined = _join_split(entry, parts, dim, int(e0.get("replicas", 1) or 1), tp)
        if joined is not None:
            out[name] = joined
    return out


def _join_split(entry: dict, parts: list[dict], dim: int, replicas: int, tp: int) -> dict | None:
    """`entry` with the shape and checksums of the ranks' `parts` joined along `dim`, each
    group of `replicas` ranks counted once; None when the TP size is not a multiple of it
    (no correct join: left out of the table)."""
    if replicas < 1 or tp % replicas:
        return None
    held = parts[::replicas]
    entry = dict(entry)
    shape = list(entry["shape"])
    shape[dim] = sum(int(p["shape"][dim]) for p in held)
    entry.update(shape=shape, checksum=sum(int(p["checksum"]) for p in held) % 2 ** 52)
    if "cast" in entry:
        entry["cast"] = {k: sum(int(p["cast"][k]) for p in held) % 2 ** 52
                         for k in entry["cast"]}
    differ = [[r - r % replicas, r] for r, p in enumerate(parts)
              if r % replicas and _copy_key(p) != _copy_key(parts[r - r % replicas])]
    if differ:
        entry["replicas_differ"] = differ
    if "source" in entry:
        entry["source"] = f"{entry['source']} of each of {tp} ranks" if replicas == 1 else (
            f"{entry['source']} of ranks {', '.join(str(r) for r in range(0, tp, replicas))} "
            f"(each KV head held by {replicas} ranks)")
    return entry


def _copy_key(part: dict) -> tuple:
    return (list(part.get("shape") or []), part.get("checksum"), part.get("cast"))
