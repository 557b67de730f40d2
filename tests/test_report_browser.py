"""The HTML report in a real browser: it loads offline without console errors, renders, and the price
input recomputes the costs shown.

Chromium runs headless and is driven over the DevTools protocol on a pipe (--remote-debugging-pipe:
JSON messages separated by NUL bytes on file descriptors 3 and 4), which needs no extra package.
"""
from __future__ import annotations

import base64
import fcntl
import json
import os
import re
import select
import shutil
import subprocess
import time
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest

from test_report import render_scenario

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
TIMEOUT_S = 60.0
WINDOW = (1100, 1400)

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium installed (Debian package: chromium)")


class DevTools:
    """One headless Chromium and one page of it, driven over the DevTools pipe."""

    def __init__(self, user_data_dir: Path):
        commands_read, self._commands = os.pipe()
        self._replies, replies_write = os.pipe()

        def wire_pipes():
            # Chromium reads commands on fd 3 and writes replies on fd 4; park both ends above 4 first
            # so neither dup2 clobbers the other.
            read_end = fcntl.fcntl(commands_read, fcntl.F_DUPFD, 10)
            write_end = fcntl.fcntl(replies_write, fcntl.F_DUPFD, 10)
            os.dup2(read_end, 3)
            os.dup2(write_end, 4)

        self.process = subprocess.Popen(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-extensions",
             f"--user-data-dir={user_data_dir}", f"--window-size={WINDOW[0]},{WINDOW[1]}",
             "--remote-debugging-pipe", "about:blank"],
            preexec_fn=wire_pipes, close_fds=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(commands_read)
        os.close(replies_write)
        self._buffer = b""
        self._next_id = 0
        self.events: list[dict] = []
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]

    def _message(self, deadline: float) -> dict:
        while b"\0" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([self._replies], [], [], remaining)[0]:
                raise TimeoutError("Chromium did not answer over the DevTools pipe")
            chunk = os.read(self._replies, 1 << 16)
            if not chunk:
                raise ConnectionError("Chromium closed the DevTools pipe")
            self._buffer += chunk
        message, _, self._buffer = self._buffer.partition(b"\0")
        return json.loads(message)

    def call(self, method: str, params: dict | None = None, page: bool = False) -> dict:
        self._next_id += 1
        request = {"id": self._next_id, "method": method, "params": params or {}}
        if page:
            request["sessionId"] = self.session
        os.write(self._commands, json.dumps(request).encode() + b"\0")
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            message = self._message(deadline)
            if message.get("id") == self._next_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message["result"]
            self.events.append(message)

    def wait_for(self, method: str) -> dict:
        deadline = time.monotonic() + TIMEOUT_S
        for event in self.events:
            if event.get("method") == method:
                return event
        while True:
            message = self._message(deadline)
            self.events.append(message)
            if message.get("method") == method:
                return message

    def evaluate(self, expression: str):
        result = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                                "awaitPromise": True}, page=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"page script failed: {result['exceptionDetails']}")
        return result["result"].get("value")

    def close(self):
        try:
            self.call("Browser.close")
        except (RuntimeError, TimeoutError, ConnectionError, OSError):
            pass
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        os.close(self._commands)
        os.close(self._replies)


@pytest.fixture(scope="module")
def loaded_page(tmp_path_factory):
    """The all-pass report (its cost verdict flips when the price doubles) loaded in Chromium."""
    root = tmp_path_factory.mktemp("browser")
    report = render_scenario(root, "all_pass")
    browser = DevTools(root / "chromium-profile")
    try:
        for domain in ("Page", "Runtime", "Log", "Network"):
            browser.call(f"{domain}.enable", page=True)
        browser.call("Emulation.setDeviceMetricsOverride", {"width": WINDOW[0], "height": WINDOW[1],
                                                             "deviceScaleFactor": 1, "mobile": False}, page=True)
        browser.call("Page.navigate", {"url": report["html"].resolve().as_uri()}, page=True)
        browser.wait_for("Page.loadEventFired")
        yield browser, root
    finally:
        browser.close()


