"""vLLM's fused layers mapped onto transformers' leaves, from the model config: data, not
per-model code. Imports keys, store (readers) and errors; numpy only, no torch.

vLLM fuses layers that transformers keeps apart, so their records sit on one side only and a
culprit inside them could only be named at the decoder layer. A vLLM capture is read through
`MappedCapture`, which shows what transformers would have recorded:

| vLLM record | transformers records | how |
|---|---|---|
| `self_attn.qkv_proj` out | `q_proj` / `k_proj` / `v_proj` out | last dimension split: heads x head_dim, kv_heads x head_dim twice |
| `mlp.gate_up_proj` out | `gate_proj` / `up_proj` out | last dimension halved: intermediate_size each |
| `self_attn.attn` out (the attention core) | `o_proj` in | renamed |
| `mlp.act_fn` out (SiluAndMul: act(gate) * up) | `down_proj` in | renamed |
| `post_attention_layernorm` out.vllm.1 (fused add + norm: the residual sum) | `post_attention_layernorm` in | renamed |
| `mlp.act_fn` in (gate_up_proj's output again) | - | hidden |
| inputs of a module returning a vLLM tuple (--inputs: x and the residual before the add) | `in.vllm.<slot>` | renamed: vLLM's arguments |

Under tensor parallel each rank holds its heads / columns of these outputs (`<slot>.rank<r>`,
meta tensor_parallel.shards): the q / k / v (gate / up) part of every rank is cut first (sizes
divided by the TP size), then the ranks' parts are joined in rank order (a TP size above the KV
heads: each rank's k / v is one head held by tp // kv_heads ranks, taken once); the renamed sharded
outputs are joined likewise. A split record is read from the fused one, so it needs its values
(--store full); in the stats store the vLLM capture records the leaves' statistics itself (one
rank: accucheck.capture.runners.vllm_plugin) and the fused record is hidden, a renamed record keeps
its statistics under its new key; what still has statistics only (tensor-parallel shards) stays as
it is, on one side, never compared with another quantity (a note says so). When
the capture already holds the target (o_proj's / down_proj's input recorded with --inputs, the
very tensor attn / act_fn returned) the source is hidden; the fused norm's residual stays
under its vllm slot (vLLM's norm input is another tensor).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Iterator

import numpy as np

from accucheck.keys import RecordKey, split_rank
from accucheck.store import STAT_FIELDS, IndexRow, Stats

# fused vLLM module (last path component) -> (transformers leaf, size) along the last dimension
FUSED = {
    "qkv_proj": (("q_proj", "q"), ("k_proj", "kv"), ("v_proj", "kv")),
    "gate_up_proj": (("gate_proj", "ffn"), ("up_proj", "ffn")),
}
# vLLM records that repeat another one the mapping already shows (SiluAndMul's input is
# gate_up_proj's output): hidden
DROPPED = {("mlp.act_fn", "in.0")}
# (vLLM module suffix, role.slot) -> (transformers module suffix, role.slot)
RENAMED = {
    ("self_attn.attn", "out.0"): ("self_attn.o_proj", "in.0"),
    ("mlp.act_fn", "out.0"): ("mlp.down_proj", "in.0"),
    ("post_attention_layernorm", "out.vllm.1"): ("post_attention_layernorm", "in.0"),
}


def sizes(config: dict) -> dict[str, int] | None:
    """The split sizes of FUSED from a transformers config; None when it does not say."""
    try:
        heads = int(config["num_attention_heads"])
        kv = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
        ffn = int(config["intermediate_size"])
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    return {"q": heads * head_dim, "kv": kv * head_dim, "ffn": ffn, "kv_heads": kv}


def kv_replicas(sz: dict, tp: int) -> int:
    """Ranks per KV head under tensor parallel `tp` (vLLM's QKVParallelLinear rule: tp //
    num_kv_heads when tp exceeds the KV heads, else 1): each rank's k / v part of qkv_proj is
    one head, the same on `replicas` consecutive ranks."""
    heads = int(sz.get("kv_heads") or 0)
    return tp // heads if heads and tp > heads and tp % heads == 0 else 1


def mapping_table(config: dict) -> list[dict]:
    """The mapping used, for the diff's JSON and notes: one entry per fused / renamed pair."""
    sz = sizes(config) or {}
    out = [{"vllm": f"{m} out.0", "hf": [f"{leaf} out.0" for leaf, _ in parts],
            "sizes": [sz.get(s) for _, s in parts]} for m, parts in FUSED.items()]
    out += [{"vllm": f"{a} {sa}", "hf": [f"{b} {sb}"], "sizes": None}
            for (a, sa), (b, sb) in RENAMED.items()]
    return out


