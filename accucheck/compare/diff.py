"""Align two captures by record key and measure every pair. Imports errors, keys, store, metrics,
tolerances; never torch (so `accucheck diff` starts fast and runs without torch).

`diff_captures(ref, cand, golden=None, ...)` -> `DiffResult` (its records: compare.results):

- Alignment is by record key (never by position). Keys present on one side only are listed in
  `missing`; records whose shapes differ are kept with basis "shape" and fail. Tolerances come
  from the two runs' compute dtypes (meta "dtype", see compare.tolerances): a record held in
  another dtype on each side while the runs share one is a precision finding
  (`DiffResult.precision_findings`), never a looser tolerance.
- Prompts must match request by request, else UserError (exit 3). Generated tokens may differ:
  then only the steps up to and including the first differing token's step are compared (that
  step's logits are what chose the different token), and a note says so loudly.
- When both sides hold the tensor (store "full"), metrics are exact (compare.metrics, chunked,
  bounded memory). Otherwise the index statistics give a LOWER BOUND on rel_l2 (basis "stats"):
  a failure is certain, a pass is weaker, and the result says so.
- Logits records (kind "logits") also get per-position KL(ref||cand), top-1 agreement, top-5
  overlap and the reference top-1/top-2 margin; the first token flip is a "near-tie" when that
  margin is at most NEAR_TIE_FACTOR (8) x the logit noise (the spread of cand - ref over the
  reference's top-32 logits, compare.metrics.logit_noise) at that position.
- With a golden capture, each record gets `cand worse` / `ref worse` / `both within noise` from
  RMSE(cand, golden) vs RMSE(ref, golden) with a multiplier (2 for fp32, 3 for 16-bit runs) and
  a floor of a tenth of the tolerance; the referee then decides `within` (a record fails only
  when the candidate is worse), `within_tolerance` keeps the tolerance's verdict.
- Producer links the capture stored (/index/extra "src") travel with each record as `src`, for
  accucheck.verdict.locate's input errors.
- Candidate records with role "shadow" (shadow replay) are paired with the reference's "out"
  record of the same site: their error is the local error of that module.
- Op records inside a module call whose outputs are identical on both sides are `absorbed`:
  within, whatever the op pairing across fused kernels measured.

`result.within` is True when every aligned record is within tolerance (or, refereed, no worse
than the reference) and no token flip is real. Results have no __bool__: ask `within`.
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import replace
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np

from accucheck.compare.compat import check_same_model, logits_notes
from accucheck.compare.control import check_control
from accucheck.errors import EXIT_USAGE, UserError
from accucheck.keys import RecordKey
from accucheck.compare.metrics import (DTYPE_EPS, MetricAccumulator, TensorMetrics,
                                       identical_metrics, is_float_dtype, kl_div, logit_noise,
                                       top2_margin, topk_overlap)
from accucheck.compare.mapping import MappedCapture, mapping_table, maybe_mapped
from accucheck.compare.opmatch import align_captures
from accucheck.compare.parallel import (data_bytes, measure, nbytes, progress_line,
                                        square_sum_positive, unread_pair)
from accucheck.compare.shards import ShardGroup, rank_notes, rank_pairs
from accucheck.compare.topk import TopkSide, compare_topk, ids_key
from accucheck.compare.transforms import Transform, find_record
from accucheck.compare.transforms import apply as apply_transform
from accucheck.compare.routing import JUDGED_ELSEWHERE, apply_routing, routing_notes
from accucheck.store import (LOGITS_IDS_SLOT, SAMPLE_SIZE, CaptureReader, IndexRow, Selection,
                             logits_topk, open_capture,
                             sample_positions, sketch_rel)
from accucheck.compare.tolerances import (GOLDEN_MULTIPLIER, Tolerance, ToleranceTable, _matches,
                                          loosest_dtype)
from accucheck.compare.observer import observer_notes
from accucheck.compare.results import (DiffResult, GoldenLabel, LogitsPosition,
                                       LogitsStep, MissingKey, RecordDiff, StatsDelta, TokenFlip)
from accucheck.compare.weights import weight_notes

Progress = Callable[[str], None]
PROGRESS_EVERY_S = 2.0   # at most one progress line this often


# ----------------------------------------------------------------------------- diff

def diff_captures(ref: str | os.PathLike | CaptureReader, cand: str | os.PathLike | CaptureReader,
                  golden: str | os.PathLike | CaptureReader | None = None, *,
                  tolerances: ToleranceTable | None = None,
                  steps: Iterable[int] | None = None, include: Sequence[str] = (),
                  allow_incomplete: bool = False, max_elems: int = 1 << 20,
                  progress: Progress | None = None,
                  allow_model_mismatch: bool = False,
                  controls: Sequence[str | os.PathLike | CaptureReader] = (),
                  transforms: Sequence[Transform] = (), jobs: int | None = 1,
                  ray: str | None = None) -> DiffResult:
    """Compare candidate against reference (and both against `golden` when given).

    `jobs`: processes measuring the record pairs (compare.parallel; 1, the default here: this
    process only; the CLI's --jobs defaults to the cores available). The result is the same,
    bit for bit, whatever `jobs`; a small diff (under compare.parallel.MIN_PARALLEL_BYTES of
    tensors to read) stays in this process. Records whose content hashes (/index/hash) are
    equal on both sides are measured without reading them; `DiffResult.io` says how many bytes
    were read of how many. `ray`: a Ray address ("local", "auto", "HOST:6379", ...): the pairs
    are measured as Ray tasks on that cluster instead (compare.ray_tasks; `jobs` then caps the
    tasks in flight, None: the cluster's CPUs), the same result again.

    `transforms`: declared transforms of one side's records before they are compared
    (compare.transforms; `--transform`); one that matches no record is a UserError.

    `controls`: control runs (compare.control: the reference's code at the candidate's dtype,
    forced to the reference's tokens); each record then carries err(CTL_i, REF) in `control`,
    measured the same way as the candidate's error (verdict.noise judges the ratio).

    Captures of different model architectures (config hash in meta) are refused (UserError,
    exit 3) unless `allow_model_mismatch` (accucheck.compare.compat).

    `steps`: compare only these steps; `include`: only keys matching one of these globs (matched
    like tolerance overrides: full key, key without request/step, or module path). Paths are
    opened and closed here; open readers are used as they are. Raises UserError (exit 3) for
    unreadable / incomplete / incompatible captures.
    """
    if not (jobs is None and ray is not None) and (not isinstance(jobs, int) or jobs < 1):
        raise UserError.usage(f"jobs {jobs!r}: give a number of processes >= 1")
    if ray is not None:
        from accucheck.compare.ray_tasks import check_address

        check_address(ray)
    tol = tolerances or ToleranceTable()
    opened: list[CaptureReader] = []

    def _open(x):
        if x is None or isinstance(x, CaptureReader):
            return x
        r = open_capture(x, allow_incomplete=allow_incomplete)
        opened.append(r)
        return r

    try:
        # vLLM's fused records shown as transformers' leaves (compare.mapping)
        R, C, G = (maybe_mapped(x) if x is not None else None
                   for x in (_open(ref), _open(cand), _open(golden)))
        check_same_model(R, C, G, allow_model_mismatch=allow_model_mismatch)
        T = [maybe_mapped(_open(x)) for x in controls]
        notes = [n for t in T for n in check_control(
            R, t, C, allow_model_mismatch=allow_model_mismatch)]
        result = _Differ(R, C, G, tol, steps, include, max_elems, progress,
                         tuple(transforms), jobs=jobs, ray=ray).run()
        result = with_mapping(result, R, C)
        return with_controls(result, [_Differ(R, t, None, tol, steps, include, max_elems,
                                              None, jobs=jobs, ray=ray).run() for t in T], notes)
    finally:
        if ray is not None:
            from accucheck.compare.ray_tasks import shutdown

            shutdown()
        for r in opened:
            r.close()


def with_mapping(d: DiffResult, R, C) -> DiffResult:
    """`d` with the vLLM mapping used (compare.mapping), said once in the notes and kept for
    the JSON; `d` itself when neither side is a mapped vLLM capture."""
    sides = {name: x for name, x in (("ref", R), ("cand", C)) if isinstance(x, MappedCapture)}
    if not sides:
        return d
    config = ((next(iter(sides.values())).meta.get("model") or {}).get("config")) or {}
    used = {name: {"mapped": len(x.mapped), "statistics_only": x.unmapped}
            for name, x in sides.items()}
    notes = [f"vLLM's fused records shown as transformers' ({', '.join(sides)}): qkv_proj -> "
             f"q/k/v_proj, gate_up_proj -> gate/up_proj, attn -> o_proj in, act_fn -> "
             f"down_proj in, the fused add+norm's residual -> post_attention_layernorm in; "
             + "; ".join(f"{n}: {u['mapped']} mapped" + (f", {u['statistics_only']} left "
                                                          f"(statistics only: --store full)"
                                                          if u["statistics_only"] else "")
                         for n, u in used.items())]
    return replace(d, notes=d.notes + tuple(notes),
                   mapping={"sides": used, "table": mapping_table(config)})


def with_controls(d: DiffResult, ctl: Sequence[DiffResult], notes: Sequence[str] = ()
                  ) -> DiffResult:
    """`d` with each record's error in every control run (`RecordDiff.control`): `ctl` are
    the diffs of the control runs against the same reference (what `diff_captures(...,
    controls=...)` computes; a benchmark judging many candidates reuses them)."""
    if not ctl:
        return d
    # a control record after a routing flip of the control's own (MoE) measures other experts'
    # computations, not noise: the record has no control value then (not judged by the rule)
    # one measure on both sides: the sketches' where the candidate and every control have one,
    # else the samples' (an RMS and a mean of relative errors differ x2-x3)
    errs = [{str(r.key): r for r in c.records if r.routing not in JUDGED_ELSEWHERE} for c in ctl]
    recs = []
    for r in d.records:
        k = str(r.key)
        if not all(k in e for e in errs):
            recs.append(r)
            continue
        cs = [e[k] for e in errs]
        if r.sketch is None or any(c.sketch is None for c in cs):
            r, cs = replace(r, sketch=None), [replace(c, sketch=None) for c in cs]
        recs.append(replace(r, control=tuple(c.elem_error for c in cs)))
    recs = tuple(recs)
    return replace(d, records=recs, notes=d.notes + tuple(notes),
                   control_paths=tuple(c.cand_path for c in ctl))


class _Differ:
    def __init__(self, R: CaptureReader, C: CaptureReader, G: CaptureReader | None,
                 tol: ToleranceTable, steps, include, max_elems: int, progress,
                 transforms: tuple[Transform, ...] = (), *, jobs: int | None = 1,
                 ray: str | None = None):
        self.R, self.C, self.G = R, C, G
        self.jobs = jobs
        self.ray = ray       # a Ray address: measured as Ray tasks (compare.ray_tasks)
        self.bytes_read = 0  # tensor bytes read by the comparisons (all sides)
        self.unread = 0      # pairs measured from their equal content hashes, not read
        self.processes = 1   # processes that measured the pairs (compare.parallel)
        self.cpu_s = 0.0     # CPU seconds spent measuring them, all processes together
        self.transforms = transforms
        self._applied: dict[str, list[int]] = {t.text: [0, 0] for t in transforms}
        self.tol = tol
        self.steps = None if steps is None else set(int(s) for s in steps)
        self.include = tuple(include)
        self.max_elems = max_elems
        self.progress = progress
        self.notes: list[str] = []
        self.compute = (_meta_dtype(R.meta), _meta_dtype(C.meta))
        self._rank_keys: dict[tuple[str, str], RecordKey] = {}
        # capture --positions: prefill records of other positions compare on the common ones
        self.other_positions = Selection.of(R.meta).positions != Selection.of(C.meta).positions
        # capture --logits topk:K: logits compared on the tokens both sides hold (compare.topk)
        self.topk = (logits_topk(R.meta), logits_topk(C.meta))

    # -- tokens
    def _token_limits(self) -> tuple[dict[int, int | None], TokenFlip | None]:
        """Per request: last comparable step (None = all). Also the first flip seen in the
        generated ids (without logits; refined later from logits when stored)."""
        rr, cr = self.R.requests, self.C.requests
        if len(rr) != len(cr):
            raise UserError(f"{self.R.path} has {len(rr)} prompts, {self.C.path} has {len(cr)}: "
                            f"capture both with the same prompts")
        limits: dict[int, int | None] = {}
        flip = None
        for i, (a, b) in enumerate(zip(rr, cr)):
            pa, pb = np.asarray(a.prompt_ids), np.asarray(b.prompt_ids)
            if pa.shape != pb.shape or not np.array_equal(pa, pb):
                n = min(pa.size, pb.size)
                where = next((j for j in range(n) if pa[j] != pb[j]), n)
                raise UserError(
                    f"{self.R.path} and {self.C.path} were captured on different prompts "
                    f"(request {i} differs at token {where}): capture both with the same "
                    f"--prompt (and the same tokenizer)")
            ga, gb = np.asarray(a.generated_ids), np.asarray(b.generated_ids)
            n = min(ga.size, gb.size)
            j = next((k for k in range(n) if ga[k] != gb[k]), None)
            limits[i] = j
            if j is not None:
                self.notes.append(
                    f"generated tokens differ in request {i} at step {j} (ref {int(ga[j])}, "
                    f"cand {int(gb[j])}): steps after {j} run on different inputs and are NOT "
                    f"compared; re-capture the candidate with --tokens-from {self.R.path} to "
                    f"compare every step")
                if flip is None:
                    flip = TokenFlip(i, j, -1, int(ga[j]), int(gb[j]), None, None, True,
                                     "tokens")
        return limits, flip

    def _golden_limits(self) -> dict[int, int | None]:
        rr, gr = self.R.requests, self.G.requests
        if len(rr) != len(gr) or any(
                not np.array_equal(a.prompt_ids, g.prompt_ids) for a, g in zip(rr, gr)):
            raise UserError(f"golden {self.G.path} was captured on other prompts than "
                            f"{self.R.path}: capture it with --tokens-from {self.R.path}")
        out = {}
        for i, (a, g) in enumerate(zip(rr, gr)):
            ga, gg = np.asarray(a.generated_ids), np.asarray(g.generated_ids)
            n = min(ga.size, gg.size)
            j = next((k for k in range(n) if ga[k] != gg[k]), None)
            out[i] = j
            if j is not None:
                self.notes.append(f"golden tokens differ from the reference in request {i} at "
                                  f"step {j}: no golden labels after step {j}; capture the golden "
                                  f"with --tokens-from {self.R.path}")
        return out

    def _wanted(self, key: RecordKey) -> bool:
        if self.steps is not None and key.step not in self.steps:
            return False
        return not self.include or any(_matches(p, key) for p in self.include)

    # -- main
    def run(self) -> DiffResult:
        limits, flip = self._token_limits()
        self.notes += logits_notes(self.R, self.C)   # raw against processed: refused
        self.notes += weight_notes(self.R.meta, self.C.meta)  # accucheck.compare.weights
        glimits = self._golden_limits() if self.G is not None else {}

        def comparable(key: RecordKey, lim: dict) -> bool:
            j = lim.get(key.req)
            return j is None or key.step <= j

        pairs, missing, shadows, joined, ops, gops = self._pairs()

        records: list[RecordDiff] = []
        logits: list[LogitsStep] = []
        skipped = 0
        stats_only = 0
        work: list[tuple] = []  # (pair number, ref row, cand row, golden row, shadow row)
        for n, (ra, ca) in enumerate(pairs):
            if not comparable(ra.key, limits):
                skipped += 1
                continue
            grow = None
            if self.G is not None and ra.key.op is not None:
                grow = gops.get(str(ra.key)) if comparable(ra.key, glimits) else None
            elif self.G is not None and ra.key in self.G and comparable(ra.key, glimits):
                grow = self.G.row(ra.key)
            work.append((n, ra, ca, grow, shadows.get(str(ra.key))))
        run = measure
        if self.ray is not None:  # asked for by name: on Ray whatever the size
            from accucheck.compare.ray_tasks import measure_ray as run
        for (_n, ra, ca, _g, _s), (rd, ls) in zip(work, run(self, work, len(pairs))):
            rank_key = self._rank_keys.get((str(ra.key), str(ca.key)))
            if rank_key is not None:  # one rank's copy: reported under its own key
                rd = replace(rd, key=rank_key, cand_key=None)
            stats_only += rd.basis in ("stats", "sample")
            records.append(rd)
            if ls is not None:
                logits.append(ls)
        records += [rd for rd in joined if comparable(rd.key, limits)]
        records.sort(key=lambda rd: rd.order)  # stable: a rank's copy right after the copy
        records = _absorb(records)
        self.notes += self.transform_notes()
        records, routing = apply_routing(records, self.R, self.C, self._row_tolerance)
        if routing is not None:
            self.notes += routing_notes(records, routing, str(self.R.path))
        absorbed = sum(r.absorbed for r in records)
        if absorbed:
            self.notes.append(
                f"{absorbed} op records differ inside module calls whose outputs are identical "
                f"on both sides (a fused kernel against decomposed ops): not judged, the module "
                f"computes the same")
        if stats_only:
            self.notes.append(
                f"{stats_only} of {len(records)} records have statistics only (capture with "
                f"--store full for exact metrics): their verdict uses a lower bound on rel_l2 "
                f"and, where both files hold the sampled values, an estimate from "
                f"{SAMPLE_SIZE} of them; weaker: a pass there does not prove agreement")
        if missing:
            n_ref = sum(m.only_in == "ref" for m in missing)
            self.notes.append(f"{len(missing)} keys on one side only ({n_ref} only in ref, "
                              f"{len(missing) - n_ref} only in cand): see `missing`")
        self.notes += observer_notes(  # graph-mode captures (accucheck.compare.observer)
            self.R.meta, self.C.meta,
            max((r.error for r in records if r.kind == "logits"), default=None))
        first, flips = self._flips(logits, flip)
        compared = tuple((i, -1 if j is None else j) for i, j in sorted(limits.items()))
        return DiffResult(str(self.R.path), str(self.C.path),
                          str(self.G.path) if self.G is not None else None,
                          tuple(records), tuple(missing), tuple(logits), first, flips, compared,
                          skipped, tuple(self.notes), self.tol, ops, self.compute,
                          routing=routing, io=self.io())

    def _pairs(self) -> tuple[list, list[MissingKey], dict, list[RecordDiff], object, dict]:
        """What is compared with what: (ref row, cand row) pairs in execution order (module
        records by key, op records by alignment inside each module call, a rank's differing
        copy under its own key), the keys on one side only, shadow rows by the key they
        replay, the tensor-parallel shards joined and measured, the op alignment and the
        golden's op rows. Adds the pairing's notes; UserError when nothing pairs."""
        shadows: dict[str, IndexRow] = {}
        for row in self.C.rows:
            if row.key.role == "shadow" and row.key not in self.R:
                shadows[str(row.key.with_role("out"))] = row
        # op records (role in/out) pair by alignment inside each module call, never by key
        # (accucheck.compare.opmatch): ops on one side only are "fused / absent", not missing keys
        missing = [MissingKey(str(r.key), "ref") for r in self.R.rows
                   if self._wanted(r.key) and r.key not in self.C and r.key.op is None]
        missing += [MissingKey(str(r.key), "cand") for r in self.C.rows
                    if self._wanted(r.key) and r.key not in self.R
                    and (r.key.op is None or r.key.role == "shadow")
                    and not (r.key.role == "shadow" and str(r.key.with_role("out")) in self.R)]
        pairs = [(r, self.C.row(r.key)) for r in self.R.rows
                 if self._wanted(r.key) and r.key in self.C and r.key.op is None]
        # tensor-parallel copies (accucheck.capture.record.ranks): a rank's differing copy of a
        # replicated tensor is compared with the other side's one copy, under its own key
        ranked, shards = rank_pairs(self.R, self.C, self._wanted)
        joined, unjoined = self._join_shards(shards)
        if ranked or shards:
            paired = {str(k) for _a, _b, k in ranked} | {
                str(k) for g in shards for k in (*g.keys, g.whole.key)}
            missing = [m for m in missing if m.key not in paired]
            pairs += [(a, b) for a, b, _k in ranked]  # records are put in order below
            self._rank_keys = {(str(a.key), str(b.key)): k for a, b, k in ranked}
        if unjoined:
            self.notes.append(
                f"{unjoined} tensor-parallel shard records (meta tensor_parallel.shards) are "
                f"not compared with the unsharded tensor of the other side: their layout is "
                f"packed (fused q|k|v or gate|up per rank), or a side has statistics only "
                f"(capture with --store full), or the parts do not add up to its shape")
        self.notes += rank_notes(self.R, self.C)
        ops, gops = None, {}
        if any(r.key.op is not None for r in self.R.rows):
            wanted = self._wanted
            if self.other_positions:  # ops pair by their shapes: a prefill's differ in length
                wanted = lambda k: k.step != 0 and self._wanted(k)  # noqa: E731
                self.notes.append("op records of the prefill are not compared: the captures "
                                  "record other prefill positions (capture --positions); their "
                                  "module records are")
            op_pairs, ops = align_captures(self.R, self.C, wanted)
            pairs = sorted(pairs + op_pairs, key=lambda p: p[0].order)
            if self.G is not None:
                gops = {str(a.key): g for a, g in align_captures(self.R, self.G,
                                                                 self._wanted)[0]}
            if ops.one_sided:
                n_ref = sum(o.only_in == "ref" for o in ops.one_sided)
                self.notes.append(
                    f"{len(ops.one_sided)} op calls on one side only ({n_ref} only in ref, "
                    f"{len(ops.one_sided) - n_ref} only in cand): fused or absent there, not "
                    f"errors; {ops.n_fused} fused regions compared by their final output")
        missing, pairs = self._selected(missing, pairs)
        if any(self.topk):
            missing, pairs = self._topk_pairs(missing, pairs)
        if not pairs and not missing:
            raise UserError(f"no records to compare between {self.R.path} and {self.C.path} "
                            f"(check --step / --include)")
        if not pairs:
            raise UserError(f"{self.R.path} and {self.C.path} have no record key in common: "
                            f"were they captured from the same model with the same --include?")
        return pairs, missing, shadows, joined, ops, gops

    def _selected(self, missing: list[MissingKey], pairs: list) -> tuple[list, list]:
        """What each capture chose to record (capture --positions / --requests / --layers,
        store.Selection): a key one side did not select is not missing there; prefill records
        of different positions compare on the positions both hold (`_narrowed`: full store), or
        not at all (statistics of other positions do not compare). Says so in the notes."""
        sr, sc = Selection.of(self.R.meta), Selection.of(self.C.meta)
        if not (sr.partial or sc.partial):
            return missing, pairs
        unselected = [m for m in missing
                      if not (sc if m.only_in == "ref" else sr).recorded(RecordKey.parse(m.key))]
        self.notes.append(f"recorded: ref {sr.describe()}; cand {sc.describe()}: compared "
                          f"where both recorded"
                          + (f" ({len(unselected)} records one side did not select are not "
                             f"missing)" if unselected else ""))
        if unselected:
            gone = {m.key for m in unselected}
            missing = [m for m in missing if m.key not in gone]
        if self.other_positions:
            apart = [(a, b) for a, b in pairs if a.key.step == 0 and a.shape != b.shape
                     and not (a.has_data and b.has_data)]
            if apart:
                drop = {id(a) for a, _ in apart}
                pairs = [(a, b) for a, b in pairs if id(a) not in drop]
                self.notes.append(
                    f"{len(apart)} prefill records not compared: the captures record other "
                    f"prefill positions (ref {sr.positions}, cand {sc.positions}) and hold "
                    f"statistics only there (statistics of other positions do not compare): "
                    f"capture both with the same --positions, or with --store full")
        return missing, pairs

    def _topk_pairs(self, missing: list[MissingKey], pairs: list) -> tuple[list, list]:
        """A side holds top-k logits (capture --logits topk:K): their ids records (slot "1")
        go with the values, never compared or missing alone; logits a side holds as
        statistics of the full vocabulary do not compare with top-k values (left out, said).
        Says what is compared."""
        def ids_row(key: RecordKey) -> bool:
            return key.is_logits and key.slot == LOGITS_IDS_SLOT

        missing = [m for m in missing if not ids_row(RecordKey.parse(m.key))]
        pairs = [(a, b) for a, b in pairs if not ids_row(a.key)]
        unread = [(a, b) for a, b in pairs if a.kind == "logits" and a.key.op is None
                  and not (a.has_data and b.has_data)]
        if unread:
            drop = {id(a) for a, _ in unread}
            pairs = [(a, b) for a, b in pairs if id(a) not in drop]
        kr, kc = self.topk
        say = lambda k: f"top-{k} log-probabilities" if k else "full logits"  # noqa: E731
        self.notes.append(
            f"logits: ref holds {say(kr)}, cand {say(kc)} (capture --logits): compared on the "
            f"tokens both hold at each position; KL over those tokens and the rest of the "
            f"vocabulary as one outcome (a lower bound on the full KL); top-1 and the "
            f"top-1 / top-2 margin exact"
            + (f"; {len(unread)} logits records not compared: a side holds full logits as "
               f"statistics only (capture it with --store full or --logits topk:K)"
               if unread else ""))
        return missing, pairs

    def _topk(self, ra: IndexRow, ca: IndexRow, tol: Tolerance, base: dict
              ) -> tuple[RecordDiff, LogitsStep]:
        """A logits record where a side holds top-k log-probabilities (compare.topk)."""
        sides = []
        for reader, row, k in ((self.R, ra, self.topk[0]), (self.C, ca, self.topk[1])):
            values = reader.read(row.key)
            ids = reader.read(ids_key(row.key)) if k else None
            self.bytes_read += nbytes(row) + (nbytes(reader.row(ids_key(row.key))) if k else 0)
            sides.append((values, ids))
        (va, ia), (vb, ib) = sides
        rows = min(int(np.prod(va.shape[:-1])), int(np.prod(vb.shape[:-1])))
        cut = lambda x: None if x is None else x.reshape(-1, x.shape[-1])[-rows:]  # noqa: E731
        metrics, positions = compare_topk(
            TopkSide(cut(va), cut(ia)), TopkSide(cut(vb), cut(ib)), ra.dtype, ca.dtype,
            rtol=tol.rtol, atol=tol.atol)
        return RecordDiff(basis="tensor", metrics=metrics, **base), \
            LogitsStep(ra.key, tuple(positions))

    def io(self) -> dict:
        """Tensor bytes read against the captures' tensor data (ref + cand, + golden), the
        processes that measured the pairs and their CPU seconds (see DiffResult.io)."""
        sides = [x for x in (self.R, self.C, self.G) if x is not None]
        return {"bytes_read": self.bytes_read, "bytes_data": sum(map(data_bytes, sides)),
                "unread_identical": self.unread, "jobs": self.processes,
                "cpu_s": self.cpu_s}

    def measure_serial(self, work: Sequence[tuple], total: int
                       ) -> list[tuple[RecordDiff, LogitsStep | None]]:
        """`_compare` of every work item in this process, with progress lines: the first at
        once, then one every PROGRESS_EVERY_S."""
        out: list[tuple[RecordDiff, LogitsStep | None]] = []
        said, start, cpu = -math.inf, time.perf_counter(), time.process_time()
        for n, ra, ca, grow, shadow in work:
            if self.progress and (not out or time.monotonic() - said >= PROGRESS_EVERY_S):
                said = time.monotonic()   # the start, then a line every 2 s of a long diff
                self.progress(progress_line(n, total, self.bytes_read,
                                            time.perf_counter() - start))
            out.append(self._compare(ra, ca, grow, shadow))
        self.cpu_s += time.process_time() - cpu
        return out

    def _row_tolerance(self, ra: IndexRow, ca: IndexRow) -> Tolerance:
        return self.tol.for_record(ra.key, self._tolerance_dtypes(ra.dtype, ca.dtype))

    def _join_shards(self, groups: list["ShardGroup"]) -> tuple[list[RecordDiff], int]:
        """Each rank's part of a "concat" shard compared with its slice (last dimension, rank
        order) of the other side's unsharded tensor, under the part's own key: the joined
        comparison, with the rank named. Returns the records and how many shard records could
        not be compared (packed layout, statistics only, parts that do not fit)."""
        out, skipped = [], 0
        for g in groups:
            rows = g.rows
            width = sum(r.shape[-1] for r in rows if r.shape)
            if (g.layout != "concat" or not g.whole.has_data or not all(r.has_data for r in rows)
                    or any(tuple(r.shape[:-1]) != tuple(g.whole.shape[:-1]) for r in rows)
                    or not g.whole.shape or width != g.whole.shape[-1]):
                skipped += len(rows)
                continue
            whole = (self.C if g.sharded_is_ref else self.R).read(g.whole.key)
            self.bytes_read += nbytes(g.whole) + sum(nbytes(r) for r in rows)
            start = 0
            for row in rows:
                part = (self.R if g.sharded_is_ref else self.C).read(row.key)
                piece = whole[..., start:start + row.shape[-1]]
                start += row.shape[-1]
                a, b = (part, piece) if g.sharded_is_ref else (piece, part)
                ra, ca = (row, g.whole) if g.sharded_is_ref else (g.whole, row)
                tol = self.tol.for_record(row.key, self._tolerance_dtypes(ra.dtype, ca.dtype))
                acc = MetricAccumulator(ra.dtype, ca.dtype, rtol=tol.rtol, atol=tol.atol)
                acc.add(a, b)
                out.append(RecordDiff(
                    key=row.key, kind=row.kind, order=ra.order, ref_dtype=ra.dtype,
                    cand_dtype=ca.dtype, ref_shape=tuple(a.shape), cand_shape=tuple(b.shape),
                    tolerance=tol, cand_key=None, src=_links(ra) or _links(ca),
                    basis="tensor", metrics=acc.result(), ref_stats=ra.stats,
                    cand_stats=ca.stats))
        return out, skipped

    def _compare(self, ra: IndexRow, ca: IndexRow, grow: IndexRow | None,
                 shadow: IndexRow | None) -> tuple[RecordDiff, LogitsStep | None]:
        tol = self.tol.for_record(ra.key, self._tolerance_dtypes(ra.dtype, ca.dtype))
        base = dict(key=ra.key, kind=ra.kind, order=ra.order, ref_dtype=ra.dtype,
                    cand_dtype=ca.dtype, ref_shape=ra.shape, cand_shape=ca.shape,
                    tolerance=tol, cand_key=ca.key if ca.key != ra.key else None,
                    src=_links(ra) or _links(ca), ref_stats=ra.stats, cand_stats=ca.stats)
        if ra.kind == "logits" and any(self.topk) and ra.key.op is None:
            return self._topk(ra, ca, tol, base)
        todo = [t for t in self.transforms if t.matches(ra.key)]
        if todo and ra.has_data and ca.has_data:
            return self._transformed(ra, ca, todo, tol, base), None
        for t in todo:  # statistics only: left as they are (the note counts them)
            self._applied[t.text][1] += 1
        if ra.shape != ca.shape:
            if self.other_positions and ra.key.step == 0 and ra.has_data and ca.has_data:
                cut = _narrowed(self.R.read(ra.key), self.C.read(ca.key))
                if cut is not None:
                    return self._measured(ra, ca, *cut, tol, base)
            return RecordDiff(basis="shape", **base), None
        if unread_pair(ra, ca, grow, shadow, self.transforms):
            self.R.check_tensor(ra)  # a damaged file is refused whether its values are read
            self.C.check_tensor(ca)
            self.unread += 1
            st = ra.stats
            m = identical_metrics(ra.dtype, ca.dtype, st.numel, st.numel - st.nan - st.inf,
                                  square_sum_positive(ra), rtol=tol.rtol, atol=tol.atol,
                                  scale=_rms(ra))
            return RecordDiff(basis="tensor", metrics=m, **base), None
        if not (ra.has_data and ca.has_data):
            sd = stats_delta(ra, ca)
            if ra.sample is None or ca.sample is None:
                return RecordDiff(basis="stats", stats=sd, **base), None
            acc = MetricAccumulator(ra.dtype, ca.dtype, rtol=tol.rtol, atol=tol.atol,
                                    **_rel_scale(ra, ra.shape[-1] if ra.shape else None))
            acc.add(ra.sample, ca.sample, sample_positions(ra.stats.numel, len(ra.sample)))
            return RecordDiff(basis="sample", metrics=acc.result(), stats=sd,
                              sketch=None if ra.kind == "logits"  # compared up to a shift
                              else sketch_rel(ra.sketch, ca.sketch, ra.stats.numel),
                              **base), None
        is_logits = ra.kind == "logits" and len(ra.shape) >= 1 and ra.shape[-1] > 0
        acc = MetricAccumulator(ra.dtype, ca.dtype, rtol=tol.rtol, atol=tol.atol,
                                **_rel_scale(ra, ra.shape[-1] if is_logits else None))
        use_golden = grow is not None and grow.has_data and grow.shape == ra.shape
        self.bytes_read += nbytes(ra) + nbytes(ca) + (nbytes(grow) if use_golden else 0)
        gsum = np.zeros(3)  # sum (ref-g)^2, sum (cand-g)^2, sum g^2
        positions: list[LogitsPosition] = []
        ra_it = self.R.iter_chunks(ra.key, self.max_elems)
        ca_it = self.C.iter_chunks(ca.key, self.max_elems)
        if is_logits:
            vocab = ra.shape[-1]
            ra_it, ca_it = _rows(ra_it, vocab), _rows(ca_it, vocab)
        g_it = self.G.iter_chunks(grow.key, self.max_elems) if use_golden else None
        if use_golden and is_logits:
            g_it = _rows(g_it, ra.shape[-1])
        for a, b in zip(ra_it, ca_it):
            acc.add(a, b)
            if g_it is not None:
                g = next(g_it).astype(np.float64).reshape(-1)
                a64, b64 = a.astype(np.float64).reshape(-1), b.astype(np.float64).reshape(-1)
                m = np.isfinite(a64) & np.isfinite(b64) & np.isfinite(g)
                if not m.all():
                    a64, b64, g = a64[m], b64[m], g[m]
                ea, eb = a64 - g, b64 - g
                gsum += (np.einsum("i,i->", ea, ea), np.einsum("i,i->", eb, eb),
                         np.einsum("i,i->", g, g))  # no BLAS: see metrics._dot
            if is_logits:
                positions.extend(_logit_positions(a, b, len(positions)))
        metrics = acc.result()
        shadow_m = self._shadow(ra, shadow) if shadow is not None else None
        glabel = None
        if grow is not None:
            mult = _multiplier(*self._tolerance_dtypes(ra.dtype, ca.dtype))
            glabel = _golden_label(gsum, metrics.numel, tol, mult) if use_golden \
                else GoldenLabel("n/a", None, None, mult)
        rd = RecordDiff(basis="tensor", metrics=metrics, shadow=shadow_m, golden=glabel, **base)
        return rd, (LogitsStep(ra.key, tuple(positions)) if is_logits else None)

    def _measured(self, ra: IndexRow, ca: IndexRow, a: np.ndarray, b: np.ndarray,
                  tol: Tolerance, base: dict) -> tuple[RecordDiff, LogitsStep | None]:
        """A prefill pair measured on the positions both captures hold (`_narrowed`)."""
        self.bytes_read += nbytes(ra) + nbytes(ca)
        is_logits = ra.kind == "logits" and a.ndim >= 1 and a.shape[-1] > 0
        acc = MetricAccumulator(ra.dtype, ca.dtype, rtol=tol.rtol, atol=tol.atol,
                                **_rel_scale(ra, a.shape[-1] if is_logits else None))
        acc.add(a, b)
        base = dict(base, ref_shape=tuple(a.shape), cand_shape=tuple(b.shape))
        rd = RecordDiff(basis="tensor", metrics=acc.result(), **base)
        if not is_logits:
            return rd, None
        w = a.shape[-1]
        return rd, LogitsStep(ra.key, tuple(_logit_positions(a.reshape(-1, w),
                                                             b.reshape(-1, w), 0)))

    def _transformed(self, ra: IndexRow, ca: IndexRow, todo: list[Transform], tol: Tolerance,
                     base: dict) -> RecordDiff:
        """A record compared after the declared transforms of one side (compare.transforms):
        both tensors read whole, transformed, then measured like any pair."""
        arrays = {"ref": self.R.read(ra.key), "cand": self.C.read(ca.key)}
        self.bytes_read += nbytes(ra) + nbytes(ca)
        for t in todo:
            side = self.R if t.side == "ref" else self.C
            key = ra.key if t.side == "ref" else ca.key

            def lookup(pattern: str, side=side, key=key) -> np.ndarray:
                found = find_record([r.key for r in side.rows], pattern, key.req, key.step)
                if found is None:
                    raise UserError(f"--transform {t.text}: no record {pattern!r} in "
                                    f"{side.path} for request {key.req} step {key.step}")
                return side.read(found)
            arrays[t.side] = apply_transform(t, arrays[t.side], lookup)
            self._applied[t.text][0] += 1
        a, b = arrays["ref"], arrays["cand"]
        base = dict(base, ref_shape=tuple(a.shape), cand_shape=tuple(b.shape))
        if a.shape != b.shape:
            return RecordDiff(basis="shape", **base)
        acc = MetricAccumulator(ra.dtype, ca.dtype, rtol=tol.rtol, atol=tol.atol,
                                scale=_rms(ra) if not any(t.side == "ref" for t in todo)
                                else None)
        acc.add(a, b)
        return RecordDiff(basis="tensor", metrics=acc.result(), **base)

    def transform_notes(self) -> list[str]:
        """What each declared transform did; UserError for one that matched nothing."""
        out = []
        for text, (done, stats_only) in self._applied.items():
            if not done and not stats_only:
                raise UserError(f"--transform {text}: its pattern matches no record compared "
                                f"(see `accucheck inspect` for the keys)", EXIT_USAGE)
            out.append(f"--transform {text}: applied to {done} record(s) before comparing"
                       + (f"; {stats_only} with statistics only left as they are (capture "
                          f"with --store full)" if stats_only else ""))
        return out

    def _tolerance_dtypes(self, ref_dtype: str, cand_dtype: str) -> tuple[str | None, ...]:
        """The dtypes whose loosest picks a record's tolerance: the two runs' compute dtypes
        (their meta "dtype"), not the record pair's own dtypes, so a record that one side
        computes in a lower precision is judged at the run's precision (and reported as a
        precision finding). Integer / bool records stay exact; captures without a meta dtype
        fall back to the record dtypes."""
        if ref_dtype not in DTYPE_EPS and cand_dtype not in DTYPE_EPS:
            return (ref_dtype, cand_dtype)
        if all(self.compute):
            return self.compute
        return (ref_dtype, cand_dtype) + self.compute

    def _shadow(self, ra: IndexRow, sh: IndexRow) -> TensorMetrics | None:
        if sh.shape != ra.shape or not (ra.has_data and sh.has_data):
            return None
        self.bytes_read += nbytes(ra) + nbytes(sh)
        acc = MetricAccumulator(ra.dtype, sh.dtype)
        for a, b in zip(self.R.iter_chunks(ra.key, self.max_elems),
                        self.C.iter_chunks(sh.key, self.max_elems)):
            acc.add(a, b)
        return acc.result()

    def _flips(self, logits: list[LogitsStep], token_flip: TokenFlip | None
               ) -> tuple[TokenFlip | None, tuple[TokenFlip, ...]]:
        """First (request, step, position) whose greedy token differs in the stored logits, and
        every flip at a generating position. A generated-id difference that the stored logits do
        not show (no logits stored, or sampling) is kept as a flip of unknown kind."""
        first, gen = None, []
        for ls in sorted(logits, key=lambda s: (s.key.req, s.key.step)):
            last = len(ls.positions) - 1
            for p in ls.positions:
                if p.agree:
                    continue
                f = TokenFlip(ls.key.req, ls.key.step, p.position, p.top1_ref, p.top1_cand,
                              p.margin, p.noise, p.position == last, "logits")
                if first is None:
                    first = f
                if f.generating:
                    gen.append(f)
        if token_flip is not None and not any(
                (g.req, g.step) == (token_flip.req, token_flip.step) for g in gen):
            gen.append(token_flip)
            if first is None or (token_flip.req, token_flip.step) < (first.req, first.step):
                first = token_flip
        return first, tuple(gen)


def _narrowed(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """Two prefill tensors of captures that record other positions (capture --positions
    last:N): the one with more positions cut to the other's, its last ones, on the one axis
    where the shapes differ (the position axis); None when they differ otherwise."""
    if a.ndim != b.ndim:
        return None
    axes = [i for i, (x, y) in enumerate(zip(a.shape, b.shape)) if x != y]
    if len(axes) != 1:
        return None
    i = axes[0]
    n = min(a.shape[i], b.shape[i])
    a = a if a.shape[i] == n else np.take(a, range(a.shape[i] - n, a.shape[i]), axis=i)
    b = b if b.shape[i] == n else np.take(b, range(b.shape[i] - n, b.shape[i]), axis=i)
    return a, b


def _absorb(records: list[RecordDiff]) -> list[RecordDiff]:
    """Op records inside a module call whose recorded outputs are all identical on both sides
    are `absorbed` (within): one side's fused kernel (F.rms_norm) against the other's
    decomposed ops (pow / mean / add / rsqrt / mul) pairs ops that compute different things,
    but the module computes the same, so no op inside it is a culprit."""
    outs: dict[tuple, list[RecordDiff]] = {}
    for r in records:
        if r.key.op is None and r.key.role == "out":
            outs.setdefault((r.key.req, r.key.step, r.key.module, r.key.call), []).append(r)
    same = {k for k, rs in outs.items() if all(r.identical for r in rs)}
    return [replace(r, absorbed=True) if r.key.op is not None and not r.identical and
            (r.key.req, r.key.step, r.key.module, r.key.call) in same else r for r in records]


def _rows(chunks: Iterator[np.ndarray], width: int) -> Iterator[np.ndarray]:
    """Re-cut flat chunks into [rows, width] blocks of whole rows."""
    rest = None
    for c in chunks:
        c = c.reshape(-1)
        if rest is not None and rest.size:
            c = np.concatenate([rest, c])
        n = (c.size // width) * width
        if n:
            yield c[:n].reshape(-1, width)
        rest = c[n:]
    if rest is not None and rest.size:
        raise ValueError("tensor size is not a multiple of its last dimension")


def _logit_positions(a: np.ndarray, b: np.ndarray, start: int) -> list[LogitsPosition]:
    a2, b2 = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
    kl = kl_div(a2, b2)
    t5 = topk_overlap(a2, b2, 5)
    margin = top2_margin(a2)
    noise = logit_noise(a2, b2)
    ta, tb = np.argmax(a2, axis=-1), np.argmax(b2, axis=-1)
    return [LogitsPosition(start + i, float(kl[i]), int(ta[i]), int(tb[i]), float(t5[i]),
                           float(margin[i]), float(noise[i])) for i in range(a2.shape[0])]


def _multiplier(*dtypes: str) -> float:
    return GOLDEN_MULTIPLIER.get(loosest_dtype(dtypes), 3.0)


def _golden_label(gsum: np.ndarray, n: int, tol: Tolerance, mult: float) -> GoldenLabel:
    n = max(n, 1)
    er, ec, gg = (math.sqrt(max(x, 0.0) / n) for x in gsum)
    floor = 0.1 * tol.rel_l2 * gg  # noise floor: a tenth of the tolerance, in RMS terms
    if ec > mult * er + floor:
        label = "cand worse"
    elif er > mult * ec + floor:
        label = "ref worse"
    else:
        label = "both within noise"
    return GoldenLabel(label, er, ec, mult)


def stats_delta(ra: IndexRow, ca: IndexRow) -> StatsDelta:
    """Lower bound on rel_l2 from two statistics rows (see StatsDelta)."""
    a, b = ra.stats, ca.stats
    naninf = abs(a.nan - b.nan) + abs(a.inf - b.inf)
    identical = (ra.dtype == ca.dtype and ra.shape == ca.shape and ra.checksum == ca.checksum
                 and a == b)
    if identical:
        return StatsDelta(True, 0.0, None, 0)
    n = a.numel - a.nan - a.inf
    cands = {"l2": abs(a.l2 - b.l2)}
    if n > 0 and a.nan + a.inf == 0 and b.nan + b.inf == 0:
        cands["mean"] = math.sqrt(n) * abs(a.mean - b.mean)
        cands["std"] = math.sqrt(max(n - 1, 0)) * abs(a.std - b.std)
        cands["min"] = abs(a.min - b.min)
        cands["max"] = abs(a.max - b.max)
        cands["absmax"] = abs(a.absmax - b.absmax)
    cands = {k: v for k, v in cands.items() if math.isfinite(v)}
    if not cands:
        return StatsDelta(False, 0.0, None, naninf)
    name = max(cands, key=cands.get)
    bound = cands[name]
    rel = bound / a.l2 if a.l2 > 0 else (math.inf if bound > 0 else 0.0)
    return StatsDelta(False, rel, name if bound > 0 else None, naninf)


def _rms(row: IndexRow) -> float | None:
    """The reference tensor's RMS over its finite elements, from its index statistics (the
    scale of `TensorMetrics.mean_rel`); None for a non-float record."""
    st = row.stats
    n = st.numel - st.nan - st.inf
    if not is_float_dtype(row.dtype) or n <= 0 or not math.isfinite(st.l2):
        return None
    return st.l2 / math.sqrt(n)


def _rel_scale(row: IndexRow, logits_row: int | None) -> dict:
    """MetricAccumulator's `scale` (and `row`) for a record's mean_rel: the reference's RMS;
    for logits (rows of `logits_row` elements, compared up to a shift) its standard deviation."""
    if row.kind != "logits" or not logits_row:
        return {"scale": _rms(row)}
    std = row.stats.std
    return {"scale": std if is_float_dtype(row.dtype) and math.isfinite(std) else None,
            "row": logits_row}


def _links(row: IndexRow) -> tuple[tuple[str, str], ...]:
    """(input slot, producer key) from a record's /index/extra "src" (sites of the same request
    and step, see accucheck.capture.record.recorder); () when the capture stored none."""
    if not row.extra or '"src"' not in row.extra:
        return ()
    try:
        src = json.loads(row.extra).get("src") or {}
    except (ValueError, AttributeError):
        return ()
    prefix = f"r{row.key.req}.s{row.key.step}:"
    return tuple((str(slot), prefix + str(site)) for slot, site in src.items()
                 if isinstance(site, str))


def _meta_dtype(meta: dict) -> str | None:
    d = meta.get("dtype")
    if not isinstance(d, str) or not d:
        return None
    return d.replace("torch.", "")
