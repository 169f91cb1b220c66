#!/usr/bin/env python
"""Mutation testing for accucheck's verdict code: a developer tool (too slow for .ci/run).

    python scripts/mutants.py                                  # every verdict module
    python scripts/mutants.py --modules accucheck/compare/metrics.py --list
    python scripts/mutants.py --modules accucheck/compare/opmatch.py \\
        --only accucheck/compare/opmatch.py:151
    python scripts/mutants.py --changed origin/main -m ""   # lines changed since a ref, slow too
    python scripts/mutants.py --modules accucheck/compare/diff.py --sample 160 --seed 1

Each mutant is ONE deliberate bug on one source line (generated from the AST, applied as a
minimal text splice, so every other line keeps its text and number): a comparison swapped
(`<` / `<=` / `>` / `>=`, `==` / `!=`, `in` / `not in`, `is` / `is not`), `and` / `or`, a term
dropped from `and` / `or` / `+` / `-` / a two-argument `max` / `min`, an arithmetic operator
swapped, a numeric constant x2 and /2 (ints +1; not bit masks / shift counts), `True` /
`False`, `max` / `min` (and numpy's `maximum` / `argmax` / ...), `any` / `all`, `not` removed,
a unary minus removed,
`return X` -> `return None`, `break` / `continue`, a guard `if` (no else) or an accumulating
statement (`x += ...`, `xs.append(...)`) dropped, a comprehension filter dropped. Nothing inside
f-strings, annotations, `assert` or `raise` statements is mutated.

The repository is never touched: the tracked and untracked-but-not-ignored files are copied as
they are in the working tree (uncommitted edits included) to a temporary directory per job, and
the covering tests (TESTS below, or --tests) run there with `python -m pytest -x -q`, one test
file after the other, stopping at the first that fails, with PYTHONPATH pointing at the copy
(checked before anything runs). The unmutated tests run first (baseline): a module whose tests
already fail is reported and skipped. Then each mutant is written into the copy, the tests run
with a timeout per file (default: 3x its baseline, at least 60 s), and the file is restored.
Result per mutant: killed (tests failed), survived (tests passed: a bug the suite lets
through), timeout (counted as detected), error (pytest could not run).

Known-equivalent mutants (EQUIVALENT below: no input can tell them apart) are listed as such
and not run. The kill rate is (killed + timeout) / (killed + timeout + survived).
Stdlib only (plus pytest, which the tests need anyway).
"""
from __future__ import annotations

import argparse
import ast
import copy
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

DEFAULT_MODULES = ("accucheck/verdict/locate.py", "accucheck/verdict/types.py",
                   "accucheck/verdict/culprit.py", "accucheck/compare/diff.py",
                   "accucheck/compare/tolerances.py", "accucheck/compare/metrics.py",
                   "accucheck/compare/opmatch.py", "accucheck/signoff/run.py",
                   "accucheck/report/signoff_result.py", "accucheck/report/diff.py")

# Module -> the test files that cover it, fastest first (pytest -x stops at the first failure).
# A module not listed here runs tests/test_<name>.py.
TESTS: dict[str, tuple[str, ...]] = {
    "accucheck/compare/metrics.py": ("tests/test_metrics.py", "tests/test_diff.py"),
    "accucheck/compare/tolerances.py": ("tests/test_tolerance_rules.py",
                                        "tests/test_tolerances.py", "tests/test_diff.py",
                                        "tests/test_cli_diff.py"),
    "accucheck/compare/opmatch.py": ("tests/test_opmatch.py", "tests/test_ops.py"),
    "accucheck/compare/diff.py": ("tests/test_diff.py", "tests/test_metrics.py",
                                  "tests/test_cli_diff.py", "tests/test_report.py",
                                  "tests/test_golden.py"),
    "accucheck/verdict/locate.py": ("tests/test_locate.py", "tests/test_report.py",
                                    "tests/test_cli_diff.py"),
    "accucheck/verdict/types.py": ("tests/test_verdict_mutants.py", "tests/test_locate.py",
                                   "tests/test_report.py", "tests/test_cli_diff.py"),
    "accucheck/verdict/culprit.py": ("tests/test_locate.py", "tests/test_report.py",
                                     "tests/test_ops.py", "tests/test_shadow.py"),
    "accucheck/signoff/run.py": ("tests/test_signoff_checks.py", "tests/test_signoff_rules.py",
                                 "tests/test_signoff.py", "tests/test_scenario.py"),
    "accucheck/report/signoff_result.py": ("tests/test_signoff_result.py",
                                           "tests/test_signoff_rules.py", "tests/test_signoff.py"),
    "accucheck/report/diff.py": ("tests/test_report_render.py", "tests/test_verdict_mutants.py",
                                 "tests/test_report.py", "tests/test_cli_diff.py",
                                 "tests/test_readme.py"),
}

# (module, regex on the MUTATED line(s), why[, regex on the original line(s)]) for mutants that
# no input can tell from the original (or only inputs outside any meaningful domain, said so).
# Listed in the report, never run, not counted in the kill rate. Keep it short and honest: a
# mutant that a test could kill does not belong here.
def _exact(*lines: str) -> str:
    """A regex matching a mutated line that is exactly one of `lines` (indentation aside)."""
    return r"^\s*(" + "|".join(re.escape(ln) for ln in lines) + r")$"


_RANK = ("DTYPE_EPS only ranks dtypes (coarser_dtype, loosest_dtype, membership): this x2 or /2"
         " keeps every dtype's rank (the ones that would create a tie are tested)")
