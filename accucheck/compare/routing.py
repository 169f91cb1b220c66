"""Mixture-of-experts routing in a diff: which experts each token went to on each side, the
first routing flip and its label, and what a flip means for the records around it. Imports
keys, store (readers) and compare.metrics / compare.tolerances; no torch.

A **router call** is one call of an MoE router whose three outputs are recorded (transformers
5: `…mlp.gate#c:out.0` router logits [tokens, experts], `out.1` top-k weights [tokens, k],
`out.2` top-k expert ids [tokens, k]; accucheck.capture.record.moe keeps their values in every store
mode). Found by shape, so imported or older captures count too.

Per router call, from the ids on both sides:
- **agreement**: the tokens whose expert SET differs (a flip), and, of the others, those whose
  weights (aligned by expert id) differ beyond the weights record's tolerance;
- **flips**, each labelled: "near-tie" when the reference's margin (the lowest router logit
  among the experts the candidate dropped minus the highest among those it took instead) is
  within NEAR_TIE_SIGMAS x sqrt 2 of the logit noise, "real" otherwise, "unknown" without
  logits (or when the reference did not select by logit order: a score-correction bias).
  The logit noise is the std of cand - ref router logits over the experts the flip does not
  involve (that token): rounding noise moves every logit a little, so a flip within a few
  of its sigmas is a near-tie; a fault that moves one expert's logit leaves the others
  alone, and its flip is real however small the margin;
- a flip in a request makes everything after it in that request (later layers, later steps:
  the KV cache holds the flipped token) compare different computations: those records are
  marked `after-flip` and not judged. The records of the flip's own MoE block whose rows are
  tokens (the weights, the experts' output, the block's output) are compared on the tokens
  routed alike (`masked`). The ids records are judged here, not as numbers (`ids`). Flips in
  router calls after a request's first flip follow it: counted, never "real". Records inside
  a fused experts module (act_fn's input: rows expert by expert, in an order that follows the
  top-k order) are `reordered`, not judged, when the two sides' ids differ at all (a swapped
  top-k order of the same experts included);

**Expert blame.** An expert that computes wrong shows on the tokens routed to it: per experts
module (over every request and step before a flip), the mean per-token relative error of the
experts' output on the tokens routed to each expert against the tokens not routed to it
(`ExpertBlame`); verdict.culprit names the expert when one stands out.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import numpy as np

from accucheck.compare.metrics import MetricAccumulator, TensorMetrics
from accucheck.keys import RecordKey
from accucheck.store import CaptureReader, IndexRow

# a flip is a near-tie when the reference's margin is within this many standard deviations of
# the difference of two logits' noise (sqrt 2 x the noise of one)
NEAR_TIE_SIGMAS = 3.0
MASKED, AFTER_FLIP, IDS, REORDERED = "masked", "after-flip", "ids", "reordered"
# not numbers the verdict judges (RecordDiff.within)
JUDGED_ELSEWHERE = (IDS, AFTER_FLIP, REORDERED)
# an expert is blamed when the mean error of its tokens is this many times the others', and
# this many times the next expert's ratio (an expert always routed with another is not told
# apart from it)
EXPERT_BLAME_RATIO = 4.0
EXPERT_BLAME_MARGIN = 2.0


@dataclass(frozen=True)
class RoutingFlip:
    key: RecordKey                 # the ids record (out.2) of the router call
    order: int
    token: int                     # row among the call's tokens
    ref_experts: tuple[int, ...]   # sorted
    cand_experts: tuple[int, ...]
    margin: float | None           # see the module docstring
    noise: float | None
    follows: bool = False          # in a router call after the request's first flip

    @property
    def near_tie(self) -> bool | None:
        if self.margin is None or self.noise is None:
            return None
        return self.margin <= NEAR_TIE_SIGMAS * math.sqrt(2.0) * self.noise

    @property
    def label(self) -> str:
        if self.follows:
            return "follows an earlier flip"
        nt = self.near_tie
        return "unknown" if nt is None else "near-tie" if nt else "real"

    def as_dict(self) -> dict:
        return {"key": str(self.key), "router": self.key.module, "req": self.key.req,
                "step": self.key.step, "token": self.token,
                "ref_experts": list(self.ref_experts), "cand_experts": list(self.cand_experts),
                "margin": self.margin, "noise": self.noise, "label": self.label}


@dataclass(frozen=True)
class RouterCall:
    key: RecordKey                 # the ids record
    order: int
    tokens: int
    top_k: int
    num_experts: int
    flipped: tuple[int, ...]       # token rows whose expert set differs
    weights_differ: int            # rows routed alike whose weights differ beyond tolerance
    weights_max: float             # largest per-token rel L2 of the aligned weights
    flips: tuple[RoutingFlip, ...]
    after_flip: bool = False       # an earlier router call of this request flipped

    @property
    def router(self) -> str:
        return self.key.module


@dataclass(frozen=True)
class ExpertBlame:
    """Per-token errors of one experts module's output, by expert (see module docstring)."""
    module: str
    call: int
    per_expert: tuple[tuple[int, int, float, float], ...]  # (expert, tokens, mean err of its
                                                            # tokens, mean err of the others)

    def ratios(self) -> list[tuple[float, int]]:
        out = []
        for e, n, mine, others in self.per_expert:
            if n == 0 or math.isnan(others):  # no token without it: nothing to compare with
                continue
            out.append((mine / others if others > 0 else math.inf if mine > 0 else 1.0, e))
        return sorted(out, reverse=True)

    @property
    def best(self) -> int | None:
        """The expert whose tokens carry the error, when one stands out; else None."""
        r = self.ratios()
        if not r or r[0][0] < EXPERT_BLAME_RATIO:
            return None
        if len(r) > 1 and not (r[0][0] >= EXPERT_BLAME_MARGIN * r[1][0]):
            return None
        return r[0][1]

    def as_dict(self) -> dict:
        return {"module": self.module, "call": self.call, "expert": self.best,
                "per_expert": [{"expert": e, "tokens": n, "error": m, "others": o}
                               for e, n, m, o in self.per_expert]}


