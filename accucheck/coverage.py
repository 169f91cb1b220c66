"""The coverage verdict of a capture: what it expected to record against what it recorded.

A silently empty or partial capture (one rank that recorded nothing, a missing decode step) is
the most common integration failure of dump tools; every runner ends with this check, writes it
into meta "coverage", prints its line, and a failed check leaves the file incomplete (so `diff`
refuses it unless told --allow-incomplete). No torch.

Expected: every module-level site (module, call, role, slot) recorded anywhere in a phase
(prefill = step 0, decode = steps >= 1; a phase with no record at all expects the prefill's
sites) at every request, every step of that phase and every rank. Op-level and shadow records
are not counted (their number depends on the kernels each side dispatches).
"""
from __future__ import annotations

from collections import Counter
from typing import Iterable

from accucheck.keys import RecordKey

MAX_LISTED = 10


def sites_of(keys: Iterable[str], rank: int = 0) -> list[tuple[int, int, int, str]]:
    """(rank, request, step, site) of every module-level record key (op / shadow records
    left out: see the module docstring)."""
    out = []
    for text in keys:
        k = RecordKey.parse(text)
        if k.op is None and k.role != "shadow":
            out.append((rank, k.req, k.step, k.site))
    return out


def coverage(recorded: Iterable[tuple[int, int, int, str]], n_requests: int, n_steps: int,
             ranks: Iterable[int] = (0,), *, only: Iterable[int] = (),
             first_step: int = 0) -> dict:
    """`recorded`: (rank, request, step, site) per module-level record. `n_steps`: steps per
    request (prefill + decode steps). What the capture chose to record: `only` the requests
    numbered so (empty: every one; capture --requests), from `first_step` on (1: capture
    --positions decode). Returns meta "coverage" (see `coverage_line`)."""
    ranks = sorted(set(ranks))
    wanted = sorted(set(only)) or list(range(n_requests))
    got = set(recorded)
    phase_sites: dict[int, set[str]] = {0: set(), 1: set()}
    for _rank, _req, step, site in got:
        phase_sites[min(step, 1)].add(site)
    if not phase_sites[1]:
        phase_sites[1] = set(phase_sites[0])
    missing = []
    expected = 0
    for rank in ranks:
        for req in wanted:
            for step in range(first_step, n_steps):
                sites = phase_sites[min(step, 1)]
                expected += len(sites)
                missing += [(rank, req, step, s) for s in sorted(sites)
                            if (rank, req, step, s) not in got]
    by_rank = Counter(m[0] for m in missing)
    by_step = Counter(m[2] for m in missing)
    by_req = Counter(m[1] for m in missing)
    per_rank = expected // len(ranks) if ranks else 0
    return {
        "ok": bool(expected) and not missing,
        "expected": expected, "recorded": expected - len(missing),
        "ranks": ranks, "requests": len(wanted), "steps": n_steps - first_step,
        "sites": {"prefill": len(phase_sites[0]), "decode": len(phase_sites[1])},
        "missing": {"count": len(missing),
                    "by_rank": {str(r): n for r, n in sorted(by_rank.items())},
                    "by_request": {str(r): n for r, n in sorted(by_req.items())},
                    "by_step": {str(s): n for s, n in sorted(by_step.items())},
                    "per_rank_expected": per_rank,
                    "first": [f"rank {r} r{q}.s{s}:{site}" for r, q, s, site in
                              missing[:MAX_LISTED]]},
    }


def coverage_line(cov: dict) -> str:
    """One line: `coverage: 1344 of 1344 expected records (2 ranks x 2 requests x 4 steps)` or
    `coverage FAILED: rank 1 recorded 0 of 672 expected records; ...`."""
    shape = (f"{len(cov['ranks'])} rank{'s' if len(cov['ranks']) != 1 else ''} x "
             f"{cov['requests']} requests x {cov['steps']} steps x "
             f"{cov['sites']['prefill']} sites")
    if cov["ok"]:
        return f"coverage: {cov['recorded']} of {cov['expected']} expected records ({shape})"
    if not cov["expected"]:
        return "coverage FAILED: nothing was recorded (no module of the selection ran)"
    miss = cov["missing"]
    per_rank = miss["per_rank_expected"]
    parts = [f"rank {r} recorded {per_rank - n} of {per_rank} expected records"
             for r, n in miss["by_rank"].items()] if len(cov["ranks"]) > 1 else []
    if miss["by_step"] and len(miss["by_step"]) < cov["steps"]:
        parts.append("missing at step " + ", ".join(miss["by_step"]))
    if miss["by_request"] and len(miss["by_request"]) < cov["requests"]:
        parts.append("missing in request " + ", ".join(miss["by_request"]))
    parts.append(f"first missing: {miss['first'][0]}")
    return (f"coverage FAILED: {cov['recorded']} of {cov['expected']} expected records "
            f"({shape}); " + "; ".join(parts))


def skipped_throughout(modules: Iterable[str], sites: Iterable[str],
                       skipped: dict[str, str]) -> str | None:
    """One line when a selected module of `modules` has no record among `sites` ("module#call:
    role.slot") and a worker said why it dropped its tensors (`skipped`: "module:role.slot" ->
    reason); None otherwise. The coverage verdict expects only the sites recorded at least
    once, so a module dropped at every step passed it: under sequence-parallel padding or
    MC2 / FlashComm token splits every rank holds another number of rows than the step's
    tokens, and each layer's records were dropped without a word."""
    recorded = {s.split("#", 1)[0] for s in sites}
    why: dict[str, str] = {}
    for key, reason in skipped.items():
        why.setdefault(key.split(":", 1)[0], reason)
    dropped = [m for m in modules if m not in recorded and m in why]
    if not dropped:
        return None
    return (f"coverage FAILED: {len(dropped)} selected module{'s' if len(dropped) > 1 else ''} "
            f"recorded nothing at any step (first: {dropped[0]}: {why[dropped[0]]}); a token "
            f"count that is not the step's comes from sequence parallelism or MC2 / FlashComm "
            f"token splits, which accucheck does not join: capture with them off, or --exclude "
            f"the module")
