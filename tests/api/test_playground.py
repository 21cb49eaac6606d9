"""The playground page at `/`, driven in headless Chromium (Debian's chromium through the
playwright package's driver; no browser download): pick the model, type a prompt, watch the
streamed answer arrive, read the measured time to first token and tokens/s, save a screenshot.
On a tiny LLaVA (a stack of its own): attach a PNG, see its thumbnail, get the API's greedy
answer for the same image and prompt; attach a broken one, see the API's 400 as the error.
"""

from __future__ import annotations

import base64
import io
import os
import re
import shutil
from pathlib import Path

import httpx
import pytest
import torch
from PIL import Image

from tests.api.api_stack import client, stack
from tests.harness import wait_for

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


@pytest.fixture(scope="module")
def llava(model_dir, tmp_path_factory):
    """A Redis, a worker of the tiny LLaVA and an API."""
    logs = tmp_path_factory.mktemp("playground-llava")
    with stack(model_dir("llava"), logs, "w-playground-llava", {}, {}) as s:
        yield s


def launch(pw):
    return pw.chromium.launch(
        executable_path=CHROMIUM, headless=True, args=["--no-sandbox", "--disable-gpu"]
    )


def open_page(browser, base: str, errors: list[str]):
    """The playground of ``base`` once its model picker has filled itself from /v1/models."""
    page = browser.new_page(viewport={"width": 1000, "height": 760})
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(base + "/")
    page.wait_for_function("document.querySelector('#model').options.length > 0", timeout=15000)
    return page


def test_playground_streams_a_chat_in_chromium(served, tmp_path):
    shot = Path(tmp_path) / "playground.png"
    with sync_api.sync_playwright() as pw:
        browser = launch(pw)
        errors: list[str] = []
        try:
            page = open_page(browser, served, errors)
            model = page.locator("#model").input_value()
            attach_shown = page.locator("#attach").is_visible()  # a text model: no images
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
    assert not attach_shown
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


def png(seed: int, size: tuple[int, int] = (40, 50)) -> bytes:
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels.numpy()).save(out, "PNG")
    return out.getvalue()


def ask(page, prompt: str, image: dict) -> None:
    """Attach ``image`` (playwright's file payload), wait for its thumbnail, send ``prompt``."""
    page.set_input_files("#file", files=[image])
    page.locator("#pending img").wait_for(state="attached", timeout=5000)
    page.fill("#prompt", prompt)
    page.click("#send")


def test_playground_sends_an_image_in_chromium(llava, tmp_path):
    shot = Path(tmp_path) / "playground-image.png"
    picture, broken = png(7), b"\x89PNG\r\n\x1a\n not the rest of a PNG"
    with sync_api.sync_playwright() as pw:
        browser = launch(pw)
        errors: list[str] = []
        try:
            page = open_page(browser, llava.base, errors)
            model = page.locator("#model").input_value()
            assert page.locator("#attach").is_visible()  # the heartbeat says it takes images
            page.fill("#temperature", "0")
            page.fill("#max_tokens", "8")
            ask(page, PROMPT, {"name": "dots.png", "mimeType": "image/png", "buffer": picture})
            page.locator("#last-stats").wait_for(timeout=60000)
            answer = page.evaluate(
                "document.querySelector('#last-stats').parentNode.firstChild.textContent"
            )
            # The conversation shows the image sent, decoded by the browser at its own size.
            shown = page.evaluate("document.querySelector('.user img.thumb').naturalWidth")
            # The heartbeat that counts the encoding may follow the answer.
            wait_for(lambda: int(llava.heartbeat()["images_encoded"]) > 0, 30, "an encoding")
            encoded = int(llava.heartbeat()["images_encoded"])
            ask(page, PROMPT, {"name": "broken.png", "mimeType": "image/png", "buffer": broken})
            page.locator(".msg.error").wait_for(timeout=30000)
            error = page.locator(".msg.error").inner_text()
            page.screenshot(path=str(shot), full_page=True)
        finally:
            browser.close()
    assert not errors, errors
    assert shown == 40 and encoded == 1  # the image reached the model
    assert shot.stat().st_size > 10_000

    def content(data: bytes) -> list[dict]:
        url = "data:image/png;base64," + base64.b64encode(data).decode()
        return [{"type": "text", "text": PROMPT}, {"type": "image_url", "image_url": {"url": url}}]

    expected = client(llava.base).chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": content(picture)}],
        temperature=0,
        max_tokens=8,
    )
    assert expected.usage.prompt_tokens > 25  # the image's 25 tokens counted
    assert answer == expected.choices[0].message.content
    # The playground shows the API's 400 for the broken image (in the conversation's second
    # turn) as it is.
    turns = [
        {"role": "user", "content": content(picture)},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": content(broken)},
    ]
    body = {"model": model, "messages": turns}
    refused = httpx.post(llava.base + "/v1/chat/completions", json=body, timeout=60)
    assert refused.status_code == 400
    assert error == "Error: " + refused.json()["error"]["message"]
