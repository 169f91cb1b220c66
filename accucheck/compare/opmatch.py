"""Match op records of two captures inside each module call, surviving fused kernels.
Imports keys and store (index rows only); never torch, never tensors.

Op keys carry an index within their module call (`.../aten.mul.Tensor@3`), so a candidate that
runs one fused kernel where the reference runs six small ops shifts every later index: matching
op records by key (or by any global counter) pairs unrelated tensors and reports false errors.
Instead:

1. Module calls are matched by key: (request, step, module path, call index).
2. Inside one module call, the two op sequences are aligned (Needleman-Wunsch, gap cost 0):
   only ops with the same operator (overload ignored) and the same output shapes can pair; the
   score prefers the same overload and output statistics that agree (|l2 difference| relative
   to l2), so of two candidate `aten.mul` ops the one holding the same data wins. Calls with
   more than `MAX_DP` cell pairs fall back to difflib on (operator, shapes) tokens.
3. Between two aligned anchors, a run of reference ops and a run of candidate ops that both
   end with an output of the same shape are a fused region: their last ops are paired with kind
   "fused" (the fused kernel's output is the decomposed chain's final result) and compared.
4. Everything else is on one side only: listed as "fused / absent", never as an error.

`align_captures(ref, cand)` -> `(pairs, OpAlignment)`: pairs of index rows (same role and slot,
"out" and "in"; only "out" for a fused pair, whose inputs follow another signature) to compare,
and the alignment (matches, one-side ops, call sites) for reports.
"""
from __future__ import annotations

import difflib
import json
import math
from dataclasses import dataclass
from typing import Callable, Sequence

from accucheck.keys import RecordKey
from accucheck.store import CaptureReader, IndexRow

MAX_DP = 250_000
MATCH_KINDS = ("exact", "aligned", "fused")


@dataclass(frozen=True)
class OpCall:
    """One op call of one capture: its records by role and slot."""
    req: int
    step: int
    module: str
    call: int
    op: str
    op_index: int
    outs: tuple[IndexRow, ...]
    ins: tuple[IndexRow, ...]
    site: str

    @property
    def ident(self) -> str:
        """"r0.s0:model.layers.0.mlp#0/aten.silu.default@1": the op call without role/slot."""
        return f"r{self.req}.s{self.step}:{self.module}#{self.call}/{self.op}@{self.op_index}"

    @property
    def packet(self) -> str:
        return op_packet(self.op)

    @property
    def shapes(self) -> tuple[tuple[int, ...], ...]:
        return tuple(r.shape for r in self.outs)

    @property
    def l2(self) -> float:
        return self.outs[0].stats.l2 if self.outs else 0.0


@dataclass(frozen=True)
class OpMatch:
    ref: str                   # OpCall.ident on the reference side
    cand: str                  # OpCall.ident on the candidate side
    kind: str                  # "exact" (same key) | "aligned" (same op, shifted) | "fused"

    def __post_init__(self) -> None:
        if self.kind not in MATCH_KINDS:
            raise ValueError(f"kind must be one of {MATCH_KINDS}")


@dataclass(frozen=True)
class OneSided:
    """An op call on one side only: fused into a neighbour there, or not run at all."""
    ident: str
    only_in: str               # "ref" | "cand"
    site: str


@dataclass(frozen=True)
class OpAlignment:
    matches: tuple[OpMatch, ...]
    one_sided: tuple[OneSided, ...]
    sites: tuple[tuple[str, str], ...]   # (side + ":" + ident, call site)

    def site(self, side: str, ident: str) -> str | None:
        return dict(self.sites).get(f"{side}:{ident}")

    @property
    def n_fused(self) -> int:
        return sum(m.kind == "fused" for m in self.matches)


def op_packet(name: str) -> str:
    """"aten.mm.default" -> "aten.mm"."""
    return name.rsplit(".", 1)[0] if name.count(".") >= 2 else name


def op_ident(key: RecordKey) -> str:
    return f"r{key.req}.s{key.step}:{key.module}#{key.call}/{key.op}@{key.op_index}"


def op_calls(rows: Sequence[IndexRow], wanted: Callable[[RecordKey], bool] | None = None
             ) -> dict[tuple[int, int, str, int], list[OpCall]]:
    """Op calls grouped by module call (req, step, module, call), in execution order. Shadow
    records are left out (they pair by key, see accucheck.compare.diff)."""
    parts: dict[tuple, dict] = {}
    for r in rows:
        k = r.key
        if k.op is None or k.role == "shadow" or (wanted is not None and not wanted(k)):
            continue
        ident = (k.req, k.step, k.module, k.call, k.op_index)
        p = parts.get(ident)
        if p is None:
            p = parts[ident] = {"op": k.op, "outs": [], "ins": [], "site": "", "order": r.order}
        (p["outs"] if k.role == "out" else p["ins"]).append(r)
        if r.extra and not p["site"]:
            try:
                p["site"] = json.loads(r.extra).get("site", "") or ""
            except (ValueError, AttributeError):
                pass
    out: dict[tuple, list[OpCall]] = {}
    for ident, p in sorted(parts.items(), key=lambda kv: kv[1]["order"]):
        req, step, module, call, idx = ident
        out.setdefault((req, step, module, call), []).append(
            OpCall(req, step, module, call, p["op"], idx, tuple(p["outs"]), tuple(p["ins"]),
                   p["site"]))
    return out


