"""The HTML report in a real browser: it loads offline without console errors, renders, and the price
input recomputes the costs shown.

Playwright drives the system's Chromium (the Debian package, as `executable_path`; Playwright's own
browser download is never used), headless, typing into the page as a user does.
"""
from __future__ import annotations

import re
import shutil

import matplotlib.image
import numpy as np
import pytest

from test_report import render_scenario

playwright_api = pytest.importorskip("playwright.sync_api", reason="Playwright is in requirements-dev.txt")

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
TIMEOUT_MS = 60_000
WINDOW = (1100, 1400)

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium installed (Debian package: chromium)")


class LoadedPage:
    """The report open in one Chromium page, with what the page logged and fetched while loading."""

    def __init__(self, page):
        self.page = page
        self.errors: list[str] = []
        self.fetched: list[str] = []
        page.on("console", lambda message: self.errors.append(f"console {message.type}: {message.text}")
                if message.type in ("error", "assert") else None)
        page.on("pageerror", lambda error: self.errors.append(f"page error: {error}"))
        page.on("requestfailed", lambda request: self.errors.append(f"request failed: {request.url}"))
        page.on("request", lambda request: self.fetched.append(request.url))

    def evaluate(self, expression: str):
        return self.page.evaluate(expression)


@pytest.fixture(scope="module")
def chromium():
    """One headless Chromium for the module's pages (Playwright's sync API allows one instance at a time)."""
    with playwright_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True,
                                             args=["--no-sandbox", "--disable-gpu"])
        try:
            yield browser
        finally:
            browser.close()


def open_page(browser, html):
    page = browser.new_page(viewport={"width": WINDOW[0], "height": WINDOW[1]}, device_scale_factor=1)
    page.set_default_timeout(TIMEOUT_MS)
    loaded = LoadedPage(page)
    page.goto(html.resolve().as_uri(), wait_until="load")
    return loaded


@pytest.fixture(scope="module")
def loaded_page(chromium, tmp_path_factory):
    """The all-pass report (its cost verdict flips when the price doubles) loaded in Chromium."""
    root = tmp_path_factory.mktemp("browser")
    report = render_scenario(root, "all_pass")
    yield open_page(chromium, report["html"]), root


def test_page_loads_offline_without_console_errors(loaded_page):
    browser, _ = loaded_page
    assert browser.errors == []
    fetched = browser.fetched
    assert fetched and all(url.startswith(("file:", "data:")) for url in fetched), fetched
    assert browser.evaluate("document.title") == 'Sizing <script>alert("x")</script> & co'
    assert browser.evaluate("document.querySelectorAll('script:not([type])').length") == 1


def test_screenshot_shows_the_rendered_report(loaded_page):
    browser, root = loaded_page
    shot = root / "report.png"
    browser.page.screenshot(path=str(shot))
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
    price = browser.page.locator("#price")
    price.fill(str(2 * float(price.input_value())))
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
    price = browser.page.locator("#price")
    price.fill("1")
    before = browser.evaluate(read_costs)
    price.fill(typed)
    message = browser.evaluate("document.getElementById('price-message').textContent")
    assert "Enter a price of $0 or more" in message
    assert browser.evaluate("document.getElementById('price').getAttribute('aria-invalid')") == "true"
    # the page keeps showing the last valid price's figures
    assert browser.evaluate(read_costs) == before
    price.fill("1")
    assert browser.evaluate("document.getElementById('price-message').textContent") == ""


def test_the_cost_chart_marks_the_decisions_pick_at_its_own_machines_price(chromium, tmp_path):
    from test_report import render_with_decision

    render_with_decision(tmp_path)
    page = open_page(chromium, tmp_path / "report" / "report.html")
    read_mark = ("Array.from(document.querySelectorAll('#cost-chart text'))"
                 ".map(e => e.textContent).filter(t => t.startsWith('pick: '))")
    before = page.evaluate(read_mark)
    assert len(before) == 1 and before[0].startswith("pick: 1 × NVIDIA T4 GPU, continuous batching cap 2 at $")
    assert page.evaluate("document.querySelectorAll('#cost-chart circle[fill=\"#009E73\"]').length") == 1
    # the pick is another machine's, priced at its own machine-hour: this machine's price leaves it be
    price = page.page.locator("#price")
    price.fill(str(2 * float(price.input_value())))
    assert page.evaluate(read_mark) == before
    assert page.errors == []