@dataclass(frozen=True)
class RoutingResult:
    calls: tuple[RouterCall, ...]              # execution order (step, request, order)
    blame: tuple[ExpertBlame, ...] = ()
    forced: dict | None = None                 # the candidate's meta "routing_forced"

    @property
    def routers(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(c.router for c in self.calls))

    @property
    def tokens(self) -> int:
        return sum(c.tokens for c in self.calls)

    @property
    def flipped(self) -> int:
        return sum(len(c.flipped) for c in self.calls)

    @property
    def agreement(self) -> float:
        """Share of (token, router call) pairs whose expert set agrees."""
        return 1.0 - self.flipped / self.tokens if self.tokens else 1.0

    @property
    def flips(self) -> tuple[RoutingFlip, ...]:
        return tuple(f for c in self.calls for f in c.flips)

    @property
    def first_flip(self) -> RoutingFlip | None:
        return next(iter(self.flips), None)

    @property
    def first_flips(self) -> tuple[RoutingFlip, ...]:
        """Each request's flips in its first flipped router call (the ones that can be real)."""
        return tuple(f for f in self.flips if not f.follows)

    @property
    def real_flip(self) -> RoutingFlip | None:
        """The first flip that is not a near-tie (unknown counts: it cannot be shown to be one)."""
        return next((f for f in self.first_flips if f.near_tie is not True), None)

    def per_router(self) -> list[dict]:
        """Per router: tokens, flipped, weights differing, agreement, first flip."""
        out: dict[str, dict] = {}
        for c in self.calls:
            d = out.setdefault(c.router, {"router": c.router, "tokens": 0, "flipped": 0,
                                          "weights_differ": 0, "first_flip": None})
            d["tokens"] += c.tokens
            d["flipped"] += len(c.flipped)
            d["weights_differ"] += c.weights_differ
            if d["first_flip"] is None and c.flips:
                d["first_flip"] = c.flips[0].as_dict()
        for d in out.values():
            d["agreement"] = 1.0 - d["flipped"] / d["tokens"] if d["tokens"] else 1.0
        return list(out.values())

    def blame_for(self, module: str, call: int) -> ExpertBlame | None:
        return next((b for b in self.blame if b.module == module and b.call == call), None)

    def as_dict(self) -> dict:
        return {"routers": len(self.routers), "tokens": self.tokens, "flipped": self.flipped,
                "agreement": self.agreement, "forced": self.forced,
                "first_flip": self.first_flip.as_dict() if self.first_flip else None,
                "real_flip": self.real_flip.as_dict() if self.real_flip else None,
                "per_router": self.per_router(),
                "experts": [b.as_dict() for b in self.blame]}


