"""Open WebUI, pointed at llmq's OpenAI base URL with an API key, sends an uploaded image to a
tiny LLaVA: chromium (Debian's, through playwright) opens a chat, attaches a PNG, sends a
question, and the worker's heartbeat counts the image encoded; the answer appears in the chat.

Open WebUI is about 3 GB in its own venv and takes minutes to install, so the suite does not
install it: this test runs where the venv exists and is skipped elsewhere.

    python3.11 -m venv ~/.cache/llmq-peers/open-webui/venv
    echo torch==2.13.0 > /tmp/c.txt   # the CPU wheel, not the CUDA one open-webui would pull
    ~/.cache/llmq-peers/open-webui/venv/bin/pip install -c /tmp/c.txt open-webui
    .venv/bin/python -m pytest -q tests/tools/test_open_webui.py

``PEER_VENVS`` moves ``~/.cache/llmq-peers`` as it does for the other peers.
"""

from __future__ import annotations

import io
import os
import shutil
from pathlib import Path

import httpx
import pytest
import torch
from PIL import Image

from llmq.common.transport.redis_server import free_port
from tests.api.api_stack import stack
from tests.harness import Proc, wait_for

PEERS = Path(os.environ.get("PEER_VENVS") or Path.home() / ".cache/llmq-peers")
OPEN_WEBUI = PEERS / "open-webui/venv/bin/open-webui"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
KEY = "sk-open-webui-test"

pytestmark = pytest.mark.skipif(
    not OPEN_WEBUI.exists() or CHROMIUM is None,
    reason=f"needs Open WebUI at {OPEN_WEBUI} and chromium on PATH",
)


@pytest.fixture(scope="module")
def llava(model_dir, tmp_path_factory):
    """A Redis, a worker of the tiny LLaVA, and an API that requires KEY."""
    logs = tmp_path_factory.mktemp("open-webui-llmq")
    with stack(model_dir("llava"), logs, "w-open-webui", {}, {"api_key": KEY}) as s:
        yield s


@pytest.fixture(scope="module")
def open_webui(llava, tmp_path_factory):
    """Open WebUI's base URL: one user, no login, llmq its only connection; the chat's side
    requests (titles, tags, follow-ups) and retrieval off, so that the one request is the
    question."""
    data = tmp_path_factory.mktemp("open-webui")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMQ_")}
    env.update(
        DATA_DIR=str(data),
        WEBUI_AUTH="False",
        WEBUI_SECRET_KEY="open-webui-test",
        OFFLINE_MODE="True",
        HF_HUB_OFFLINE="1",
        ENABLE_OLLAMA_API="False",
        OPENAI_API_BASE_URL=llava.base + "/v1",
        OPENAI_API_KEY=KEY,
        DEFAULT_MODELS=llava.model,
        RAG_EMBEDDING_ENGINE="openai",
        BYPASS_EMBEDDING_AND_RETRIEVAL="True",
        ENABLE_TITLE_GENERATION="False",
        ENABLE_TAGS_GENERATION="False",
        ENABLE_FOLLOW_UP_GENERATION="False",
        ENABLE_RETRIEVAL_QUERY_GENERATION="False",
        ENABLE_VERSION_UPDATE_CHECK="False",
    )
    cmd = [str(OPEN_WEBUI), "serve", "--host", "127.0.0.1", "--port", str(port)]
    proc = Proc(cmd, env, data / "open-webui.log")
    base = f"http://127.0.0.1:{port}"

    def healthy():
        if not proc.alive():
            raise RuntimeError(f"open-webui exited:\n{proc.log()}")
        try:
            return httpx.get(base + "/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(healthy, 300, "open-webui", 0.5)
        yield base
    finally:
        proc.terminate()


def png() -> bytes:
    g = torch.Generator().manual_seed(3)
    pixels = torch.randint(0, 256, (50, 40, 3), generator=g, dtype=torch.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels.numpy()).save(out, "PNG")
    return out.getvalue()


def test_open_webui_sends_an_uploaded_image(llava, open_webui, tmp_path):
    from playwright.sync_api import sync_playwright

    before = int(llava.heartbeat().get("images_encoded", 0))
    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=["--no-sandbox", "--disable-gpu"]
        )
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto(open_webui + "/", timeout=120000)
            page.locator("#chat-input").wait_for(timeout=120000)
            dismiss_dialogs(page)
            page.locator("input[type=file][multiple]").first.set_input_files(
                files=[{"name": "dots.png", "mimeType": "image/png", "buffer": png()}]
            )
            # The image is uploaded to Open WebUI's files and shown above the input.
            page.locator("img[src*='/api/v1/files/']").first.wait_for(timeout=60000)
            page.locator("#chat-input").click()
            page.keyboard.type("What is in the picture?")
            page.locator("#send-message-button").click()
            wait_for(lambda: encoded(llava) > before, 120, "the image encoded by the worker")
            # llmq's answer streams into the chat (noise: random weights).
            page.wait_for_function(
                "document.querySelector('.chat-assistant')?.innerText.trim().length > 0",
                timeout=120000,
            )
            page.screenshot(path=str(tmp_path / "open-webui.png"), full_page=True)
        finally:
            browser.close()
    assert encoded(llava) == before + 1


def encoded(llava) -> int:
    return int(llava.heartbeat().get("images_encoded", 0))


def dismiss_dialogs(page) -> None:
    """Close the release notes Open WebUI shows a new user, if it does."""
    for name in ("Okay, Let's Go!", "Close"):
        button = page.get_by_role("button", name=name)
        if button.count():
            button.first.click()