# the modules the table names (short names keep its rows within 100 columns)
_METRICS = "accucheck/compare/metrics.py"
_OPMATCH = "accucheck/compare/opmatch.py"
_LOCATE = "accucheck/verdict/locate.py"
_CULPRIT = "accucheck/verdict/culprit.py"
_TOL = "accucheck/compare/tolerances.py"
_SRES = "accucheck/report/signoff_result.py"
_RDIFF = "accucheck/report/diff.py"
EQUIVALENT: tuple[tuple[str, ...], ...] = (
    (_METRICS, r'"float64": (4\.44|1\.11)\d*e-16, "float32"', _RANK),
    (_METRICS, r'"float32": (2\.38|5\.96)\d*e-0[78], "float16"', _RANK),
    (_METRICS, r'"float16": (0\.001953125|0\.00048828125),$', _RANK),
    (_METRICS, r'"bfloat16": (0\.015625|0\.00390625), "float8_e4m3fn"', _RANK),
    (_METRICS, r'"float8_e4m3fn": 0\.0625, "float8_e5m2"', _RANK),
    (_METRICS, r'"float8_e5m2": 0\.5,$', _RANK),
    (_METRICS, r"^\s*pass$", "a fast path: indexing with an all-true mask gives "
     "the same arrays", r"if m\.all\(\):\n\s*return a, b$"),
    (_METRICS, _exact("bad = (na != nb) | (ia != ib) | ((ia | ib) & (np.sign(a) "
                                    "!= np.sign(b)))"),
     "where only one side is inf, (ia != ib) already counts the position"),
    (_METRICS, r"self\._max_abs = \(-(2\.0|0\.5)\)$", "a negative sentinel: the "
     "first |difference| (>= 0) replaces any negative value, and result() clamps at 0"),
    (_METRICS, r"^\s*pass$", "a fast path for an identical block: the general "
     "path counts the same (rel 0 < 1e-3, 0/0 as agreeing, no mismatch, 0 ULP)",
     r"if d\[j\] == 0\.0:  # identical chunk"),
    (_METRICS, r"^\s*pass$", "add() never passes an empty block (its slices come "
     "from range(0, size, _BLOCK))", r"if not a\.size:\n\s*return$"),
    (_OPMATCH, r"s = (6\.0|1\.5) \+ \(0\.5 if",
     "the base pair score only has to exceed the largest tie-break (overload 0.5 + data 1.0): "
     "6.0 aligns every pair of sequences identically, 1.5 too except at an exact tie"),
    (_OPMATCH, r"s \+= 1\.0 - (min\(2\.0, )?\(?abs\(la - lb\) / max",
     "|la - lb| / max(la, lb) <= 1 for l2 norms (>= 0): the cap at 1.0 never binds"),
    (_OPMATCH, _exact("if (math.isfinite(lb)):", "if (math.isfinite(la)):",
                                    "if (math.isfinite(la) or math.isfinite(lb)):"),
     "a non-finite l2 makes the data term 1 - min(1.0, nan) = 0, the same as skipping it"),
    (_OPMATCH, _exact("if (not n and (not m)):", "if (not m):", "if (not n):",
                                    "pass"),
     "a fast path: with an empty side the DP and the fused-region pass find nothing either",
     r"if not n or not m:$"),
    (_OPMATCH, r"S = \[\[(1\.0\] \* \(m \+ 1\)|0\.0\] \* \(m \+ 2\)|0\.0\] \* "
     r"\(m \+ 1\) for _ in range\(\(?n \+ 2\)?\))", "the DP's border row and column: a uniform "
     "shift of every cell (1.0) or a row / column the loops never read (n + 2, m + 2)"),
    (_OPMATCH, _exact("best = Sp[j] if (Sp[j] > Si[j - 1]) else Si[j - 1]"),
     "which of two equal values is kept does not change the maximum"),
    (_OPMATCH, _exact("if (Sp[j - 1] + s > best):",
                                    "if s != (math.inf) and Sp[j - 1] + s > best:",
                                    "if s != -math.inf and (Sp[j - 1] + s >= best):"),
     "s = -inf never beats a finite best; taking an equal value keeps the same maximum"),
    (_OPMATCH, r"while i:$", "with j = 0 the border column (0.0) never equals a "
     "pair score (>= 3) and i just counts down: no pair is added"),
    (_OPMATCH, _exact("if (S[i][j] == S[i - 1][j - 1] + s):",
                                    "if s != (math.inf) and S[i][j] == S[i - 1][j - 1] + s:"),
     "a -inf score never makes a finite cell equal"),
    (_OPMATCH, _exact("if (not p['site']):"), "an empty extra makes json.loads "
     "raise ValueError, which is caught: the same as skipping it"),
    (_OPMATCH, r"MAX_DP = 250001$", "the fallback threshold of a performance "
     "switch moves by one cell (tested at its boundary with a small MAX_DP)"),
    (_OPMATCH, r"max\(abs\(la\), abs\(lb\), (2e-30|5e-31)\)",
     "the division guard differs only for l2 norms below 2e-30 (all-zero tensors give 0 / guard"
     " = 0 either way)"),
    (_LOCATE, _exact("for (req, step) in sorted(groups, key=lambda g: "
                                   "(g[1], g[1])):"),
     "groups of one step (different requests) never interact: site_err is keyed by request and"
     " errs is filled before the walk, so their order within a step does not matter"),
    (_LOCATE, r"max\(r\.tolerance\.rel_l2, (2e-300|5e-301)\)", "the division "
     "guard differs only for tolerances below 2e-300 (a zero tolerance is tested)"),
    (_LOCATE, _exact("return Divergence(r.key, (loc.cause), r.error, "
                                   "loc.input_error,"),
     "divergence() only gets records over tolerance, whose cause is never None"),
    (_LOCATE, _exact("ranked = sorted((x for x in records if (x.introduced > 0)),"),
     "an input record's introduced error is always 0.0 (_locate_group): the role test is moot"),
    (_LOCATE, _exact("sus = tuple(s for s in sus if ((s.key.step, s.key.req, "
                                   "order[str(s.key)]) <= first))"),
     "record orders are unique and the first divergence is introduced, which noise_floor "
     "leaves out: no suspicious record equals `first`"),
    (_LOCATE, _exact("if (r.basis == 'shape' or layer is None):"),
     "an input record has input_basis 'none' and never a shadow (diff pairs shadows with 'out' "
     "records only): the next test skips it anyway"),
    (_LOCATE, _exact("return max((r.error for r in self.outs), default=1.0)"),
     "a node is made for an output record: outs is never empty"),
    (_LOCATE, r"^\s*pass$", "encloses() is only called on module nodes "
     "(by_module holds nodes with op None)", r"if self\.op is not None:\n\s*return False$"),
    (_LOCATE, r"^\s*return( True)?$", "unreachable: encloses() is only called on "
     "module nodes (by_module holds nodes with op None)", r"^\s*return False$"),
    (_LOCATE, _exact("if (other.module == self.module and other.call == self.call):"),
     "a module node's candidate parents are strict prefixes of it: other.module == self.module "
     "only for ops"),
    (_LOCATE, _exact("if (other.op is not None and other.call == self.call):"),
     "an op's candidate parents are its own module and that module's prefixes: for a prefix, "
     "other.module != self.module but the startswith test below returns True as well"),
    (_LOCATE, _exact("n.order = (r.order)"), "records are walked in order: r.order "
     ">= n.order, so the max is r.order"),
    (_LOCATE, _exact('cands += [".".join(parts[:i]) for i in range((len(parts) + 1)'
                                   ', 0, -1)]', 'cands += [".".join(parts[:i]) for i in range('
                                   '(len(parts)), 0, -1)]'),
     "the extra candidates are the module itself, which never encloses a module call (and for "
     "an op repeats its first candidate, with the same answer)"),
    (_LOCATE, r"^\s*pass$", "resolve() is idempotent: a second call recomputes "
     "the same values (the recursion to parents has no cycles)", r"if n\.done:\n\s*return$"),
    (_LOCATE, _exact("n.done = False"), "resolve() is idempotent: resolving again "
     "recomputes the same values"),
    (_LOCATE, r"^\s*continue$", "siblings are in execution order: once one is not "
     "before n, none after it is either (continue skips them all, as break does)",
     r"^ {20}break$"),
    (_LOCATE, _exact("if (st <= r.key.step):"), "steps are walked in ascending "
     "order and site_err is extended after each group: every entry is from an earlier step"),
    (_LOCATE, _exact("inner = max((c.error for c in n.children), default=None)"),
     "a node is made for an output record: every child has outs"),
    (_CULPRIT, _exact("if not r.dtype_mismatch or compute[1] is None or compute[0] "
                                    "!= compute[1]:"),
     "reached only when compute[0] == compute[1]: then compute[0] is None iff compute[1] is"),
    (_CULPRIT, _exact("if (not ops and target.basis != 'shape'):"),
     "an op culprit is itself an op output of its module call, so `ops` is never empty then"),
    (_CULPRIT, _exact('return int(ident.rsplit("@", 2)[1])'),
     "an op ident holds one '@' (module paths and op names have none)"),
    (_CULPRIT, r"^\s*pass$", "f'{inf:.2e}' is 'inf' too",
     r"if math\.isinf\(x\):\n\s*return \"inf\"$"),
    (_TOL, r'best, eps = "int64", \(-(2\.0|0\.5)\)$', "a negative start: every eps is >= 0 "
     "(DTYPE_EPS > 0, anything else 0.0), so the first non-None dtype replaces it either way"),
    (_TOL, _exact("Tolerance(1.0, self.rtol, self.atol)  # both-or-neither check"),
     "the Tolerance is made only to check rtol/atol and dropped: rel_l2 0.0 and 1.0 are both "
     "valid"),
    (_TOL, r"^\s*pass$", "from_options' own both-or-neither check: cls(...) on the next lines"
     " raises the same UserError (same text, exit 2) first (float(rel_l2) aside, a float by "
     "signature)", r"if \(rtol is None\) != \(atol is None\):\n\s*raise UserError\(\"give "
     r"--rtol"),
    (_TOL, _exact("if (not pattern or not rhs):"), "str.rpartition returns ('', '', s) "
     "when there is no '=': no sep means no pattern too"),
    (_TOL, r"^\s*pass$", "unreachable: vals is never empty (rhs is not, and each part adds a "
     "field or raises), and without rel_l2 it holds rtol and atol (checked just above), so rtol"
     " is set", r"if \"rel_l2\" not in vals and rtol is None:"),
    (_TOL, _exact('rel = vals.get("rel_l2", math.inf if "rel_l2" not in vals else 1.0)'),
     "the fallback's else branch is never taken: vals.get uses the fallback only when rel_l2 "
     "is not in vals, where it is math.inf"),
    (_SRES, r'return "inf" if \(?x (>= 0\)|> 1) else "-inf"$', "x is +-inf here (math.isinf "
     "just above): x > 0, x >= 0 and x > 1 agree on it"),
    (_SRES, r"^\s*pass$", "f'{inf:.2e}' is 'inf' and f'{-inf:.2e}' '-inf': the general path "
     "formats an infinity the same", r'if math\.isinf\(x\):\n\s*return "inf" if x > 0 else'),
    (_SRES, r"^\s*pass$", "f'{nan:.2e}' is 'nan' (nan == 0 and 1e-3 <= nan are False): the "
     "general path formats it the same", r'if math\.isnan\(x\):\n\s*return "nan"$'),
    (_RDIFF, r'return "inf" if \(?x (>= 0\)|> 1) else "-inf"$', "x is +-inf here (math.isinf "
     "just above): x > 0, x >= 0 and x > 1 agree on it"),
    (_RDIFF, r"^\s*pass$", "f'{inf:.2e}' is 'inf' and f'{-inf:.2e}' '-inf': the general path "
     "formats an infinity the same", r'if isinstance\(x, float\) and math\.isinf\(x\):\n'
     r'\s*return "inf" if x > 0 else'),
    (_RDIFF, r'else \("inf" if \(?x (>= 0\)|> 1) else "-inf"\)$', "x is +-inf here (a "
     "non-finite float that is not NaN): x > 0, x >= 0 and x > 1 agree on it"),
    (_RDIFF, r"max\(r\.tolerance\.rel_l2, (2e-300|5e-301)\)", "the division guard differs "
     "only for tolerances below 2e-300 (a zero tolerance is tested)"),
    (_RDIFF, _exact("if (len(layers) >= MAX_CURVE_ROWS):"), "at exactly MAX_CURVE_ROWS layers "
     "the thinning step is ceil(1) = 1: every layer is kept either way"),
    (_RDIFF, _exact("ref = sum((not r.within_tolerance) for r in d.records)"), "counted only "
     "when every record is within: a record within but not within its tolerance is one the "
     "golden referee judged (RecordDiff.within), so `refereed` is implied"),
    (_RDIFF, _exact('largest = "" if (wo.key == fo.key) else \\'), "the diffuse branch has "
     "first_over set, and locate sets worst whenever first_over is (both from the same "
     "non-empty list of records over tolerance)"),
    (_RDIFF, r'^\s*(str\(r\.key\), r\.key\.req, r\.key\.step, r\.key\.module, \(r\.key\.op\), '
     r'r\.key\.role,|\(loc\.cause\), r\.error,|"" if \(m is None\) else m\.max_ulp,)$',
     "csv.writer writes None as the empty string: `x or \"\"` and a None max_ulp give the same "
     "cell"),
    (_RDIFF, _exact('row = [str(r.key), "ok" if r.within else ((loc.cause)),'), "locate "
     "sets a record's cause to None exactly when it is within (locate._locate_record): the "
     "`or \"over\"` fallback is never taken"),
    (_RDIFF, _exact("if (math.isinf(x)):"), "_g's isinstance test only keeps ints away from "
     "math.isinf, which takes them and answers False: an int is never infinite"),
)