# ----------------------------------------------------------------------------- finding calls

def _router_rows(R: CaptureReader, C: CaptureReader) -> list[tuple[IndexRow, IndexRow, IndexRow]]:
    """(logits, weights, ids) reference rows of every router call both sides recorded."""
    by_call: dict[tuple, dict[str, IndexRow]] = {}
    for row in R.rows:
        k = row.key
        if k.op is None and k.role == "out" and k.slot in ("0", "1", "2") and k in C:
            by_call.setdefault((k.req, k.step, k.module, k.call), {})[k.slot] = row
    out = []
    for slots in by_call.values():
        if set(slots) != {"0", "1", "2"}:
            continue
        lg, w, ids = slots["0"], slots["1"], slots["2"]
        if not (ids.dtype.startswith(("int", "uint")) and len(ids.shape) >= 2
                and tuple(w.shape) == tuple(ids.shape) and len(lg.shape) >= 2
                and _tokens(lg.shape) == _tokens(ids.shape)
                and lg.shape[-1] > ids.shape[-1] >= 1
                and not w.dtype.startswith(("int", "uint"))):
            continue
        out.append((lg, w, ids))
    return sorted(out, key=lambda t: (t[2].key.step, t[2].key.req, t[2].order))


def _tokens(shape) -> int:
    """Rows of a [..., tokens, x] record: every dimension but the last (vLLM's per-request
    records are [1, tokens, x], transformers' [tokens, x])."""
    return int(np.prod(shape[:-1]))


def _experts_module(router: str, meta: dict, present: set[str]) -> tuple[str | None, str | None]:
    """(experts module, MoE block) of `router`: from meta "moe", else its siblings by name."""
    info = ((meta.get("moe") or {}).get("routers") or {}).get(router)
    if isinstance(info, dict):
        return info.get("experts"), info.get("block")
    block = router.rpartition(".")[0]
    experts = f"{block}.experts" if block else "experts"
    return (experts if experts in present else None), (block or None)


# ----------------------------------------------------------------------------- analysis

def _rows(x: np.ndarray, n: int) -> np.ndarray | None:
    """`x` as [n, -1] when its leading dimensions hold n rows (tokens), else None."""
    if x.size == 0 or x.size % n:
        return None
    r = x.reshape(n, -1)
    lead = int(np.prod(x.shape[:-1])) if x.ndim > 1 else x.shape[0]
    return r if lead == n else None


def _flip(key, order, t, ids_r, ids_c, lg_r, lg_c, follows) -> RoutingFlip:
    ref, cand = tuple(sorted(int(i) for i in ids_r[t])), tuple(sorted(int(i) for i in ids_c[t]))
    margin = noise = None
    if lg_r is not None and lg_c is not None:
        dropped = [e for e in ref if e not in cand]
        taken = [e for e in cand if e not in ref]
        lr = lg_r[t].astype(np.float64)
        m = float(lr[dropped].min() - lr[taken].max())
        margin = m if m >= 0 else None  # not selected by logit order: no logit margin
        delta = lg_c[t].astype(np.float64) - lr
        others = np.delete(delta, dropped + taken)
        noise = float(np.std(others if others.size >= 2 else delta))
    return RoutingFlip(key, order, t, ref, cand, margin, noise, follows)


