"""Weights that differ between two captures at the same name. Imports nothing of accucheck
(numbers from the captures' meta only: no h5py, no torch), so the diff can call it.

Every HF capture's meta holds "weights" (accucheck.capture.record.stats.weight_table): per parameter
and buffer its dtype, shape, exact bit-pattern checksum and 8 values sampled at fixed
positions. Two captures' weights of the same name differ when

- their shapes differ, or
- they have the same dtype and another checksum (any bit of any element), or
- their dtypes differ and one is float32 / float64 while the other is bfloat16 or float16
  (a float32 reference, a bfloat16 candidate): the checksum of the finer weight cast to the
  coarser dtype (recorded by the capture) differs from the coarser one's own: some element
  differs beyond the cast, or
- otherwise (bfloat16 vs float16): a sampled value differs by more than one unit in the last
  place of the coarser dtype (a cast of a cast rounds by at most that); only the 8 sampled
  positions are seen.

vLLM captures name their weights as transformers does: a fused weight (qkv_proj, gate_up_proj)
is recorded as its q / k / v (gate / up) rows, with its "source" ("qkv_proj rows 576-767"),
which the note names. Under tensor parallel a KV head that several ranks hold is counted
once; ranks whose copies of it differ ("replicas_differ") are a difference of their own.
Weights on one side only are not compared. The diff reports what differs in one note; the
verdict is left to the records.
"""
from __future__ import annotations

# unit roundoff (one ulp relative to the value, at most) of the dtypes weights come in
_ULP = {"float64": 2.0 ** -52, "float32": 2.0 ** -23, "float16": 2.0 ** -10,
        "bfloat16": 2.0 ** -7, "float8_e4m3fn": 2.0 ** -3, "float8_e5m2": 2.0 ** -2}
_TINY = {"float16": 2.0 ** -24, "bfloat16": 2.0 ** -133}  # smallest subnormals


def weight_differences(ref_meta: dict, cand_meta: dict) -> list[tuple[str, str]]:
    """(name, why) for each weight present in both captures' meta "weights" that differs
    (see the module docstring), in the reference's order."""
    ra, ca = ref_meta.get("weights"), cand_meta.get("weights")
    if not isinstance(ra, dict) or not isinstance(ca, dict):
        return []
    out = []
    for name, a in ra.items():
        b = ca.get(name)
        if not isinstance(a, dict) or not isinstance(b, dict):
            continue
        why = _differs(a, b)
        if why:
            out.append((name, why))
    return out


def _differs(a: dict, b: dict) -> str:
    for side, e in (("ref", a), ("cand", b)):
        if e.get("replicas_differ"):  # accucheck.capture.record.ranks: one KV head, two copies
            r0, r1 = e["replicas_differ"][0]
            return (f"{side}'s tensor-parallel ranks {r0} and {r1} hold different copies of "
                    f"the same KV heads")
    if list(a.get("shape") or []) != list(b.get("shape") or []):
        return f"shape {a.get('shape')} vs {b.get('shape')}"
    da, db = a.get("dtype"), b.get("dtype")
    if da == db:
        if a.get("checksum") != b.get("checksum"):
            return f"{da}, checksum {a.get('checksum')} vs {b.get('checksum')}"
        return ""
    if da not in _ULP or db not in _ULP:
        return ""  # integer buffers of another dtype: nothing sound to compare
    fine, coarse = (a, b) if _ULP[da] < _ULP[db] else (b, a)
    cast = (fine.get("cast") or {}).get(coarse.get("dtype"))
    if fine.get("dtype") in ("float32", "float64") and cast is not None:
        if cast != coarse.get("checksum"):
            return (f"{da} vs {db}, the {fine.get('dtype')} weight cast to "
                    f"{coarse.get('dtype')}: checksum {cast} vs {coarse.get('checksum')}")
        return ""
    ulp = max(_ULP[da], _ULP[db])
    tiny = max(_TINY.get(da, 0.0), _TINY.get(db, 0.0))
    for i, (x, y) in enumerate(zip(a.get("sample") or [], b.get("sample") or [])):
        if x is None or y is None:
            if (x is None) != (y is None):
                return f"{da} vs {db}, sampled value {i}: {x} vs {y}"
            continue
        if abs(x - y) > ulp * max(abs(x), abs(y)) + tiny:
            return f"{da} vs {db}, sampled value {i}: {x:.8g} vs {y:.8g} (beyond the cast)"
    return ""


def _sources(meta: dict) -> dict[str, str]:
    """Where a weight of a vLLM capture comes from, when it is a part of a fused one
    ("qkv_proj rows 576-767", accucheck.capture.runners.vllm_plugin)."""
    w = meta.get("weights")
    return {k: v["source"] for k, v in w.items()
            if isinstance(v, dict) and isinstance(v.get("source"), str)} \
        if isinstance(w, dict) else {}


def weight_notes(ref_meta: dict, cand_meta: dict, limit: int = 3) -> list[str]:
    """One note (or none) for DiffResult.notes: which weights of the candidate are not the
    reference's."""
    diffs = weight_differences(ref_meta, cand_meta)
    if not diffs:
        return []
    src = {**_sources(ref_meta), **_sources(cand_meta)}
    shown = "; ".join(f"{name} ({'vLLM ' + src[name] + ': ' if name in src else ''}{why})"
                      for name, why in diffs[:limit])
    more = f"; and {len(diffs) - limit} more" if len(diffs) > limit else ""
    return [f"WEIGHTS DIFFER: {len(diffs)} weight(s) of the candidate are not the reference's at "
            f"the same name: {shown}{more}. The runs do not compute with the same model: "
            f"errors from them are not the device's; load the same checkpoint on both sides"]