# ----------------------------------------------------------------------------- mutants

@dataclass(frozen=True)
class Mutant:
    file: str            # path relative to the repository root
    line: int            # first line of the mutated node (1-based)
    col: int
    end_line: int
    what: str            # e.g. "compare: < -> <="
    old: str             # original source lines lineno..end_lineno
    new: str             # the same lines with the mutation spliced in
    source: str = field(repr=False, default="")  # the whole mutated module

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"

    def diff(self) -> str:
        return "\n".join([f"    - {ln}" for ln in self.old.splitlines()]
                         + [f"    + {ln}" for ln in self.new.splitlines()])


_CMP_SWAPS = {
    ast.Lt: (ast.LtE, ast.Gt), ast.LtE: (ast.Lt, ast.GtE), ast.Gt: (ast.GtE, ast.Lt),
    ast.GtE: (ast.Gt, ast.LtE), ast.Eq: (ast.NotEq,), ast.NotEq: (ast.Eq,),
    ast.In: (ast.NotIn,), ast.NotIn: (ast.In,), ast.Is: (ast.IsNot,), ast.IsNot: (ast.Is,),
}
_CMP_TEXT = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==",
             ast.NotEq: "!=", ast.In: "in", ast.NotIn: "not in", ast.Is: "is",
             ast.IsNot: "is not"}