def metrics_on(a: np.ndarray, b: np.ndarray, ref_dtype: str, cand_dtype: str, tol,
               scale: float | None) -> TensorMetrics:
    acc = MetricAccumulator(ref_dtype, cand_dtype, rtol=tol.rtol, atol=tol.atol, scale=scale)
    acc.add(a, b)
    return acc.result()


def _rms(a: np.ndarray) -> float | None:
    a = a[np.isfinite(a)]
    return float(np.sqrt(np.mean(a.astype(np.float64) ** 2))) if a.size else None


def apply_routing(records: list, R: CaptureReader, C: CaptureReader,
                  tolerance: Callable[[IndexRow, IndexRow], object]
                  ) -> tuple[list, RoutingResult | None]:
    """The routing of every router call both sides recorded, and `records` (compare.diff
    RecordDiff, execution order) with the routing consequences applied (module docstring):
    `routing` set to "ids" / "masked" / "after-flip" / "reordered", masked records re-measured
    on the tokens routed alike (`rows_excluded` says how many were left out).
    `tolerance(ref_row, cand_row)` is the diff's tolerance for a record. None when no router
    call is found."""
    found = _router_rows(R, C)
    if not found:
        return records, None
    state = _Routing(records, R, C, tolerance)
    for lg, w, ids in found:
        if str(ids.key) in state.by_key and ids.has_data and C.row(ids.key).has_data:
            state.call(lg, w, ids)  # (an import without values: nothing to judge routing by)
    return state.finish(), RoutingResult(tuple(state.calls), tuple(_blame(state.blame)),
                                         C.meta.get("routing_forced") or None)