def _stats(x: np.ndarray) -> tuple[Stats, int]:
    """STAT_FIELDS of `x` (its float values) and a checksum of 0: a mapped record has no
    stored bit pattern, so it is never "identical" by checksum to anything."""
    v = np.asarray(x, dtype=np.float64).ravel()
    fin = v[np.isfinite(v)]
    n = v.size
    vals = dict(min=float(fin.min()) if fin.size else float("nan"),
                max=float(fin.max()) if fin.size else float("nan"),
                mean=float(fin.mean()) if fin.size else float("nan"),
                std=float(fin.std()) if fin.size else float("nan"),
                absmax=float(np.abs(fin).max()) if fin.size else float("nan"),
                l2=float(np.sqrt(np.dot(fin, fin))), nan=int(np.isnan(v).sum()),
                inf=int(np.isinf(v).sum()), zero=int((v == 0).sum()), numel=n)
    return Stats(**{f: vals[f] for f in STAT_FIELDS}), 0


class MappedCapture:
    """A capture reader (store.CaptureReader) that shows vLLM's fused records as
    transformers' (see the module docstring). Everything else is the reader's own."""

    def __init__(self, reader: Any):
        self._r = reader
        self.mapped: dict[str, list[str]] = {}   # fused / renamed key -> the keys shown for it
        self.unmapped = 0                        # fused records with statistics only
        self._make: dict[str, Callable[[], np.ndarray]] = {}
        self.rows = self._map(list(reader.rows))
        self._by_key = {str(r.key): r for r in self.rows}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._r, name)

    def row(self, key: RecordKey | str) -> IndexRow:
        return self._by_key[str(key)]

    def __contains__(self, key: RecordKey | str) -> bool:
        return str(key) in self._by_key

    def read(self, key: RecordKey | str) -> np.ndarray:
        make = self._make.get(str(key))
        return make() if make is not None else self._r.read(key)

    def iter_chunks(self, key: RecordKey | str, max_elems: int = 1 << 20) -> Iterator[np.ndarray]:
        make = self._make.get(str(key))
        if make is None:
            yield from self._r.iter_chunks(key, max_elems)
            return
        flat = make().reshape(-1)
        for i in range(0, max(flat.size, 1), max_elems):
            yield flat[i:i + max_elems]

    def close(self) -> None:
        self._r.close()

    # -- building --------------------------------------------------------------------------
    def _map(self, rows: list[IndexRow]) -> list[IndexRow]:
        rows = self._vllm_arguments(rows)
        model = (self._r.meta.get("model") or {}) if isinstance(self._r.meta, dict) else {}
        sz = sizes(model.get("config") or {})
        tp = int(((self._r.meta.get("tensor_parallel") or {}).get("size")) or 1)
        present = {str(r.key) for r in rows}  # and the keys of which rank parts are held
        present |= {str(RecordKey(r.key.req, r.key.step, r.key.module, r.key.call, r.key.role,
                                  split_rank(r.key.slot)[0], r.key.op, r.key.op_index))
                    for r in rows}
        groups: dict[tuple, dict[int, IndexRow]] = {}
        for row in rows:
            rule = self._rule(row.key, sz)
            if rule is not None:
                slot, rank = split_rank(row.key.slot)
                base = RecordKey(row.key.req, row.key.step, row.key.module, row.key.call,
                                 row.key.role, slot)
                groups.setdefault((str(base), rule), {})[0 if rank is None else rank] = row
        replace_rows: dict[str, list[IndexRow]] = {}
        for (base, rule), by_rank in groups.items():
            parts = self._parts(RecordKey.parse(base), rule, by_rank, sz, tp, present)
            if parts is None:
                continue
            first = by_rank[min(by_rank)]
            replace_rows[str(first.key)] = parts
            for r in by_rank.values():
                if r is not first:
                    replace_rows[str(r.key)] = []
            if parts:
                self.mapped[base] = [str(p.key) for p in parts]
        out = []
        for row in rows:
            out.extend(replace_rows.get(str(row.key), [row]))
        return out

    def _vllm_arguments(self, rows: list[IndexRow]) -> list[IndexRow]:
        """The inputs (--inputs) of a module that returns a vLLM tuple (fused add + norm, a
        decoder layer: `out.vllm.<i>` slots) are vLLM's arguments (x and the residual before
        the add), not what transformers passes: shown as `in.vllm.<slot>`, so that no key
        means one tensor here and another in transformers (or in a vLLM capture without
        --inputs, where `post_attention_layernorm in` is the residual sum)."""
        tupled = {(r.key.req, r.key.step, r.key.module, r.key.call) for r in rows
                  if r.key.role == "out" and r.key.slot.startswith("vllm.")}
        out = []
        for r in rows:
            k = r.key
            if k.role == "in" and k.op is None and (k.req, k.step, k.module, k.call) in tupled:
                r = replace(r, key=RecordKey(k.req, k.step, k.module, k.call, "in",
                                             f"vllm.{k.slot}"))
                self._make[str(r.key)] = lambda k=k: self._r.read(k)
            out.append(r)
        return out

    @staticmethod
    def _rule(key: RecordKey, sz: dict | None) -> str | None:
        if key.op is not None:
            return None
        slot = split_rank(key.slot)[0]
        leaf = key.module.rsplit(".", 1)[-1]
        if leaf in FUSED and key.role == "out" and slot == "0" and sz is not None:
            return "fused"
        for (suffix, rs) in RENAMED:
            if key.module.endswith(suffix) and f"{key.role}.{slot}" == rs:
                return "renamed"
        for (suffix, rs) in DROPPED:
            if key.module.endswith(suffix) and f"{key.role}.{slot}" == rs:
                return "dropped"
        return None

    def _parts(self, base: RecordKey, rule: str, by_rank: dict[int, IndexRow], sz, tp: int,
               present: set[str]) -> list[IndexRow] | None:
        ranks = sorted(by_rank)
        rows = [by_rank[r] for r in ranks]
        if rule == "dropped":
            return []
        if rule == "fused" and sz is not None and all(
                str(RecordKey(base.req, base.step, f"{base.module.rsplit('.', 1)[0]}.{name}",
                              base.call, "out", "0")) in present
                for name, _ in FUSED[base.module.rsplit(".", 1)[-1]]):
            return []  # the capture split it into the leaves itself (stats store): hidden
        if rule == "renamed" and len(rows) == 1 and not rows[0].has_data:
            return self._renamed_stats(base, rows[0], present)
        if not all(r.has_data for r in rows) or (len(rows) > 1 and ranks != list(range(tp))):
            self.unmapped += len(rows)
            return None
        first = rows[0]
        reader = self._r

        def joined_parts(spec: list[tuple[str, int, int]]) -> dict[str, np.ndarray]:
            """Each part's values: every rank's share (size x replicas / ranks) cut, then
            joined, a part that `replicas` ranks hold alike taken from the first of them."""
            n = len(rows)
            pieces: dict[str, list[np.ndarray]] = {name: [] for name, _, _ in spec}
            for i, r in enumerate(rows):
                x = reader.read(r.key)
                start = 0
                for name, size, rep in spec:
                    share = size * rep // n
                    if i % rep == 0:
                        pieces[name].append(x[..., start:start + share])
                    start += share
            return {name: np.concatenate(p, axis=-1) for name, p in pieces.items()}

        if rule == "fused":
            leaf = base.module.rsplit(".", 1)[-1]
            rep = kv_replicas(sz, len(rows)) if leaf == "qkv_proj" else 1
            spec = [(name, sz[s], rep if s == "kv" else 1) for name, s in FUSED[leaf]]
            width = sum(s * k for _, s, k in spec)
            if sum(r.shape[-1] for r in rows) != width or any(s * k % len(rows)
                                                              for _, s, k in spec):
                self.unmapped += len(rows)
                return None
            prefix = base.module.rsplit(".", 1)[0]
            values = joined_parts(spec)  # for the statistics; read again when compared
            out = []
            for name, _, _ in spec:
                key = RecordKey(base.req, base.step, f"{prefix}.{name}", base.call, "out", "0")
                if str(key) in present:
                    continue
                out.append(self._virtual(first, key, values[name],
                                         lambda name=name: joined_parts(spec)[name]))
            return out
        key, suffix, to_suffix = _renamed_key(base)
        if str(key) in present:  # recorded by --inputs: attn's / act_fn's output IS that
            # input (hidden: its own name would mean act(gate) to transformers); the fused
            # norm's residual is not vLLM's norm input (kept under its vllm slot)
            return [] if to_suffix != suffix else None
        spec = [("all", sum(r.shape[-1] for r in rows), 1)]

        def whole() -> np.ndarray:
            return joined_parts(spec)["all"] if len(rows) > 1 else reader.read(first.key)
        return [self._virtual(first, key, whole(), whole)]

    def _renamed_stats(self, base: RecordKey, row: IndexRow, present: set[str]
                       ) -> list[IndexRow] | None:
        """A renamed record with statistics only (one rank): the same row under its
        transformers key; a rename needs no values. vLLM's act_fn output (act(gate) * up) is
        down_proj's input, never compared with transformers' act_fn output (act(gate))."""
        key, suffix, to_suffix = _renamed_key(base)
        if str(key) in present:
            return [] if to_suffix != suffix else None
        self._make[str(key)] = lambda: self._r.read(row.key)
        return [replace(row, key=key)]

    def _virtual(self, like: IndexRow, key: RecordKey, value: np.ndarray,
                 make: Callable[[], np.ndarray]) -> IndexRow:
        stats, checksum = _stats(value)
        self._make[str(key)] = make
        return replace(like, key=key, shape=tuple(value.shape), stats=stats, checksum=checksum,
                       data=f"mapped:{like.data}", extra="", sample=None, hash=0)


def _renamed_key(base: RecordKey) -> tuple[RecordKey, str, str]:
    """(transformers key, vLLM suffix, transformers suffix) of a RENAMED record."""
    ((suffix, _rs), (to_suffix, to_rs)), = [
        (k, v) for k, v in RENAMED.items()
        if base.module.endswith(k[0]) and f"{base.role}.{base.slot}" == k[1]]
    module = base.module[: len(base.module) - len(suffix)] + to_suffix
    role, slot = to_rs.split(".", 1)
    return RecordKey(base.req, base.step, module, base.call, role, slot), suffix, to_suffix


def maybe_mapped(reader: Any) -> Any:
    """`reader` seen through MappedCapture when it is a vLLM capture, else itself."""
    if isinstance(reader.meta, dict) and reader.meta.get("runner") == "vllm":
        return MappedCapture(reader)
    return reader
