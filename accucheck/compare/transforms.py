"""Declared transforms applied to one side's records before they are compared (`accucheck diff
--transform`). Imports errors, keys and compare.tolerances (the key patterns); numpy only.

A capture in another layout or representation than the reference (an int8 GEMM's output
stored with its scales, a weight in NZ-style blocks, an activation in a rotated basis) is
compared after the user says how to bring it back. Nothing is guessed: a transform the user did
not declare is never applied, and the diff's notes list every one that was.

    --transform [ref:|cand:]PATTERN=STEP[+STEP...]        (default side: cand)

PATTERN matches a record like a tolerance override (full key, key without request / step, or
module path). Steps, applied left to right, each a pure function of the array (and, for
`dequant` / `rotate`, another record of the same side, request and step):

    dequant:KEY      x * s, s the record KEY (a site "model.layers.0.mlp.down_proj#0:out.scale"
                     or a glob on it), broadcast against x's trailing dimensions (per tensor,
                     per channel or per token scales)
    permute:A,B,...  np.transpose(x, (A, B, ...))
    reshape:A,B,...  np.reshape(x, (A, B, ...)); one -1 allowed
    rotate:KEY       x @ Q.T, Q the square record KEY: undoes x = y @ Q (QuaRot / SpinQuant
                     rotations with an orthogonal Q)

An NZ-style block layout [n1, m1, m0, n0] of an [m, n] matrix comes back with
`permute:1,2,0,3+reshape:M,N`.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Callable

import numpy as np

from accucheck.compare.tolerances import _matches
from accucheck.errors import EXIT_USAGE, UserError
from accucheck.keys import RecordKey

SIDES = ("ref", "cand")
KINDS = ("dequant", "permute", "reshape", "rotate")


@dataclass(frozen=True)
class Step:
    kind: str
    arg: str                       # the record pattern (dequant, rotate) or the text of ints
    ints: tuple[int, ...] = ()     # permute / reshape


@dataclass(frozen=True)
class Transform:
    side: str                      # "ref" | "cand"
    pattern: str
    steps: tuple[Step, ...]
    text: str                      # as the user wrote it

    def matches(self, key: RecordKey) -> bool:
        return _matches(self.pattern, key)

    def needs(self) -> tuple[str, ...]:
        """The record patterns its steps read (dequant / rotate)."""
        return tuple(s.arg for s in self.steps if s.kind in ("dequant", "rotate"))


def parse_transform(text: str) -> Transform:
    """"[ref:|cand:]PATTERN=STEP[+STEP...]" -> Transform (UserError, exit 2, when malformed)."""
    how = ("use [ref:|cand:]PATTERN=STEP[+STEP...], STEP one of dequant:KEY, permute:A,B,..., "
           "reshape:A,B,..., rotate:KEY (e.g. 'cand:*.o_proj#0:out.0=dequant:*o_proj#0:"
           "out.scale')")
    side, body = "cand", text
    for s in SIDES:
        if text.startswith(s + ":"):
            side, body = s, text[len(s) + 1:]
    pattern, sep, rhs = body.partition("=")
    if not sep or not pattern or not rhs:
        raise UserError(f"bad --transform {text!r}: {how}", EXIT_USAGE)
    steps = []
    for part in rhs.split("+"):
        kind, colon, arg = part.partition(":")
        if kind not in KINDS or not colon or not arg:
            raise UserError(f"bad --transform {text!r}: step {part!r}; {how}", EXIT_USAGE)
        ints: tuple[int, ...] = ()
        if kind in ("permute", "reshape"):
            try:
                ints = tuple(int(x) for x in arg.split(","))
            except ValueError:
                raise UserError(f"bad --transform {text!r}: {kind} takes integers "
                                f"({kind}:0,2,1)", EXIT_USAGE) from None
            if kind == "permute" and sorted(ints) != list(range(len(ints))):
                raise UserError(f"bad --transform {text!r}: permute:{arg} is not a permutation "
                                f"of 0..{len(ints) - 1}", EXIT_USAGE)
            if kind == "reshape" and (ints.count(-1) > 1 or any(i < -1 for i in ints)):
                raise UserError(f"bad --transform {text!r}: reshape:{arg} (sizes >= 0, one -1 "
                                f"at most)", EXIT_USAGE)
        steps.append(Step(kind, arg, ints))
    return Transform(side, pattern, tuple(steps), text)


# ----------------------------------------------------------------------------- the functions

def dequant(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """x * scale in float64, the scale broadcast against x's trailing dimensions (leading
    dimensions of size 1 it has beyond x's are dropped)."""
    s = np.asarray(scale, dtype=np.float64)
    x = np.asarray(x, dtype=np.float64)
    while s.ndim > x.ndim and s.shape[0] == 1:
        s = s[0]
    try:
        return x * s
    except ValueError:
        raise UserError(f"dequant: a scale of shape {list(np.shape(scale))} does not broadcast "
                        f"against a record of shape {list(x.shape)}") from None


def permute(x: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
    if len(axes) != x.ndim:
        raise UserError(f"permute:{','.join(map(str, axes))} needs a {len(axes)}-D record, "
                        f"not shape {list(x.shape)}")
    return np.transpose(x, axes)


def reshape(x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    try:
        return np.reshape(x, shape)
    except ValueError:
        raise UserError(f"reshape:{','.join(map(str, shape))} does not fit a record of shape "
                        f"{list(x.shape)}") from None


def rotate(x: np.ndarray, q: np.ndarray) -> np.ndarray:
    """x @ Q.T in float64: undoes x = y @ Q for an orthogonal Q."""
    q = np.asarray(q, dtype=np.float64)
    if q.ndim != 2 or q.shape[0] != q.shape[1] or x.shape[-1] != q.shape[0]:
        raise UserError(f"rotate: the matrix has shape {list(q.shape)}, the record's last "
                        f"dimension is {x.shape[-1]}: a square [d, d] matrix is needed")
    return np.asarray(x, dtype=np.float64) @ q.T


def apply(t: Transform, x: np.ndarray, lookup: Callable[[str], np.ndarray]) -> np.ndarray:
    """`t`'s steps on `x`; `lookup(pattern)` gives the record a dequant / rotate step reads."""
    for s in t.steps:
        if s.kind == "dequant":
            x = dequant(x, lookup(s.arg))
        elif s.kind == "rotate":
            x = rotate(x, lookup(s.arg))
        elif s.kind == "permute":
            x = permute(x, s.ints)
        else:
            x = reshape(x, s.ints)
    return x


def find_record(keys: list[RecordKey], pattern: str, req: int, step: int) -> RecordKey | None:
    """The record `pattern` names for (req, step): a key of that request and step whose full
    key, site or module matches, else a step-independent one (r0.s0, a weight recorded once)."""
    for want in ((req, step), (0, 0)):
        for k in keys:
            if (k.req, k.step) == want and any(fnmatch.fnmatchcase(t, pattern)
                                               for t in (str(k), k.site, k.module)):
                return k
    return None