def _score(a: OpCall, b: OpCall) -> float:
    if a.packet != b.packet or a.shapes != b.shapes:
        return -math.inf
    s = 3.0 + (0.5 if a.op == b.op else 0.0)
    la, lb = a.l2, b.l2
    if math.isfinite(la) and math.isfinite(lb):
        s += 1.0 - min(1.0, abs(la - lb) / max(abs(la), abs(lb), 1e-30))
    return s


def align(ref: Sequence[OpCall], cand: Sequence[OpCall]) -> list[tuple[int, int, str]]:
    """(i, j, kind) pairs of aligned positions, increasing in both i and j."""
    n, m = len(ref), len(cand)
    if not n or not m:
        return []
    if n * m > MAX_DP:
        sm = difflib.SequenceMatcher(None, [(c.packet, c.shapes) for c in ref],
                                     [(c.packet, c.shapes) for c in cand], autojunk=False)
        pairs = [(blk.a + t, blk.b + t) for blk in sm.get_matching_blocks()
                 for t in range(blk.size)]
    else:
        # Needleman-Wunsch, gap 0: best total score of a monotone matching
        S = [[0.0] * (m + 1) for _ in range(n + 1)]
        for i in range(1, n + 1):
            Si, Sp, a = S[i], S[i - 1], ref[i - 1]
            for j in range(1, m + 1):
                best = Sp[j] if Sp[j] >= Si[j - 1] else Si[j - 1]
                s = _score(a, cand[j - 1])
                if s != -math.inf and Sp[j - 1] + s > best:
                    best = Sp[j - 1] + s
                Si[j] = best
        pairs = []
        i, j = n, m
        while i and j:
            s = _score(ref[i - 1], cand[j - 1])
            if s != -math.inf and S[i][j] == S[i - 1][j - 1] + s:
                pairs.append((i - 1, j - 1))
                i, j = i - 1, j - 1
            elif S[i][j] == S[i - 1][j]:
                i -= 1
            else:
                j -= 1
        pairs.reverse()
    out = [(i, j, "exact" if ref[i].op_index == cand[j].op_index and ref[i].op == cand[j].op
            else "aligned") for i, j in pairs]
    # fused regions: between anchors, pair the two runs' last ops when their outputs agree
    fused = []
    bounds = [(-1, -1)] + [(i, j) for i, j, _ in out] + [(n, m)]
    for (i0, j0), (i1, j1) in zip(bounds, bounds[1:]):
        if i1 - i0 > 1 and j1 - j0 > 1:
            a, b = ref[i1 - 1], cand[j1 - 1]
            if a.shapes[:1] == b.shapes[:1]:
                fused.append((i1 - 1, j1 - 1, "fused"))
    return sorted(out + fused)


def align_captures(ref: CaptureReader, cand: CaptureReader,
                   wanted: Callable[[RecordKey], bool] | None = None
                   ) -> tuple[list[tuple[IndexRow, IndexRow]], OpAlignment]:
    """Row pairs to compare (aligned op calls: their "out" records and their "in" records, slot
    by slot, where both sides have them) and the alignment itself."""
    rc, cc = op_calls(ref.rows, wanted), op_calls(cand.rows, wanted)
    pairs: list[tuple[IndexRow, IndexRow]] = []
    matches: list[OpMatch] = []
    one: list[OneSided] = []
    sites: list[tuple[str, str]] = []
    for side, calls in (("ref", rc), ("cand", cc)):
        for seq in calls.values():
            sites += [(f"{side}:{c.ident}", c.site) for c in seq if c.site]
    for mc in list(rc) + [k for k in cc if k not in rc]:
        a, b = rc.get(mc, []), cc.get(mc, [])
        hit_a, hit_b = set(), set()
        for i, j, kind in align(a, b):
            hit_a.add(i)
            hit_b.add(j)
            x, y = a[i], b[j]
            matches.append(OpMatch(x.ident, y.ident, kind))
            # a fused kernel's inputs follow another signature: only its output compares
            roles = ((x.outs, y.outs),) if kind == "fused" else ((x.outs, y.outs), (x.ins, y.ins))
            for role_a, role_b in roles:
                by_slot = {r.key.slot: r for r in role_b}
                pairs += [(r, by_slot[r.key.slot]) for r in role_a if r.key.slot in by_slot]
        one += [OneSided(c.ident, "ref", c.site) for i, c in enumerate(a) if i not in hit_a]
        one += [OneSided(c.ident, "cand", c.site) for j, c in enumerate(b) if j not in hit_b]
    return pairs, OpAlignment(tuple(matches), tuple(one), tuple(sites))
