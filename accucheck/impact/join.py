"""`diff --impact IMPACT.json`: the share of the logit gap the diff's culprit recovers, read
from an `accucheck impact` result. Torch-free (json only): imports errors, numbers and
impact.result's format constants.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from accucheck.errors import UserError, one_line
from accucheck.impact.result import FORMAT, VERSION
from accucheck.numbers import percent

SMALL = 0.5  # below this share the culprit "explains little"


def read_impact(path: str | Path) -> dict:
    """An impact result (UserError, exit 3, one line, when it is not one this version reads)."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"--impact {p}: no such file (make it with `accucheck impact REF.h5 "
                        f"MODEL -o {p.name}`)")
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"--impact {p}: not readable JSON ({one_line(e, 120)})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise UserError(f"--impact {p}: not an accucheck impact result (format "
                        f"{data.get('format') if isinstance(data, dict) else None!r})")
    if data.get("version") != VERSION:
        raise UserError(f"--impact {p}: impact format version {data.get('version')!r}, this "
                        f"accucheck reads {VERSION}: re-run `accucheck impact` to regenerate it")
    return data


def _pct(v) -> str:
    return "n/a" if v is None else percent(0.0 if abs(v) < 5e-4 else v)  # no "-0.0%"


def _rows(data: dict) -> list[dict]:
    return list(data.get("sites") or []) + list((data.get("bisect") or {}).get("children") or [])


def site_for(data: dict, module: str) -> dict | None:
    """The patched site that is `module` or, else, the innermost one that encloses it."""
    rows = [r for r in _rows(data) if r["site"] == module or module.startswith(r["site"] + ".")]
    return max(rows, key=lambda r: len(r["site"])) if rows else None


def impact_line(data: dict, module: str | None, path: str | Path,
                context: Sequence[str] = ()) -> str:
    """One line: what share of the logit gap the culprit `module` recovers, and when it
    explains little, which site explains more; when the whole gap is within the control's own
    (`within_noise`), that the culprit does not move the output beyond the noise. `context`:
    what else moves the output in this diff (report.diff.flip_context: a near-tie token flip,
    a routing flip), said when the culprit explains little or there is none."""
    src = f"[{Path(path).name}]"
    more = "".join(f"; {c}" for c in context)
    if data.get("no_gap"):
        return f"impact: the candidate's logits match REF's: no output gap to explain {src}"
    if data.get("within_noise"):
        who = f"{module} does not move the output beyond the noise: " if module else ""
        return f"impact: {who}{data.get('headline', '')}{more} {src}"
    if module is None:
        return f"impact: no culprit named; {data.get('headline', '')}{more} {src}"
    row = site_for(data, module)
    if row is None:
        return (f"impact: {module} was not patched ({len(_rows(data))} sites were); "
                f"{data.get('headline', '')}{more} {src}")
    noising = data.get("method") == "noising"
    rec = row["introduced" if noising else "recovered"]
    where = module if row["site"] == module else f"{module} (its enclosing {row['site']})"
    verb = "introduces" if noising else "recovers"
    line = (f"impact: {where} {verb} {_pct(rec.get('logprob'))} of the logit gap "
            f"(|Δ logprob|; KL {_pct(rec.get('kl'))}, flips {_pct(rec.get('flips'))})")
    if row.get("band"):
        line += f", band {_pct(row['band'].get('logprob'))}"
    share = rec.get("logprob")
    best = max(_rows(data), key=lambda r: _score(r))
    if share is not None and share < SMALL and _score(best) > share + 0.1:
        line += (f"; it explains little: {best['site']} {verb} "
                 f"{_pct(_share(best).get('logprob'))}")
    if share is None or share < SMALL:
        line += more
    return f"{line} {src}"


def _share(row: dict) -> dict:
    return row["recovered"] if "recovered" in row else row["introduced"]


def _score(row: dict) -> float:
    v = _share(row).get("logprob")
    return -1e300 if v is None else v


def with_impact(text: str, fmt: str, data: dict, culprit, path: str | Path,
                context: Sequence[str] = ()) -> str:
    """The diff report `text` with the impact line: after the culprit's lines (table, md:
    at the end), or as key "impact" (json)."""
    module = getattr(culprit, "module", None)
    line = impact_line(data, module, path, context)
    if fmt == "json":
        doc = json.loads(text)
        row = site_for(data, module) if module else None
        doc["impact"] = {"file": str(path), "line": line, "site": row,
                         "no_gap": bool(data.get("no_gap")),
                         "within_noise": bool(data.get("within_noise")),
                         "headline": data.get("headline")}
        return json.dumps(doc, indent=2) + "\n"
    lines = text.rstrip("\n").split("\n")
    at = next((i for i, ln in enumerate(lines) if ln.startswith("CULPRIT:")), None)
    if at is None:
        return "\n".join(lines + [line]) + "\n"
    return "\n".join(lines[:at + 1] + ["  " + line] + lines[at + 1:]) + "\n"