_BIN_SWAPS = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult,
              ast.FloorDiv: ast.Div, ast.Pow: ast.Mult, ast.BitAnd: ast.BitOr,
              ast.BitOr: ast.BitAnd}
_BIN_TEXT = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//",
             ast.Pow: "**", ast.BitAnd: "&", ast.BitOr: "|"}
_BIT_OPS = (ast.LShift, ast.RShift, ast.BitAnd, ast.BitOr, ast.BitXor)
_FUNC_SWAPS = {"max": "min", "min": "max", "any": "all", "all": "any"}
_ATTR_SWAPS = {"max": "min", "min": "max", "maximum": "minimum", "minimum": "maximum",
               "fmax": "fmin", "fmin": "fmax", "argmax": "argmin", "argmin": "argmax",
               "amax": "amin", "amin": "amax", "nanmax": "nanmin", "nanmin": "nanmax"}
_ACCUMULATE = ("append", "extend", "add", "update", "setdefault")


def _is_text(node: ast.AST) -> bool:
    """A string (or f-string) expression: + and % on it are formatting, not arithmetic."""
    if isinstance(node, ast.JoinedStr):
        return True
    if isinstance(node, ast.Constant):
        return isinstance(node.value, (str, bytes))
    if isinstance(node, ast.BinOp):
        return _is_text(node.left) or _is_text(node.right)
    return False


