"""The observer effect of graph-mode captures, read from their meta. Imports nothing of
accucheck (no h5py, no torch), so diff, inspect and sign-off can all call it.

A graph-mode capture (accucheck.capture.record.graph) runs the compiled model twice: without taps
(its logits are the file's `logits` records) and with them (every other record). Its meta
"observer_effect" says how far the taps moved the logits: `max_rel_l2`, `max_kl`, `bitwise`,
per step in `steps`; `measured` false when the check was off (--no-observer-check).

The effect matters next to the difference being judged: a diff whose logits differ by d, with
a side whose taps moved its logits by e, reads that side's layer records from a program that
differs from the one its logits come from by e / d of what is judged. Above
`OBSERVER_NOTE_FRACTION` (1 %) of d the diff says so in a note.
"""
from __future__ import annotations

OBSERVER_NOTE_FRACTION = 0.01


def observer_effect(meta: dict) -> dict | None:
    """The capture's observer effect without its per-step rows; None for an eager capture
    (or a file from before the check existed, then {"measured": False, ...})."""
    if meta.get("mode") != "graph":
        return None
    oe = meta.get("observer_effect")
    if not isinstance(oe, dict):
        return {"measured": False, "why": "captured before accucheck measured it"}
    return {k: v for k, v in oe.items() if k != "steps"}


def describe(oe: dict | None) -> str:
    """One phrase: "none (bitwise; taps: boundaries)", "rel L2 1.0e-02, KL 3.1e-05 (taps:
    selection)", "not measured (why)"; "" for an eager capture."""
    if oe is None:
        return ""
    if not oe.get("measured"):
        return f"not measured ({oe.get('why', 'unknown')})"
    taps = f"taps: {oe.get('taps')}"
    if oe.get("bitwise"):
        return f"none (the tapped logits equal the untapped ones bitwise; {taps})"
    flips = oe.get("argmax_changed") or 0
    return (f"rel L2 {oe.get('max_rel_l2', 0.0):.2e}, KL {oe.get('max_kl', 0.0):.2e}"
            + (f", {flips} argmax change(s)" if flips else "") + f" ({taps})")


def observer_notes(ref_meta: dict, cand_meta: dict, logits_error: float | None) -> list[str]:
    """Notes for DiffResult.notes: each graph-mode side's observer effect; loud when it is
    not negligible (over OBSERVER_NOTE_FRACTION of `logits_error`, the largest rel L2 between
    the two runs' logits) or was not measured."""
    out = []
    for side, meta in (("ref", ref_meta), ("cand", cand_meta)):
        oe = observer_effect(meta)
        if oe is None:
            continue
        what = describe(oe)
        if not oe.get("measured"):
            out.append(f"observer effect of {side} (graph mode) {what}: its layer records may "
                       f"come from another program than its logits")
            continue
        e = float(oe.get("max_rel_l2") or 0.0)
        if e > 0 and (not logits_error or e > OBSERVER_NOTE_FRACTION * logits_error):
            share = f"{100 * e / logits_error:.0f} % of" if logits_error else "more than"
            out.append(f"OBSERVER EFFECT: {side}'s taps moved its compiled logits by {what}: "
                       f"{share} the logits difference judged here; its layer records come "
                       f"from a program that computes otherwise (its logits and tokens are the "
                       f"untapped run's); capture it without --include/--exclude/--inputs "
                       f"(kernel-boundary taps) to measure what graph mode runs")
        else:
            out.append(f"observer effect of {side} (graph mode): {what}")
    return out
