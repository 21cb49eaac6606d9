"""The playground page at `/`, driven in headless Chromium (Debian's chromium through the
playwright package's driver; no browser download): pick the model, type a prompt, watch the
streamed answer arrive, read the measured time to first token and tokens/s, save a screenshot.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import httpx
import pytest

PROMPT = "Tell me about queues"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")

# Under CI (`make test` with CI=true installs chromium first) a missing browser is a failure,
# not a skip: the page is checked in a real browser every run.
pytestmark = pytest.mark.skipif(
    CHROMIUM is None and not os.environ.get("CI"),
    reason="no chromium on PATH (apt-get install chromium: `make browser`)",
)


@pytest.fixture(scope="module")
def served(main):
    """The base URL of the package's shared stack of the test model."""
    return main.base


def test_playground_streams_a_chat_in_chromium(served, tmp_path):
    shot = Path(tmp_path) / "playground.png"
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=["--no-sandbox", "--disable-gpu"]
        )
        try:
            page = browser.new_page(viewport={"width": 1000, "height": 760})
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(served + "/")
            # The model picker fills itself from /v1/models.
            page.wait_for_function(
                "document.querySelector('#model').options.length > 0", timeout=15000
            )
            model = page.locator("#model").input_value()
            page.fill("#temperature", "0")
            page.fill("#max_tokens", "24")
            page.fill("#prompt", PROMPT)
            page.click("#send")
            page.locator("#last-stats").wait_for(timeout=30000)
            text = page.locator("#last-stats").inner_text()
            # The reply is the assistant bubble's text, before the stats line appended to it.
            answer = page.evaluate(
                "document.querySelector('#last-stats').parentNode.firstChild.textContent"
            )
            page.screenshot(path=str(shot), full_page=True)
        finally:
            browser.close()
    assert not errors, errors
    match = re.search(r"time to first token ([\d.]+) s · ([\d.]+) tokens/s · (\d+) tokens", text)
    assert match, text
    ttft, rate, tokens = float(match[1]), float(match[2]), int(match[3])
    assert 0 < ttft < 10 and 0 < tokens <= 24
    # What the page streamed is exactly the greedy answer the API gives without streaming.
    body = {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "temperature": 0,
        "max_tokens": 24,
    }
    expected = httpx.post(served + "/v1/chat/completions", json=body, timeout=60).json()
    assert expected["usage"]["completion_tokens"] == tokens
    assert tokens == 1 or rate > 0
    assert answer == expected["choices"][0]["message"]["content"]
    assert shot.stat().st_size > 10_000
