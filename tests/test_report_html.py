"""The sign-off HTML report: self-contained (no external resources, no JavaScript, plots as
embedded PNGs), and it opens in real headless Chromium with no console errors; the test run
leaves a full-page screenshot (also copied to /tmp/accucheck-report.png for people to look at).

Chromium is driven over the DevTools protocol on a pipe (tests/browser.py: stdlib only), which
reports console messages, uncaught exceptions and failed loads as events. The browser test
is marked `browser` and skipped only when no chromium binary is installed (Debian: apt-get
install chromium).
"""
from __future__ import annotations

import base64
import re
import shutil
from html.parser import HTMLParser
from pathlib import Path

import pytest

from browser import DevTools, chromium, open_page, png_size

ROOT = Path(__file__).resolve().parents[1]
SCREENSHOT_COPY = Path("/tmp/accucheck-report.png")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    from accucheck.signoff.run import signoff

    out = tmp_path_factory.mktemp("html") / "report"
    res = signoff(ROOT / "scenarios/tiny-planted-fault.toml", out_dir=out)
    assert not res.passed and res.culprit == "model.layers.2.post_attention_layernorm#0"
    return out


class _Collect(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags: list[tuple[str, dict]] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))


@pytest.mark.slow
def test_html_is_self_contained_with_real_plots(report):
    text = (report / "report.html").read_text(encoding="utf-8")
    p = _Collect()
    p.feed(text)
    tags = [t for t, _ in p.tags]
    assert "script" not in tags and "link" not in tags and "iframe" not in tags
    assert not re.search(r"(?i)(https?:)?//[a-z0-9.-]+\.[a-z]{2,}/", text.replace(
        "http://www.w3.org", "")), "external URL in the report"
    imgs = [a for t, a in p.tags if t == "img"]
    assert {a["id"] for a in imgs} == {"plot-layers", "plot-logits_kl", "plot-tokens",
                                      "plot-worst"}
    for a in imgs:
        src = a["src"]
        assert src.startswith("data:image/png;base64,")
        data = base64.b64decode(src.split(",", 1)[1], validate=True)
        w, h = png_size(data)
        assert w >= 400 and h >= 200
        # the same bytes as the PNG file next to it (the markdown links those)
        assert data == (report / "plots" / f"{a['id'][5:]}.png").read_bytes()
    # verdict first, culprit named, environment differences highlighted
    body = text.split("<body>", 1)[1]
    assert body.index('id="verdict"') < body.index("<h2>")
    assert "FAIL: tiny-planted-fault" in text
    assert "CULPRIT: step 0, model.layers.2.post_attention_layernorm#0" in text
    assert '<tr class="differs"><td>planted fault</td>' in text
    # the diff's own page beside it, named by a relative link, with the same culprit marked
    assert '<a href="diff.html">diff.html</a>' in text
    page = (report / "diff.html").read_text(encoding="utf-8")
    assert len(re.findall(r'class="b[5-9] m-culprit m-first"', page)) == 1


# ----------------------------------------------------------------------------- browser

@pytest.mark.browser
@pytest.mark.slow
def test_html_opens_in_headless_chromium(report, tmp_path):
    binary = chromium()
    if binary is None:
        pytest.skip("chromium not installed (Debian: apt-get install -y chromium)")
    dt = DevTools(binary, tmp_path / "profile", tmp_path / "chromium.log")
    try:
        # the harness sees errors: a page with a JS error and a missing image
        bad = tmp_path / "bad.html"
        bad.write_text("<html><body><img src='missing.png'><script>console.error('boom');"
                       "undefined_function();</script></body></html>")
        _, problems, _ = open_page(dt, bad.as_uri())
        assert any("boom" in p for p in problems), problems
        assert any("exception" in p for p in problems), problems

        session, problems, info = open_page(dt, (report / "report.html").resolve().as_uri())
        assert problems == [], problems
        assert info["title"].startswith("accucheck sign-off: tiny-planted-fault")
        assert info["verdict"].startswith("FAIL: tiny-planted-fault")
        assert len(info["images"]) == 4
        for img_id, complete, w, h in info["images"]:
            assert complete and w >= 400 and h >= 200, (img_id, w, h)
        width = 1280
        height = min(int(info["height"]), 16000)
        dt.send("Emulation.setDeviceMetricsOverride", {"width": width, "height": height,
                                                       "deviceScaleFactor": 1,
                                                       "mobile": False}, session=session)
        shot = dt.send("Page.captureScreenshot",
                       {"format": "png", "captureBeyondViewport": True,
                        "clip": {"x": 0, "y": 0, "width": width, "height": height,
                                 "scale": 1}}, session=session)
    finally:
        dt.close()
    data = base64.b64decode(shot["data"])
    w, h = png_size(data)
    assert w == width and h > 1500
    out = tmp_path / "accucheck-report.png"
    out.write_bytes(data)
    try:
        shutil.copyfile(out, SCREENSHOT_COPY)
    except OSError:
        pass
    assert out.stat().st_size > 50_000
