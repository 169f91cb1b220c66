"""Headless Chromium for the HTML report tests (not a test module): `chromium()` finds the
binary, `DevTools` drives it over the DevTools protocol on a pipe (--remote-debugging-pipe:
stdlib only), `open_page` opens a page and returns its console errors, uncaught exceptions and
failed loads, `png_size` reads a screenshot's size.
"""
from __future__ import annotations

import fcntl
import json
import os
import select
import shutil
import struct
import subprocess
import time
from pathlib import Path


def chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        p = shutil.which(name)
        if p:
            return p
    return None


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


class DevTools:
    """Minimal Chrome DevTools protocol client over --remote-debugging-pipe (fds 3 and 4)."""

    def __init__(self, binary: str, profile: Path, log: Path):
        to_chrome_r, self._w = os.pipe()
        self._r, from_chrome_w = os.pipe()
        # move the child's ends above the fds we use, so dup2 onto 3 / 4 cannot clobber them
        hi_r = fcntl.fcntl(to_chrome_r, fcntl.F_DUPFD, 10)
        hi_w = fcntl.fcntl(from_chrome_w, fcntl.F_DUPFD, 10)
        os.close(to_chrome_r)
        os.close(from_chrome_w)

        def child():
            os.dup2(hi_r, 3)
            os.dup2(hi_w, 4)

        args = [binary, "--headless", "--no-sandbox", "--disable-gpu",
                "--disable-background-networking", "--disable-component-update",
                "--disable-sync", "--no-first-run", "--no-default-browser-check",
                "--disable-extensions", "--disable-dev-shm-usage", "--mute-audio",
                f"--user-data-dir={profile}", "--remote-debugging-pipe", "about:blank"]
        self._log = open(log, "wb")
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT, preexec_fn=child,
                                     pass_fds=(3, 4),  # the numbers kept after preexec's dup2
                                     close_fds=True)
        os.close(hi_r)
        os.close(hi_w)
        self._buf = b""
        self._id = 0
        self.events: list[dict] = []

    def send(self, method: str, params: dict | None = None, session: str | None = None,
             timeout: float = 60.0) -> dict:
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._w, json.dumps(msg).encode() + b"\0")
        want = self._id
        deadline = time.monotonic() + timeout
        while True:
            m = self._next(deadline)
            if m.get("id") == want:
                if "error" in m:
                    raise RuntimeError(f"{method}: {m['error']}")
                return m.get("result", {})
            self.events.append(m)

    def wait_event(self, method: str, timeout: float = 60.0) -> dict:
        for i, e in enumerate(self.events):
            if e.get("method") == method:
                return self.events.pop(i)
        deadline = time.monotonic() + timeout
        while True:
            m = self._next(deadline)
            if m.get("method") == method:
                return m
            self.events.append(m)

    def _next(self, deadline: float) -> dict:
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no answer from chromium")
            ready, _, _ = select.select([self._r], [], [], left)
            if ready:
                chunk = os.read(self._r, 1 << 20)
                if not chunk:
                    raise RuntimeError("chromium closed the DevTools pipe")
                self._buf += chunk
        raw, self._buf = self._buf.split(b"\0", 1)
        return json.loads(raw)

    def close(self) -> None:
        try:
            self.send("Browser.close", timeout=10)
        except Exception:
            pass
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for fd in (self._r, self._w):
            try:
                os.close(fd)
            except OSError:
                pass
        self._log.close()


def _problems(events: list[dict]) -> list[str]:
    """Console errors / warnings, uncaught exceptions, failed loads, error log entries."""
    out = []
    for e in events:
        m, p = e.get("method"), e.get("params", {})
        if m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "warning", "assert"):
            out.append(f"console.{p['type']}: " + " ".join(
                str(a.get("value", a.get("description"))) for a in p.get("args", [])))
        elif m == "Runtime.exceptionThrown":
            out.append("exception: " + json.dumps(p.get("exceptionDetails", {}))[:300])
        elif m == "Log.entryAdded" and p.get("entry", {}).get("level") in ("error", "warning"):
            out.append(f"log {p['entry']['level']}: {p['entry'].get('text')} "
                       f"{p['entry'].get('url', '')}")
        elif m == "Network.loadingFailed":
            out.append(f"load failed: {p.get('errorText')}")
    return out


def open_page(dt: DevTools, url: str) -> tuple[str, list[str], dict]:
    """Open `url` in a fresh tab; (session, problems, page info) once loaded."""
    target = dt.send("Target.createTarget", {"url": "about:blank"})["targetId"]
    session = dt.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
    for domain in ("Runtime", "Log", "Page", "Network"):
        dt.send(f"{domain}.enable", session=session)
    dt.events.clear()
    dt.send("Page.navigate", {"url": url}, session=session)
    dt.wait_event("Page.loadEventFired")
    time.sleep(0.3)  # late console messages
    info = dt.send("Runtime.evaluate", {"returnByValue": True, "expression": """JSON.stringify({
        title: document.title,
        verdict: (document.getElementById('verdict') || {}).textContent || null,
        images: Array.from(document.images).map(i => [i.id, i.complete, i.naturalWidth,
                                                      i.naturalHeight]),
        height: document.documentElement.scrollHeight})"""}, session=session)
    dt.send("Runtime.evaluate", {"expression": "1"}, session=session)  # flush pending events
    return session, _problems(dt.events), json.loads(info["result"]["value"])
