"""Benchmark the diff page (`accucheck diff --format html`): render time and page size for a
synthetic 80-layer, 15-kind, 8-step, 4-request diff. Not a test; one run, prints a table.

    python bench/bench_html_diff.py [--layers 80] [--steps 8] [--reqs 4] [--workdir DIR]
                                    [--repeat 3] [--out page.html] [--browser]

The captures are tests/htmlcases.py's deep_pair (tiny [1, n, 8] tensors, a 1e-3 fault from
layer 40's post_attention_layernorm on): what the page costs depends on the number of records,
not their size. Writing and diffing them is timed too (the diff's cost, for scale), then the
page is rendered `--repeat` times (best and median) and its bytes are split into the cells'
JSON blob, the heatmap markup and the rest. --browser: also the time headless Chromium takes to
load the page (a new tab, navigation, the script run, to the load event; tests/browser.py).
"""
from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=80)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--reqs", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=None, help="also write the page here")
    ap.add_argument("--browser", action="store_true", help="time Chromium loading the page")
    args = ap.parse_args()
    import htmlcases
    from accucheck.report.diff import verdict_line
    from accucheck.report.html_diff import to_html
    from accucheck.verdict.locate import analyze

    with tempfile.TemporaryDirectory() as tmp:
        work = args.workdir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        ref, cand = htmlcases.deep_pair(work, layers=args.layers, steps=args.steps,
                                        reqs=args.reqs)
        t1 = time.perf_counter()
        a = analyze(ref, cand)
        t2 = time.perf_counter()
        times, page = [], ""
        for _ in range(args.repeat):
            s = time.perf_counter()
            page = to_html(a)
            times.append(time.perf_counter() - s)
    size = len(page.encode())
    blob = len(re.search(r'id="acc-cells">(.*?)</script>', page, re.S).group(1).encode())
    heat = sum(len(m.encode()) for m in re.findall(r'<section class="panel".*?</section>',
                                                    page, re.S))
    cells = page.count("data-c=")
    print(f"shape: {args.layers} layers x {len(htmlcases.KINDS)} kinds x {args.steps} steps x "
          f"{args.reqs} requests: {len(a.diff.records)} records, {cells} cells")
    print(f"verdict: {verdict_line(a)[:120]}")
    print(f"write captures   {t1 - t0:8.2f} s")
    print(f"diff + locate    {t2 - t1:8.2f} s")
    print(f"render html      {min(times):8.2f} s best, {statistics.median(times):.2f} s median "
          f"of {len(times)}")
    print(f"page size        {size / 1e6:8.2f} MB (cells JSON {blob / 1e6:.2f} MB, heatmap "
          f"markup {heat / 1e6:.2f} MB, rest {(size - blob - heat) / 1e6:.2f} MB)")
    if args.out:
        args.out.write_text(page, encoding="utf-8")
        print(f"wrote {args.out}")
    if args.browser:
        load, problems = browser_load(page)
        print(f"chromium load    {load:8.2f} s (to the load event), problems: {problems or 'none'}")


def browser_load(page: str) -> tuple[float, list[str]]:
    """Seconds from navigation to the load event in headless Chromium, and its problems."""
    from browser import DevTools, chromium, open_page

    binary = chromium()
    if binary is None:
        raise SystemExit("chromium not installed (Debian: apt-get install -y chromium)")
    with tempfile.TemporaryDirectory() as tmp:
        f = Path(tmp) / "page.html"
        f.write_text(page, encoding="utf-8")
        dt = DevTools(binary, Path(tmp) / "profile", Path(tmp) / "chromium.log")
        try:
            open_page(dt, "about:blank")
            t = time.perf_counter()
            _, problems, _ = open_page(dt, f.as_uri())
            return time.perf_counter() - t - 0.3, problems  # open_page waits 0.3 s after load
        finally:
            dt.close()


if __name__ == "__main__":
    main()
