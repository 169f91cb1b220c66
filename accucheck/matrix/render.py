"""The matrix as text and HTML: the same facts as its JSON (matrix.run.Matrix.to_json), one
table row per run and request, then what each moved run's localisation found, the engine
starts and the baseline's environment."""
from __future__ import annotations

import html

from tabulate import tabulate

from accucheck.matrix.run import PROCESSED_NOTE, Matrix
from accucheck.numbers import number

HEADERS = ("run", "request", "bitwise", "max |dlogprob|", "max KL", "top-1", "first flip",
           "cached")


def table_rows(m: Matrix) -> list[tuple]:
    out = []
    for row in m.rows:
        if row.error:
            out.append((row.label, "-", "not run (below)", "-", "-", "-", "-", "-"))
            continue
        for d in row.requests:
            flip = "-" if d.flip is None else (
                f"step {d.flip.step}: {d.flip.base_token}->{d.flip.run_token} ({d.flip.label})")
            out.append((row.label, d.request, "yes" if d.bitwise else
                        f"no (from step {d.first_step})", number(d.max_dlogprob), number(d.max_kl),
                        f"{d.top1:.2f}", flip, "-" if d.cached_tokens is None
                        else d.cached_tokens))
    return out


def headline(m: Matrix) -> str:
    moved = [r for r in m.rows if r.moved]
    failed = [r for r in m.rows if r.error]
    if m.violations:
        return (f"FAIL: {len(m.violations)} expected-invariant run(s) broke the contract "
                f"({', '.join(m.expect_invariant)})")
    line = (f"{'PASS' if m.expect_invariant else 'DONE'}: {len(m.rows)} run(s) against the "
            f"baseline, {len(moved)} move the numbers")
    return line + (f", {len(failed)} could not be run" if failed else "")


def render_text(m: Matrix) -> str:
    out = [headline(m), "",
           f"runner {m.runner}, model {m.model}, {m.dtype} on {m.device}, "
           f"{len(m.prompts)} request(s), {m.max_new_tokens} forced decode step(s); every run "
           f"flips one knob from the baseline and follows the baseline's tokens", ""]
    out.append(tabulate(table_rows(m), headers=HEADERS, tablefmt="simple"))
    out += ["", "What moved and where it starts:"]
    out += [f"  {r.summary()}" for r in m.rows] or ["  (no runs)"]
    for v in m.violations:
        out.append(f"INVARIANCE BROKEN: {v}")
    out += ["", "Engine starts:"]
    for i, e in enumerate(m.engines):
        out.append(f"  {i + 1}. {e.seconds:.1f} s for {', '.join(e.runs)}"
                   + (f" (env {e.env})" if e.env else ""))
    out += ["", f"Note: {PROCESSED_NOTE}."]
    env = m.environment
    out.append("Baseline environment: " + ", ".join(f"{k} {v}" for k, v in env.items()
                                                     if isinstance(v, (str, int, float))))
    return "\n".join(out) + "\n"


def render_html(m: Matrix) -> str:
    esc = html.escape
    head = "".join(f"<th>{esc(h)}</th>" for h in HEADERS)
    body = "".join("<tr>" + "".join(f"<td>{esc(str(c))}</td>" for c in row) + "</tr>"
                   for row in table_rows(m))
    moved = "".join(f"<li>{esc(r.summary())}</li>" for r in m.rows)
    broken = "".join(f"<li><b>INVARIANCE BROKEN</b>: {esc(v)}</li>" for v in m.violations)
    engines = "".join(f"<li>{e.seconds:.1f} s for {esc(', '.join(e.runs))}</li>"
                      for e in m.engines)
    env = "".join(f"<tr><td>{esc(str(k))}</td><td>{esc(str(v))}</td></tr>"
                  for k, v in m.environment.items() if isinstance(v, (str, int, float)))
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>accucheck matrix</title>"
            f"<style>body{{font-family:sans-serif}}td,th{{border:1px solid #ccc;padding:2px 6px}}"
            f"table{{border-collapse:collapse}}</style></head><body>"
            f"<h1>{esc(headline(m))}</h1>"
            f"<p>runner {esc(m.runner)}, model {esc(m.model)}, {esc(m.dtype)} on "
            f"{esc(m.device)}, {len(m.prompts)} request(s), {m.max_new_tokens} forced decode "
            f"step(s)</p><table><tr>{head}</tr>{body}</table>"
            f"<h2>What moved and where it starts</h2><ul>{moved}{broken}</ul>"
            f"<h2>Engine starts</h2><ol>{engines}</ol><p>{esc(PROCESSED_NOTE)}.</p>"
            f"<h2>Baseline environment</h2><table>{env}</table></body></html>\n")
