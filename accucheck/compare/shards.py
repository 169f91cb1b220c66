"""Tensor-parallel records in a diff: one side's per-rank copies and shards paired with the
other side's single record (accucheck.capture.record.ranks wrote them). Imports keys and store; no
torch. compare.diff joins the shards (`_Differ._join_shards`) and reports the rank notes."""
from __future__ import annotations

from dataclasses import dataclass

from accucheck.keys import RecordKey, split_rank
from accucheck.store import CaptureReader, IndexRow


def _base_key(key: RecordKey) -> RecordKey | None:
    slot, rank = split_rank(key.slot)
    if rank is None or key.op is not None:
        return None
    return RecordKey(key.req, key.step, key.module, key.call, key.role, slot)


@dataclass
class ShardGroup:
    """One side's tensor-parallel parts of a record (meta tensor_parallel.shards) and the
    other side's unsharded record."""
    whole: IndexRow
    rows: list[IndexRow]          # the parts, in the annotation's rank order
    layout: str                   # "concat" | "packed"
    sharded_is_ref: bool

    @property
    def keys(self) -> list[RecordKey]:
        return [r.key for r in self.rows]


def rank_pairs(R: CaptureReader, C: CaptureReader, wanted
               ) -> tuple[list[tuple[IndexRow, IndexRow, RecordKey]], list[ShardGroup]]:
    """One side's per-rank records (slot `<slot>.rank<r>`, accucheck.capture.record.ranks) that the
    other side holds once, under `<slot>`: a differing copy of a replicated tensor is paired
    with the other side's copy (ref row, cand row, the rank copy's key); the parts of a shard
    (a site in that side's meta tensor_parallel.shards) are grouped with the other side's
    unsharded record (`_Differ._join_shards` compares them)."""
    pairs, groups = [], []
    for mine, other, mine_is_ref in ((C, R, False), (R, C, True)):
        shards = (mine.meta.get("tensor_parallel") or {}).get("shards") or {}
        parts: dict[RecordKey, dict[int, IndexRow]] = {}
        for row in mine.rows:
            base = _base_key(row.key)
            if base is None or row.key in other or not wanted(row.key) or base not in other:
                continue
            if base.site in shards:
                parts.setdefault(base, {})[split_rank(row.key.slot)[1]] = row
            else:
                pairs.append((row, other.row(base), row.key) if mine_is_ref
                             else (other.row(base), row, row.key))
        for base, by_rank in parts.items():
            note = shards[base.site]
            order = [int(r) for r in note.get("ranks", sorted(by_rank))]
            rows = [by_rank[r] for r in order if r in by_rank]
            layout = note.get("layout", "concat") if len(rows) == len(order) == len(by_rank) \
                and note.get("dim", -1) == -1 else "unsupported"
            groups.append(ShardGroup(other.row(base), rows, layout, mine_is_ref))
    return pairs, groups


def rank_notes(R: CaptureReader, C: CaptureReader) -> list[str]:
    """A note per side whose ranks disagreed on replicated tensors at capture time."""
    out = []
    for name, side in (("ref", R), ("cand", C)):
        found = (side.meta.get("tensor_parallel") or {}).get("disagreements") or []
        if found:
            d = found[0]
            size = "?" if d.get("rel_l2") is None else f"{d['rel_l2']:.3g}"
            out.append(
                f"RANKS DISAGREE in {name}: {len(found)} replicated tensors differ between "
                f"tensor-parallel ranks (first: r{d['request']}.s{d['step']}:{d['module']}"
                f"#{d['call']}:{d['role']}.{d['slot']}, rank {d['ranks'][1]} vs rank "
                f"{d['ranks'][0]}, rel_l2 {size}); each differing copy is compared as "
                f"<slot>.rank<r>")
    return out