class _Routing:
    """apply_routing's work, router call by router call, in execution order."""

    def __init__(self, records: list, R: CaptureReader, C: CaptureReader, tolerance):
        self.R, self.C, self.tolerance = R, C, tolerance
        self.recs = list(records)
        self.by_key = {str(r.key): i for i, r in enumerate(records)}
        self.present = {r.key.module for r in R.rows}
        # records by (req, step, enclosing module): what sits inside a fused experts module
        self.inside: dict[tuple[int, int, str], list[int]] = {}
        for i, r in enumerate(records):
            parts = r.key.module.split(".")
            for n in range(1, len(parts)):
                self.inside.setdefault((r.key.req, r.key.step, ".".join(parts[:n])), []).append(i)
        self.calls: list[RouterCall] = []
        self.first: dict[int, tuple[int, int]] = {}   # req -> (step, order) of its first flip
        self.masked: set[str] = set()
        self.blame: dict[tuple[str, int], list] = {}

    def call(self, lg: IndexRow, w: IndexRow, ids: IndexRow) -> None:
        R, C, k = self.R, self.C, ids.key
        follows = k.req in self.first
        top = ids.shape[-1]
        ids_r, ids_c = R.read(ids.key).reshape(-1, top), C.read(ids.key).reshape(-1, top)
        if ids_c.shape != ids_r.shape:
            return
        n = ids_r.shape[0]
        sr, sc = np.sort(ids_r, axis=1), np.sort(ids_c, axis=1)
        flipped = np.flatnonzero((sr != sc).any(axis=1))
        keep = np.ones(n, dtype=bool)
        keep[flipped] = False
        experts_n = lg.shape[-1]
        lg_r = R.read(lg.key).reshape(n, experts_n) \
            if lg.has_data and C.row(lg.key).has_data and C.row(lg.key).shape == lg.shape \
            else None
        lg_c = C.read(lg.key).reshape(n, experts_n) if lg_r is not None else None
        flips = tuple(_flip(k, ids.order, int(t), ids_r, ids_c, lg_r, lg_c, follows)
                      for t in flipped)
        differ, wmax = (0, 0.0) if follows else self._weights(w, ids_r, ids_c, keep, flipped)
        j = self.by_key[str(k)]
        if self.recs[j].basis == "tensor":  # the expert sets of the tokens routed alike
            self.recs[j] = replace(
                self.recs[j], routing=IDS, rows_excluded=int(len(flipped)),
                metrics=metrics_on(sr[keep], sc[keep], ids.dtype, ids.dtype,
                                   self.tolerance(ids, C.row(ids.key)), None)
                if keep.any() else self.recs[j].metrics)
        experts, block = _experts_module(k.module, R.meta, self.present)
        if not follows:  # after a flip: finish() marks them after-flip
            if experts is not None and not np.array_equal(ids_r, ids_c):
                self._reordered(k, experts)
            for mod in (experts, block):
                if mod is not None:
                    self._block(k, mod, mod == experts, n, keep, flipped, sr)
        self.calls.append(RouterCall(k, ids.order, n, top, experts_n,
                                     tuple(int(t) for t in flipped), differ, wmax, flips,
                                     follows))
        if len(flipped) and not follows:
            self.first[k.req] = (k.step, ids.order)

    def _weights(self, w: IndexRow, ids_r, ids_c, keep, flipped) -> tuple[int, float]:
        """The weights record compared aligned by expert id (top-k order may differ for the
        same set) on the tokens routed alike; (tokens whose weights differ beyond tolerance,
        the largest per-token rel L2)."""
        i, cw = self.by_key.get(str(w.key)), self.C.row(w.key)
        if not (w.has_data and cw.has_data and i is not None
                and self.recs[i].basis == "tensor"):
            return 0, 0.0
        n, top = ids_r.shape
        wr = np.take_along_axis(self.R.read(w.key).reshape(n, top), np.argsort(ids_r, 1), 1)
        wc = np.take_along_axis(self.C.read(w.key).reshape(n, top), np.argsort(ids_c, 1), 1)
        tol = self.tolerance(w, cw)
        num = np.linalg.norm((wc - wr).astype(np.float64)[keep], axis=1)
        den = np.maximum(np.linalg.norm(wr.astype(np.float64)[keep], axis=1), 1e-300)
        per = num / den
        if keep.any():
            self.recs[i] = replace(self.recs[i], routing=MASKED if len(flipped) else None,
                                   rows_excluded=int(len(flipped)),
                                   metrics=metrics_on(wr[keep], wc[keep], w.dtype, cw.dtype,
                                                      tol, _rms(wr[keep])))
            self.masked.add(str(w.key))
        else:  # every token went elsewhere: nothing alike to compare
            self.recs[i] = replace(self.recs[i], routing=AFTER_FLIP, rows_excluded=n)
        return int((per > tol.rel_l2).sum()), float(per.max(initial=0.0))

    def _reordered(self, k: RecordKey, experts: str) -> None:
        """Inside the experts module rows go expert by expert in an order that follows the
        top-k order, which differs (even for the same sets): not comparable row by row."""
        for j in self.inside.get((k.req, k.step, experts), ()):
            r = self.recs[j]
            if r.routing is None:
                self.recs[j] = replace(r, routing=REORDERED)
                self.masked.add(str(r.key))

    def _block(self, k: RecordKey, mod: str, is_experts: bool, n: int, keep, flipped, sr
               ) -> None:
        """The experts' / the MoE block's output of this call: its rows are tokens; compared on
        the tokens routed alike, and (the experts') kept for the expert blame."""
        key = f"r{k.req}.s{k.step}:{mod}#{k.call}:out.0"
        j = self.by_key.get(key)
        if j is None or self.recs[j].basis != "tensor":
            return
        ar, br = _rows(self.R.read(key), n), _rows(self.C.read(key), n)
        if ar is None or br is None or ar.shape != br.shape:
            return
        if is_experts and keep.any():
            self.blame.setdefault((mod, k.call), []).append((ar[keep], br[keep], sr[keep]))
        if len(flipped) and not keep.any():
            self.recs[j] = replace(self.recs[j], routing=AFTER_FLIP, rows_excluded=n)
            self.masked.add(key)
        elif len(flipped):
            r = self.recs[j]
            tol = self.tolerance(self.R.row(key), self.C.row(key))
            self.recs[j] = replace(r, routing=MASKED, rows_excluded=int(len(flipped)),
                                   metrics=metrics_on(ar[keep], br[keep], r.ref_dtype,
                                                      r.cand_dtype, tol, _rms(ar[keep])))
            self.masked.add(key)

    def finish(self) -> list:
        """Every record after its request's first flip (later layers, later steps) that is
        not already judged otherwise: after-flip."""
        for i, r in enumerate(self.recs):
            f = self.first.get(r.key.req)
            if f is not None and (r.key.step, r.order) > f and str(r.key) not in self.masked \
                    and r.routing != IDS:
                self.recs[i] = replace(r, routing=AFTER_FLIP)
        return self.recs