def _number(node: ast.AST):
    """The value of a numeric literal (`3`, `-1e-3`), else None."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) \
            and isinstance(node.operand, ast.Constant) and type(node.operand.value) in (int, float):
        return -node.operand.value
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):  # 2.0 ** -23: one literal
        a, b = _number(node.left), _number(node.right)
        if a is not None and b is not None:
            return a ** b
    return None


def _lit(value) -> ast.expr:
    if isinstance(value, (int, float)) and value < 0:
        return ast.UnaryOp(ast.USub(), ast.Constant(-value))
    return ast.Constant(value)


def _fmt_num(v) -> str:
    return repr(v)


def _variants(node: ast.AST) -> list[tuple[str, ast.AST]]:
    """(description, replacement node) for every mutation of this node."""
    out: list[tuple[str, ast.AST]] = []
    if isinstance(node, ast.Compare):
        for i, op in enumerate(node.ops):
            for new in _CMP_SWAPS.get(type(op), ()):
                m = copy.deepcopy(node)
                m.ops[i] = new()
                out.append((f"compare: {_CMP_TEXT[type(op)]} -> {_CMP_TEXT[new]}", m))
    elif isinstance(node, ast.BoolOp):
        name = "and" if isinstance(node.op, ast.And) else "or"
        m = copy.deepcopy(node)
        m.op = ast.Or() if name == "and" else ast.And()
        out.append((f"boolop: {name} -> {'or' if name == 'and' else 'and'}", m))
        for i in range(len(node.values)):
            rest = [copy.deepcopy(v) for j, v in enumerate(node.values) if j != i]
            m = rest[0] if len(rest) == 1 else ast.BoolOp(copy.deepcopy(node.op), rest)
            out.append((f"boolop: drop operand {i + 1} of '{name}'", m))
    elif isinstance(node, ast.BinOp) and type(node.op) in _BIN_SWAPS and not _is_text(node) \
            and _number(node) is None:
        op = type(node.op)
        m = copy.deepcopy(node)
        m.op = _BIN_SWAPS[op]()
        out.append((f"binop: {_BIN_TEXT[op]} -> {_BIN_TEXT[_BIN_SWAPS[op]]}", m))
        if op in (ast.Add, ast.Sub):
            out.append((f"binop: drop the right term of '{_BIN_TEXT[op]}'",
                        copy.deepcopy(node.left)))
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        out.append(("not removed", copy.deepcopy(node.operand)))
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) \
            and _number(node) is None:
        out.append(("unary minus removed", copy.deepcopy(node.operand)))
    elif isinstance(node, ast.Call):
        f = node.func
        name = f.id if isinstance(f, ast.Name) else None
        if name in _FUNC_SWAPS:
            m = copy.deepcopy(node)
            m.func.id = _FUNC_SWAPS[name]
            out.append((f"call: {name} -> {_FUNC_SWAPS[name]}", m))
        elif isinstance(f, ast.Attribute) and f.attr in _ATTR_SWAPS:
            m = copy.deepcopy(node)
            m.func.attr = _ATTR_SWAPS[f.attr]
            out.append((f"call: .{f.attr} -> .{_ATTR_SWAPS[f.attr]}", m))
        if name in ("max", "min") and len(node.args) == 2 and not node.keywords \
                and not any(isinstance(a, ast.Starred) for a in node.args):
            for i, a in enumerate(node.args):
                out.append((f"call: {name}(...) -> argument {i + 1} only", copy.deepcopy(a)))
    elif isinstance(node, ast.Return) and node.value is not None \
            and not (isinstance(node.value, ast.Constant) and node.value.value is None):
        out.append(("return X -> return None", ast.Return(None)))
    elif isinstance(node, ast.Break):
        out.append(("break -> continue", ast.Continue()))
    elif isinstance(node, ast.Continue):
        out.append(("continue -> break", ast.Break()))
    elif isinstance(node, ast.If) and not node.orelse:
        out.append(("if-statement (no else) dropped", ast.Pass()))
    elif isinstance(node, ast.AugAssign) and type(node.op) in _BIN_SWAPS:
        op = type(node.op)
        m = copy.deepcopy(node)
        m.op = _BIN_SWAPS[op]()
        out.append((f"augassign: {_BIN_TEXT[op]}= -> {_BIN_TEXT[_BIN_SWAPS[op]]}=", m))
        out.append((f"augassign: statement dropped", ast.Pass()))
    elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) \
            and isinstance(node.value.func, ast.Attribute) \
            and node.value.func.attr in _ACCUMULATE:
        out.append((f"statement dropped (.{node.value.func.attr}(...))", ast.Pass()))
    elif isinstance(node, ast.comprehension) and node.ifs:
        for i in range(len(node.ifs)):
            m = copy.deepcopy(node)
            del m.ifs[i]
            out.append((f"comprehension filter {i + 1} dropped", m))
    v = _number(node)
    if v is not None:
        # floats (tolerances, thresholds, floors): x2 and /2; ints (indices, counts): +1
        news = ([v * 2, v / 2] if v != 0 else [1.0]) if isinstance(v, float) else [v + 1]
        for n in news:
            out.append((f"constant: {_fmt_num(v)} -> {_fmt_num(n)}", _lit(n)))
    elif isinstance(node, ast.Constant) and isinstance(node.value, bool):
        out.append((f"constant: {node.value} -> {not node.value}", ast.Constant(not node.value)))
    return out


def _skipped_subtrees(tree: ast.AST) -> set[int]:
    """ids of nodes never mutated: inside f-strings, annotations, assert / raise statements,
    docstrings."""
    skip: set[int] = set()

    def mark(n):
        for x in ast.walk(n):
            skip.add(id(x))

    for n in ast.walk(tree):
        if isinstance(n, (ast.JoinedStr, ast.Assert, ast.Raise)):
            mark(n)
        elif isinstance(n, ast.arg) and n.annotation is not None:
            mark(n.annotation)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.returns is not None:
            mark(n.returns)
        elif isinstance(n, ast.AnnAssign):
            mark(n.annotation)
    return skip


class _Source:
    """Source text with (line, UTF-8 byte column) -> character offset."""

    def __init__(self, text: str):
        self.text = text
        self.lines = text.splitlines(keepends=True)
        self.starts = [0]
        for ln in self.lines:
            self.starts.append(self.starts[-1] + len(ln))

    def offset(self, line: int, col_bytes: int) -> int:
        s = self.lines[line - 1].encode("utf-8")[:col_bytes].decode("utf-8", errors="replace")
        return self.starts[line - 1] + len(s)


def _span(node: ast.AST) -> tuple[int, int, int, int] | None:
    if isinstance(node, ast.comprehension):  # no position of its own: from target to last if
        first, last = node.target, (node.ifs[-1] if node.ifs else node.iter)
        return first.lineno, first.col_offset, last.end_lineno, last.end_col_offset
    if getattr(node, "end_lineno", None) is None:
        return None
    return node.lineno, node.col_offset, node.end_lineno, node.end_col_offset


def _render(node: ast.AST, replacement: ast.AST) -> str:
    if isinstance(node, ast.comprehension):
        r = replacement
        text = f"{ast.unparse(r.target)} in {ast.unparse(r.iter)}"
        return text + "".join(f" if {ast.unparse(c)}" for c in r.ifs)
    text = ast.unparse(replacement)
    if isinstance(node, ast.expr) and not isinstance(replacement, (ast.Name, ast.Constant)):
        text = f"({text})"
    elif isinstance(node, ast.expr) and _number(replacement) is not None and text.startswith("-"):
        text = f"({text})"
    return text


def generate(file: str, root: Path = ROOT) -> list[Mutant]:
    """Every mutant of one module, in source order (line, column, then mutation)."""
    text = (root / file).read_text(encoding="utf-8")
    src = _Source(text)
    tree = ast.parse(text)
    _mark_parents(tree)
    skip = _skipped_subtrees(tree)
    found: list[tuple[tuple, Mutant]] = []
    seen: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        parent = getattr(node, "_parent", None)
        if _number(node) is not None and _number(parent) is not None:
            continue  # part of a literal (its minus sign, a power of literals): mutated whole
        if _number(node) is not None and isinstance(parent, ast.BinOp) \
                and type(parent.op) in _BIT_OPS:
            continue  # masks and shift counts of bit manipulation
        variants = _variants(node)
        if not variants:
            continue
        sp = _span(node)
        if sp is None:
            continue
        l0, c0, l1, c1 = sp
        a, b = src.offset(l0, c0), src.offset(l1, c1)
        for k, (what, repl) in enumerate(variants):
            new_text = text[:a] + _render(node, repl) + text[b:]
            if new_text == text or new_text in seen:
                continue
            try:
                compile(new_text, file, "exec")
            except SyntaxError:
                continue
            seen.add(new_text)
            old = "".join(src.lines[l0 - 1:l1]).rstrip("\n")
            line_start, line_end = src.starts[l0 - 1], src.starts[l1]
            new = new_text[line_start:line_end + (len(new_text) - len(text))].rstrip("\n")
            found.append(((l0, c0, -l1, -c1, k),
                          Mutant(file, l0, c0, l1, what, old, new, new_text)))
    found.sort(key=lambda t: t[0])
    return [m for _, m in found]


def _mark_parents(tree: ast.AST) -> None:
    """Parent links: the minus sign of `-1` belongs to the literal (mutated as one)."""
    for n in ast.walk(tree):
        for c in ast.iter_child_nodes(n):
            c._parent = n  # type: ignore[attr-defined]


def equivalent_reason(m: Mutant) -> str | None:
    for mod, new_re, why, *old_re in EQUIVALENT:
        if mod == m.file and re.search(new_re, m.new, re.M) \
                and all(re.search(r, m.old, re.M) for r in old_re):
            return why
    return None


def changed_lines(ref: str, file: str, root: Path = ROOT) -> set[int]:
    """Lines of `file` (working tree) added or changed since git `ref`."""
    r = subprocess.run(["git", "diff", "-U0", "--no-color", ref, "--", file], cwd=root,
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"mutants: git diff {ref} failed: {r.stderr.strip()}")
    lines: set[int] = set()
    tracked = subprocess.run(["git", "cat-file", "-e", f"{ref}:{file}"], cwd=root,
                             capture_output=True).returncode == 0
    if not tracked:  # new since ref: every line is changed
        return set(range(1, len((root / file).read_text().splitlines()) + 1))
    for m in re.finditer(r"^@@ -\d+(?:,\d+)? \+(\d+)(?:,(\d+))? @@", r.stdout, re.M):
        start, n = int(m.group(1)), int(m.group(2) or 1)
        lines.update(range(start, start + n))
    return lines


# ----------------------------------------------------------------------------- running

@dataclass
class Outcome:
    mutant: Mutant
    status: str          # killed | survived | timeout | error | equivalent
    seconds: float = 0.0
    detail: str = ""


def repo_files(root: Path) -> list[str]:
    r = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=root,
                       capture_output=True, check=True)
    return [p for p in r.stdout.decode().split("\0") if p and (root / p).is_file()]


def make_copy(root: Path, files: list[str]) -> Path:
    dst = Path(tempfile.mkdtemp(prefix="accucheck-mutants-"))
    for f in files:
        t = dst / f
        t.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / f, t)
    return dst


def _env(work: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(work) + (os.pathsep + env["PYTHONPATH"]
                                     if env.get("PYTHONPATH") else "")
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # a same-size mutant must never meet a stale .pyc
    return env


def check_copy(work: Path, package: str | None) -> None:
    if not package:
        return
    r = subprocess.run([sys.executable, "-c",
                        f"import {package}, os; print(os.path.realpath({package}.__file__))"],
                       cwd=work, env=_env(work), capture_output=True, text=True)
    got = r.stdout.strip()
    if r.returncode != 0 or not got.startswith(os.path.realpath(work)):
        raise SystemExit(f"mutants: in the copy, `import {package}` gives {got or r.stderr!r}, "
                         f"not the copy under {work}: mutants would not be tested")


def run_pytest(work: Path, tests: list[str], marker: str | None, timeout: float
               ) -> tuple[str, float, str]:
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
           "--no-header", *tests]
    if marker is not None:
        cmd += ["-m", marker]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=work, env=_env(work), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        out, _ = proc.communicate()
        return "timeout", time.monotonic() - t0, (out or "")[-2000:]
    except BaseException:  # interrupted: never leave this pytest running
        _kill_group(proc)
        proc.communicate()
        raise
    dt = time.monotonic() - t0
    rc = proc.returncode
    status = {0: "survived", 1: "killed", 2: "killed", 3: "killed"}.get(rc, "error")
    if rc < 0 or rc == 5 or rc == 4:
        status = "error"
    return status, dt, out[-2000:]


def run_staged(work: Path, tests: list[str], marker: str | None, timeouts: list[float]
               ) -> tuple[str, float, str]:
    """The test files one pytest run each, in order, stopping at the first that fails: a
    mutant the first (fast) file kills never pays for collecting the others (collection alone
    imports torch for some)."""
    total, out = 0.0, ""
    for t, limit in zip(tests, timeouts):
        status, dt, out = run_pytest(work, [t], marker, limit)
        total += dt
        if status == "error" and "no tests ran" in out:  # nothing selected in this file (-m)
            continue
        if status != "survived":
            return status, total, out
    return "survived", total, out


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # pytest and whatever it started (its own session)
    except ProcessLookupError:
        pass


def tests_for(file: str, root: Path, override: list[str] | None) -> list[str]:
    if override:
        return override
    if file in TESTS:
        return [t for t in TESTS[file] if (root / t).is_file()]
    t = f"tests/test_{Path(file).stem}.py"
    return [t] if (root / t).is_file() else []


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mutants.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modules", nargs="+", default=list(DEFAULT_MODULES), metavar="FILE",
                   help="modules to mutate, relative to the repository root")
    p.add_argument("--tests", nargs="+", default=None, metavar="FILE",
                   help="test files to run for every module (default: the TESTS mapping)")
    p.add_argument("-m", dest="marker", default=None,
                   help="pytest -m expression (default: the project's addopts; -m '' runs the "
                        "slow tests too)")
    p.add_argument("--max", type=int, default=None, help="run at most N mutants")
    p.add_argument("--sample", type=int, default=None, metavar="N",
                   help="run a random sample of N of the selected mutants (reproducible with "
                        "--seed; for a module too large to run whole: the kill rate of the "
                        "sample estimates the module's)")
    p.add_argument("--seed", type=int, default=0, help="seed of --sample (default 0)")
    p.add_argument("--jobs", type=int, default=1, help="mutants run in parallel (one copy each)")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds per test file and mutant (default: 3x its baseline run, at "
                        "least 60)")
    p.add_argument("--list", action="store_true", help="list the mutants, run nothing")
    p.add_argument("--only", action="append", default=[], metavar="FILE:LINE",
                   help="only mutants on this line (repeatable)")
    p.add_argument("--changed", metavar="REF", default=None,
                   help="only mutants on lines changed since this git ref (working tree)")
    p.add_argument("--json", dest="json_out", default=None,
                   help="write the results here (rewritten after every mutant)")
    p.add_argument("--resume", default=None, metavar="JSON",
                   help="an earlier --json: its killed / timeout mutants (same file, line, "
                        "mutation and text) are carried over, not rerun (tests only get added, "
                        "so a killed mutant stays killed); the rest run")
    p.add_argument("--repo", default=str(ROOT), help=argparse.SUPPRESS)
    p.add_argument("--package", default="accucheck",
                   help="package whose import must resolve into the copy ('' to skip)")
    args = p.parse_args(argv)
    root = Path(args.repo).resolve()

    only: dict[str, set[int]] = {}
    for o in args.only:
        f, sep, ln = o.rpartition(":")
        if not sep or not ln.isdigit():
            p.error(f"--only {o!r}: use FILE:LINE")
        only.setdefault(f, set()).add(int(ln))
    for f in args.modules:
        if not (root / f).is_file():
            p.error(f"no module {f} under {root}")

    mutants: list[Mutant] = []
    for f in args.modules:
        ms = generate(f, root)
        if f in only or only:
            lines = only.get(f, set())
            ms = [m for m in ms if any(m.line <= ln <= m.end_line for ln in lines)]
        if args.changed:
            ch = changed_lines(args.changed, f, root)
            ms = [m for m in ms if any(ln in ch for ln in range(m.line, m.end_line + 1))]
        mutants += ms
    if args.sample is not None and args.sample < len(mutants):
        picked = set(random.Random(args.seed).sample(range(len(mutants)), args.sample))
        mutants = [m for i, m in enumerate(mutants) if i in picked]  # in source order
    if args.max is not None:
        mutants = mutants[:args.max]

    if args.list:
        for i, m in enumerate(mutants, 1):
            eq = equivalent_reason(m)
            print(f"{i:4d} {m.where:32s} {m.what}" + (f"   [equivalent: {eq}]" if eq else ""))
            print(m.diff())
        print(f"{len(mutants)} mutants")
        return 0
    if not mutants:
        print("mutants: nothing to run")
        return 0

    carried: dict[tuple, dict] = {}
    if args.resume:
        for r in json.loads(Path(args.resume).read_text()):
            if r.get("status") in ("killed", "timeout"):
                carried[(r["file"], r["line"], r["what"], r["new"])] = r
    files = repo_files(root)
    works = [make_copy(root, files) for _ in range(max(1, args.jobs))]
    pool_lock = threading.Lock()
    free = list(works)
    outcomes: list[Outcome] = []
    # a SIGTERM (or a closed terminal) still removes the copies and keeps the --json so far
    old_term = signal.signal(signal.SIGTERM, _interrupt)
    old_hup = signal.signal(signal.SIGHUP, _interrupt)
    try:
        check_copy(works[0], args.package)
        by_file: dict[str, list[Mutant]] = {}
        for m in mutants:
            by_file.setdefault(m.file, []).append(m)
        for f, ms in by_file.items():
            tests = tests_for(f, root, args.tests)
            if not tests:
                print(f"{f}: no test files to run (give --tests); {len(ms)} mutants not run")
                outcomes += [Outcome(m, "error", 0.0, "no tests") for m in ms]
                continue
            base: list[float] = []
            for t in tests:
                status, dt, tail = run_pytest(works[0], [t], args.marker, 3600)
                if status == "error" and "no tests ran" in tail:
                    status = "survived"  # nothing selected in this file (-m): fine
                if status != "survived":
                    break
                base.append(dt)
            if status != "survived":
                print(f"{f}: the unmutated tests do not pass ({t}: {status}); its {len(ms)} "
                      f"mutants are not run:\n{tail}")
                outcomes += [Outcome(m, "error", 0.0, "baseline fails") for m in ms]
                continue
            timeouts = [args.timeout or max(60.0, 3 * b) for b in base]
            print(f"{f}: {len(ms)} mutants; tests {' '.join(tests)}"
                  + (f" -m {args.marker!r}" if args.marker is not None else "")
                  + f"; baseline {sum(base):.1f} s ("
                  + ", ".join(f"{b:.0f}" for b in base) + f"), timeouts "
                  + ", ".join(f"{x:.0f}" for x in timeouts) + " s", flush=True)

            def one(m: Mutant) -> Outcome:
                eq = equivalent_reason(m)
                if eq:
                    return Outcome(m, "equivalent", 0.0, eq)
                prev = carried.get((m.file, m.line, m.what, m.new))
                if prev is not None:
                    return Outcome(m, prev["status"], 0.0, f"carried from {args.resume}")
                with pool_lock:
                    work = free.pop()
                target = work / m.file
                original = target.read_text(encoding="utf-8")
                try:
                    target.write_text(m.source, encoding="utf-8")
                    st, dt, out = run_staged(work, tests, args.marker, timeouts)
                finally:
                    target.write_text(original, encoding="utf-8")
                    with pool_lock:
                        free.append(work)
                return Outcome(m, st, dt, out if st in ("error",) else "")

            done = 0
            with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as ex:
                for o in ex.map(one, ms):
                    done += 1
                    outcomes.append(o)
                    how = "carried" if o.detail.startswith("carried") else f"{o.seconds:.1f} s"
                    print(f"[{done:3d}/{len(ms)}] {o.status:10s} {o.mutant.where:30s} "
                          f"{o.mutant.what}  ({how})", flush=True)
                    if args.json_out:
                        write_json(outcomes, args.json_out)
    except KeyboardInterrupt:
        print("\nmutants: interrupted; the summary covers the mutants run so far", flush=True)
    finally:
        signal.signal(signal.SIGTERM, old_term)
        signal.signal(signal.SIGHUP, old_hup)
        for w in works:
            shutil.rmtree(w, ignore_errors=True)

    return report(outcomes, args.json_out)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def write_json(outcomes: list[Outcome], path: str) -> None:
    tmp = Path(path + ".tmp")
    tmp.write_text(json.dumps(
        [{"file": o.mutant.file, "line": o.mutant.line, "what": o.mutant.what,
          "status": o.status, "seconds": round(o.seconds, 2), "old": o.mutant.old,
          "new": o.mutant.new, "detail": o.detail} for o in outcomes], indent=1))
    tmp.replace(path)


def report(outcomes: list[Outcome], json_out: str | None) -> int:
    surv = [o for o in outcomes if o.status == "survived"]
    if surv:
        print("\nSurvivors (bugs the tests let through):")
        for o in surv:
            print(f"  {o.mutant.where}  {o.mutant.what}")
            print(o.mutant.diff())
    eqs = [o for o in outcomes if o.status == "equivalent"]
    if eqs:
        print("\nEquivalent (not run):")
        for o in eqs:
            print(f"  {o.mutant.where}  {o.mutant.what}: {o.detail}")
    errs = [o for o in outcomes if o.status == "error"]
    if errs:
        print("\nErrors (pytest could not judge these):")
        for o in errs:
            print(f"  {o.mutant.where}  {o.mutant.what}: {o.detail.strip()[-300:]}")
    print("\nSummary:")
    rows = {}
    for o in outcomes:
        rows.setdefault(o.mutant.file, []).append(o.status)
    for f, sts in list(rows.items()) + [("total", [o.status for o in outcomes])]:
        c = {s: sts.count(s) for s in ("killed", "timeout", "survived", "error", "equivalent")}
        judged = c["killed"] + c["timeout"] + c["survived"]
        rate = (c["killed"] + c["timeout"]) / judged if judged else float("nan")
        print(f"  {f:28s} {len(sts):4d} mutants: killed {c['killed']}, timeout {c['timeout']}, "
              f"survived {c['survived']}, error {c['error']}, equivalent {c['equivalent']}"
              f"  -> kill rate {rate:.1%}")
    n_carried = sum(o.detail.startswith("carried") for o in outcomes)
    if n_carried:
        print(f"  ({n_carried} killed / timeout results carried from the --resume file)")
    if json_out:
        write_json(outcomes, json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
