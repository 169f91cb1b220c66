"""An eval's reference answers (`impact --answers FILE.jsonl`): which of REF's greedy answers are
right, so that the prompts whose answer differs split into a score drop (REF right, the
candidate leaves its answer) and the rest. Imports accucheck.errors only.

The file: JSONL, one object per line with "prompt" (or "text", as `--prompts` reads them) and
"answer" (a string, or a list of acceptable strings). A prompt of REF that the file does not
hold has no reference answer. REF's answer is right when its generated text starts with one of
the answers, both with their whitespace collapsed (the answer is what the model says first; a
longer generation goes on after it).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from accucheck.errors import UserError


def read_answers(path: str | Path) -> dict[str, tuple[str, ...]]:
    """prompt -> acceptable answers (UserError, exit 3, on anything that is not such a file)."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"--answers {p}: no such file")
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise UserError(f"--answers {p}: not UTF-8 text") from None
    out: dict[str, tuple[str, ...]] = {}
    for i, ln in enumerate(lines, 1):
        if not ln.strip():
            continue
        try:
            obj = json.loads(ln)
        except json.JSONDecodeError as e:
            raise UserError(f"--answers {p}:{i}: not valid JSON ({e.msg})") from None
        prompt = obj.get("prompt", obj.get("text")) if isinstance(obj, dict) else None
        answer = obj.get("answer") if isinstance(obj, dict) else None
        answers = (answer,) if isinstance(answer, str) else tuple(answer) \
            if isinstance(answer, list) else ()
        if not isinstance(prompt, str) or not answers \
                or not all(isinstance(a, str) and _norm(a) for a in answers):
            raise UserError(f"--answers {p}:{i}: needs a \"prompt\" string and an \"answer\" "
                            f"(a non-empty string or a list of them)")
        out[prompt] = answers
    if not out:
        raise UserError(f"--answers {p}: empty; one JSON object per line with \"prompt\" and "
                        f"\"answer\"")
    return out


def _norm(text: str) -> str:
    return " ".join(text.split())


def judge(prompts: Sequence[str], generated: Sequence[str],
          answers: dict[str, tuple[str, ...]], path: str | Path) -> tuple[bool | None, ...]:
    """Per REF request: True / False where the file holds its prompt (REF's generated text
    starts with an answer), None where it does not. UserError when it holds none of them."""
    out = tuple(None if q not in answers else
                any(_norm(text).startswith(_norm(a)) for a in answers[q])
                for q, text in zip(prompts, generated))
    if all(v is None for v in out):
        raise UserError(f"--answers {path}: none of REF's {len(prompts)} prompt(s) is in it "
                        f"(a line's \"prompt\" must be the prompt REF was captured with)")
    return out