def _blame(parts: dict[tuple[str, int], list]) -> list[ExpertBlame]:
    out = []
    for (module, call), items in parts.items():
        errs, sets = [], []
        for a, b, s in items:
            a64, b64 = a.astype(np.float64), b.astype(np.float64)
            num = np.linalg.norm(b64 - a64, axis=1)
            den = np.linalg.norm(a64, axis=1)
            errs.append(np.where(den > 0, num / np.maximum(den, 1e-300), num))
            sets.append(s)
        err = np.concatenate(errs)
        ids = np.concatenate(sets)
        per = []
        for e in np.unique(ids):
            mine = (ids == e).any(axis=1)
            per.append((int(e), int(mine.sum()), float(err[mine].mean()),
                        float(err[~mine].mean()) if (~mine).any() else math.nan))
        out.append(ExpertBlame(module, call, tuple(per)))
    return out


def flip_line(f: RoutingFlip) -> str:
    """"r0.s0:model.layers.1.mlp.gate#0 token 3: experts [1, 5] -> [1, 6] (near-tie: margin
    0.0021, logit noise 0.0034)"."""
    why = "" if f.margin is None or f.noise is None else \
        f": margin {f.margin:.3g}, logit noise {f.noise:.3g}"
    return (f"r{f.key.req}.s{f.key.step}:{f.key.module}#{f.key.call} token {f.token}: experts "
            f"{list(f.ref_experts)} -> {list(f.cand_experts)} ({f.label}{why})")


def routing_notes(records: Sequence, routing: RoutingResult, ref: str) -> list[str]:
    """What the reader must know about routing in a diff (its notes)."""
    out = []
    if routing.forced:
        what = "expert ids and weights" if routing.forced.get("weights") else "expert ids"
        out.append(f"the candidate's MoE routing was forced to the {what} of "
                  f"{routing.forced.get('from')} (--routing-from)")
    out.append(f"MoE routing: {len(routing.calls)} router calls, {routing.flipped} of "
               f"{routing.tokens} token routings differ (agreement {100 * routing.agreement:.2f} %)"
               + (f"; first flip {flip_line(routing.first_flip)}" if routing.first_flip else ""))
    n = {s: sum(r.routing == s for r in records) for s in (MASKED, AFTER_FLIP, REORDERED)}
    if n[AFTER_FLIP]:
        out.append(f"{n[AFTER_FLIP]} records come after a routing flip in their request and are "
                   f"not judged (they compare other experts' computations): re-capture the "
                   f"candidate with --routing-from {ref} to compare past it")
    if n[REORDERED]:
        out.append(f"{n[REORDERED]} records inside fused experts modules are not judged: their "
                   f"rows follow the top-k order of the expert ids, which differs between the "
                   f"sides (--routing-from makes it the same)")
    if n[MASKED]:
        out.append(f"{n[MASKED]} records of a flipped MoE block are compared on the tokens "
                   f"routed alike only")
    return out