def test_page_loads_offline_without_console_errors(loaded_page):
    browser, _ = loaded_page
    errors = [e for e in browser.events
              if e.get("method") == "Runtime.exceptionThrown"
              or (e.get("method") == "Runtime.consoleAPICalled" and e["params"]["type"] in ("error", "assert"))
              or (e.get("method") == "Log.entryAdded" and e["params"]["entry"]["level"] == "error")]
    assert errors == []
    fetched = [e["params"]["request"]["url"] for e in browser.events if e.get("method") == "Network.requestWillBeSent"]
    assert fetched and all(url.startswith(("file:", "data:")) for url in fetched), fetched
    assert browser.evaluate("document.title") == 'Sizing <script>alert("x")</script> & co'
    assert browser.evaluate("document.querySelectorAll('script:not([type])').length") == 1


def test_screenshot_shows_the_rendered_report(loaded_page):
    browser, root = loaded_page
    shot = root / "report.png"
    shot.write_bytes(base64.b64decode(browser.call("Page.captureScreenshot", {"format": "png"}, page=True)["data"]))
    pixels = matplotlib.image.imread(shot)
    assert pixels.shape[:2] == (WINDOW[1], WINDOW[0])
    # a blank or error page is one flat colour; the report has text, a table and shading
    assert float(np.std(pixels[..., :3])) > 0.05
    # nothing wider than the window: every table and figure fits the report's width
    assert browser.evaluate("document.documentElement.scrollWidth") <= WINDOW[0]
    images = browser.evaluate("Array.from(document.images).map(i => i.complete && i.naturalWidth > 0)")
    assert images and all(images)
    assert browser.evaluate("document.querySelectorAll('#cost-chart polyline').length") == 1


def dollars(texts) -> list[float]:
    return [float(re.sub(r"[$,]", "", text)) for text in texts]


def test_price_input_recomputes_costs(loaded_page):
    browser, _ = loaded_page
    read_costs = "Array.from(document.querySelectorAll('.cost')).map(e => e.textContent)"
    before = browser.evaluate(read_costs)
    read_chart = "document.getElementById('cost-chart').textContent"
    chart_before = browser.evaluate(read_chart)
    verdict_before = browser.evaluate("document.querySelector('#verdict-cost td.verdict').textContent.trim()")
    assert verdict_before == "pass"
    browser.evaluate("""(() => {
        const input = document.getElementById('price');
        input.value = String(2 * Number(input.value));
        input.dispatchEvent(new Event('input'));
    })()""")
    after = browser.evaluate(read_costs)
    assert before and after != before
    assert dollars(after) == pytest.approx([2 * x for x in dollars(before)], rel=0.01)
    # the axis rescales with the price, so its labels (and the caption's price) change
    assert browser.evaluate(read_chart) != chart_before
    # the all-pass cost is over half its target, so twice the price misses it
    assert browser.evaluate("document.querySelector('#verdict-cost td.verdict').textContent.trim()") == "fail"


@pytest.mark.parametrize("typed", ["-3", "abc", "", "3abc", "Infinity"])
def test_price_input_refuses_negative_and_non_numeric_input_with_a_message(loaded_page, typed):
    browser, _ = loaded_page
    read_costs = "Array.from(document.querySelectorAll('.cost')).map(e => e.textContent)"
    set_price = """(text) => {
        const input = document.getElementById('price');
        input.value = text;
        input.dispatchEvent(new Event('input'));
    }"""
    browser.evaluate(f"({set_price})('1')")
    before = browser.evaluate(read_costs)
    browser.evaluate(f"({set_price})({typed!r})")
    message = browser.evaluate("document.getElementById('price-message').textContent")
    assert "Enter a price of $0 or more" in message
    assert browser.evaluate("document.getElementById('price').getAttribute('aria-invalid')") == "true"
    # the page keeps showing the last valid price's figures
    assert browser.evaluate(read_costs) == before
    browser.evaluate(f"({set_price})('1')")
    assert browser.evaluate("document.getElementById('price-message').textContent") == ""
