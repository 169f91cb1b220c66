"""Prompt lists: --prompt values and prompts files (plain text or JSONL). Imports only errors."""
from __future__ import annotations

import json
from pathlib import Path

from accucheck.errors import UserError


def read_prompts(prompts: tuple[str, ...], prompts_file: str | None) -> list[str]:
    """--prompt values, then the lines of --prompts FILE (plain text, one prompt a line, or
    JSONL with a "prompt" / "text" field or a JSON string per line)."""
    out = list(prompts)
    if prompts_file:
        p = Path(prompts_file)
        if not p.is_file():
            raise UserError(f"prompts file {p} does not exist")
        try:
            lines = [ln for ln in p.read_text(encoding="utf-8").splitlines() if ln.strip()]
        except UnicodeDecodeError:
            raise UserError(f"prompts file {p} is not UTF-8 text") from None
        if not lines:
            raise UserError(f"prompts file {p} is empty: one prompt per line, or JSONL")
        jsonl = p.suffix == ".jsonl" or lines[0].lstrip().startswith(("{", '"'))
        for i, ln in enumerate(lines, 1):
            if not jsonl:
                out.append(ln)
                continue
            try:
                obj = json.loads(ln)
            except json.JSONDecodeError as e:
                raise UserError(f"{p}:{i}: not valid JSON ({e.msg}); JSONL needs one JSON "
                                f"object per line") from None
            text = obj if isinstance(obj, str) else (
                obj.get("prompt", obj.get("text")) if isinstance(obj, dict) else None)
            if not isinstance(text, str) or not text:
                raise UserError(f"{p}:{i}: no \"prompt\" or \"text\" string in this line")
            out.append(text)
    if not out:  # a usage error (exit 2); an empty prompts file is bad input (exit 3)
        raise UserError.usage("no prompts: give --prompt TEXT (repeatable) or --prompts FILE")
    return out
