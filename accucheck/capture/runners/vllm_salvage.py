"""What a vLLM capture keeps when it does not end: the records of the forwards every rank
completed, merged across the ranks as a finished capture's are, in an incomplete capture.

The workers note each forward's records beside their tensors as it completes (record.spill: the
spill directory `.<name>.ranks-XXXX/` beside the output, `rank<r>.bin` / `rank<r>.idx`).
- A worker dies: the front end writes them itself before its one-line error
  (`salvage_records`, called by capture.runners.vllm).
- The front end itself dies (SIGKILL, the out-of-memory killer, a job's time limit): nothing of
  it runs again, so the output holds its meta only and the spill directory stays. Before the
  engine generates, the front end writes `capture.json` into the spill directory (the file's
  meta, and what joining the ranks needs: the module kinds, the tensor-parallel size, the
  prompts and forced tokens; `write_manifest`); `accucheck salvage` writes the capture from it
  (`salvage`).

numpy and h5py only: salvaging needs no vLLM.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from accucheck.capture.record.ranks import Record, merge_ranks
from accucheck.capture.record.spill import SpillReader, spilled_end
from accucheck.errors import UserError, one_line
from accucheck.keys import RecordKey
from accucheck.paths import SPILL_MANIFEST, check_output_file, spill_dirs, temp_beside
from accucheck.store import CaptureWriter, open_capture

MANIFEST = SPILL_MANIFEST
MANIFEST_VERSION = 1
_FIELDS = {"out": str, "meta": dict, "store": str, "compression": (str, type(None)),
           "kinds": dict, "tp": int, "prompt_ids": list, "prompts": list,
           "forced": (list, type(None))}


def write_manifest(spill: str | Path, *, out: Path, meta: dict, store: str,
                   compression: str | None, kinds: dict, tp: int, prompt_ids, prompts,
                   forced) -> None:
    """`capture.json` in the spill directory: what `salvage` needs once the front end is gone
    (`forced`: each request's forced tokens, or None). Written whole or not at all (a temporary
    file renamed into place)."""
    body = {"version": MANIFEST_VERSION, "out": str(Path(out).resolve()), "meta": meta,
            "store": store, "compression": compression, "kinds": dict(kinds), "tp": int(tp),
            "prompt_ids": [[int(t) for t in ids] for ids in prompt_ids],
            "prompts": [p if isinstance(p, str) else None for p in prompts],
            "forced": None if forced is None else [[int(t) for t in f] for f in forced]}
    path = Path(spill) / MANIFEST
    tmp = path.with_name(MANIFEST + ".tmp")
    tmp.write_text(json.dumps(body), encoding="utf-8")
    os.replace(tmp, path)


def salvage_records(writer: CaptureWriter, reader: SpillReader, kinds: dict, tp: int,
                    prompt_ids, prompts, forced) -> dict:
    """Write the records of the forwards every rank completed, as the workers noted them beside
    their tensors (record.spill `Spill.note`), merged across ranks as a finished capture's are;
    the prompts, and the tokens each request was forced to where it was (`forced`; vLLM's
    outputs, with the logits and the generated tokens, never came back). Meta "salvaged": how many
    records, which (request, step). The caller leaves the file incomplete: `diff
    --allow-incomplete` compares what it holds. Returns meta "salvaged"."""
    by_rank = {r: [Record.from_row(x) for x in rows]
               for r, rows in reader.noted(range(tp)).items()}
    done = set.intersection(*({(x.req, x.step) for x in recs} for recs in by_rank.values()))
    merged = merge_ranks({r: [x for x in recs if (x.req, x.step) in done]
                          for r, recs in by_rank.items()}, kinds, tp, reader.data)
    for slot, rec in merged.records:
        writer.add(RecordKey(rec.req, rec.step, rec.module, rec.call, rec.role, slot), "module",
                   rec.dtype, rec.shape, rec.stats, rec.checksum, reader.data(rec))
    for r, ids in enumerate(prompt_ids):
        writer.set_request(r, ids, list(forced[r]) if forced is not None else [],
                           prompts[r] if isinstance(prompts[r], str) else None)
    kept = {"records": len(merged.records),
            "steps": sorted([int(a), int(b)] for a, b in done)}
    writer.update_meta(salvaged=kept)
    writer.flush()
    return kept


# -- accucheck salvage ----------------------------------------------------------------------
def find_spill(path: str | Path) -> Path:
    """The spill directory `path` names: itself, or the one beside the capture `path` (UserError
    when there is none, or several: then it must be named)."""
    p = Path(path)
    if p.is_dir():
        if not (p / MANIFEST).is_file():
            raise UserError(f"{p} is not a vLLM capture's spill directory (no {MANIFEST} in it)")
        return p
    found = spill_dirs(p)
    if not found:
        raise UserError(f"nothing to salvage for {p}: no spill directory of a vLLM capture "
                        f"(.{p.name}.ranks-*) with its {MANIFEST} beside it")
    if len(found) > 1:
        names = ", ".join(d.name for d in found)
        raise UserError(f"{len(found)} spill directories of {p} ({names}): name the one to "
                        f"salvage instead of the capture")
    return found[0]


def read_manifest(spill: Path) -> dict:
    """The spill directory's `capture.json`, checked (UserError naming what is wrong)."""
    where = spill / MANIFEST
    try:
        body = json.loads(where.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{where} cannot be read ({one_line(e)}): nothing salvaged") from None
    if not isinstance(body, dict) or body.get("version") != MANIFEST_VERSION:
        raise UserError(f"{where} is not a capture manifest of version {MANIFEST_VERSION} "
                        f"(written by another accucheck?): nothing salvaged")
    for name, kind in _FIELDS.items():
        if not isinstance(body.get(name), kind):
            raise UserError(f"{where} is damaged ({name!r} missing or of the wrong type): "
                            f"nothing salvaged")
    if body["tp"] < 1 or len(body["prompts"]) != len(body["prompt_ids"]):
        raise UserError(f"{where} is damaged (tp / prompts): nothing salvaged")
    return body


def check_tensors(reader: SpillReader, tp: int) -> None:
    """Every noted record's tensor lies inside its rank's file: a damaged or cut spill is one
    line (UserError) before anything is written."""
    for rank, rows in reader.noted(range(tp)).items():
        need = max((spilled_end(Record.from_row(x)) for x in rows), default=0)
        have = reader.size(rank)
        if need > have:
            raise UserError(f"rank {rank}'s tensors in {reader.directory} end at byte {have}, "
                            f"before the {need} its noted records need (damaged or cut): "
                            f"nothing salvaged")


def _check_out(out: Path, default: bool, force: bool) -> None:
    """The output can be written: the capture the killed run left (incomplete, no record) is
    replaced without --force when it is the default output; anything else as any writer."""
    if default and out.is_file() and not force:
        try:
            with open_capture(out, allow_incomplete=True) as r:
                left = None if r.complete else len(r.rows)
        except UserError:
            left = None
        if left == 0:
            return
        raise UserError(f"{out} holds records or another run's capture: write the salvaged one "
                        f"elsewhere with -o, or pass --force to replace it")
    check_output_file(out, force)


def salvage(path: str | Path, out: str | Path | None = None,
            force: bool = False) -> tuple[Path, dict]:
    """Write the capture a killed vLLM front end left (see the module docstring): the records
    of the forwards every rank completed, from the spill directory of `path` (the capture, or
    the directory itself), into `out` (default: the capture `path`, or the one the run was
    writing), left incomplete. Everything is checked before anything is written; the spill
    directory is removed once the capture is written. Returns (the capture, meta "salvaged")."""
    spill = find_spill(path)
    body = read_manifest(spill)
    reader = SpillReader(str(spill))
    check_tensors(reader, body["tp"])
    target = Path(out) if out is not None else \
        Path(body["out"]) if Path(path).is_dir() else Path(path)
    _check_out(target, out is None, force)
    tmp = temp_beside(target)
    tmp.unlink()  # CaptureWriter makes it: a new file, never a replaced one
    try:
        writer = CaptureWriter(tmp, meta=body["meta"], store=body["store"],
                               compression=body["compression"])
        try:
            kept = salvage_records(writer, reader, body["kinds"], body["tp"], body["prompt_ids"],
                                   body["prompts"], body["forced"])
        finally:
            writer.close(complete=False)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()
    shutil.rmtree(spill, ignore_errors=True)
    return target, kept
