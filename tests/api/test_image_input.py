"""Image parts through every surface against real processes (a Redis, `llmq worker` of the
text test model, `llmq api`): each bad image is a 400 in that API's shape naming the problem,
with nothing queued for a worker and nothing fetched; a good image on a text model is a 400
naming the model."""

from __future__ import annotations

import base64

import anthropic
import httpx
import ollama
import openai
import pytest

from tests.api.api_stack import client
from tests.common.test_images import data_url, image_host, png, png_header

BAD = {
    "truncated": (data_url(png()[:-30]), "does not decode"),
    "20000x20000": (data_url(png_header(20_000, 20_000)), "400000000 pixels"),
    "metadata": ("http://169.254.169.254/latest/meta-data/", "169.254.169.254.*not fetched"),
}


def _image_message(url: str, images: int = 1) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": url}}] * images
    return [{"role": "user", "content": [{"type": "text", "text": "What is it?"}, *parts]}]


@pytest.fixture
def untouched(main):
    """Asserts after the test that no request reached the model's stream."""
    r = main.redis()
    before = r.xlen(main.stream) if r.exists(main.stream) else 0
    yield
    assert (r.xlen(main.stream) if r.exists(main.stream) else 0) == before


@pytest.mark.parametrize("case", sorted(BAD))
def test_openai_bad_images_are_400s_naming_the_problem(main, untouched, case):
    url, says = BAD[case]
    with pytest.raises(openai.BadRequestError, match=says) as bad:
        client(main.base).chat.completions.create(
            model=main.model, messages=_image_message(url), max_tokens=2
        )
    assert bad.value.body["param"] == "messages[0].content[1].image_url"


def test_fifty_images_and_a_loopback_link_are_refused_unfetched(main, untouched):
    c = client(main.base)
    with pytest.raises(openai.BadRequestError, match="50 images; at most 16"):
        c.chat.completions.create(
            model=main.model, messages=_image_message(data_url(png()), 50), max_tokens=2
        )
    with image_host({"/a.png": (200, {}, png())}) as (base, hits):
        with pytest.raises(openai.BadRequestError, match="127.0.0.1.*not fetched"):
            c.chat.completions.create(
                model=main.model, messages=_image_message(f"{base}/a.png"), max_tokens=2
            )
        assert hits == []


def test_every_surface_names_the_text_model(main, untouched):
    """A good image reaches the model check: a text model refuses it by name, in each API's
    own error shape."""
    says = f"{main.model!r} is a text model"
    b64 = base64.b64encode(png()).decode()
    with pytest.raises(openai.BadRequestError, match=says):
        client(main.base).chat.completions.create(
            model=main.model, messages=_image_message(data_url(png())), max_tokens=2
        )
    with pytest.raises(openai.BadRequestError, match=says):
        client(main.base).responses.create(
            model=main.model,
            input=[{"role": "user", "content": [{"type": "input_image", "image_url": data_url(png())}]}],
        )  # fmt: skip
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64}}
    with pytest.raises(anthropic.BadRequestError, match=says) as bad:
        anthropic.Anthropic(base_url=main.base, api_key="x", max_retries=0).messages.create(
            model=main.model, max_tokens=2, messages=[{"role": "user", "content": [image]}]
        )
    assert bad.value.body["type"] == "error"
    with pytest.raises(ollama.ResponseError, match=says) as bad:
        ollama.Client(host=main.base).chat(
            model=main.model, messages=[{"role": "user", "content": "hi", "images": [png()]}]
        )
    assert bad.value.status_code == 400
    r = httpx.post(
        f"{main.base}/api/generate",
        json={"model": main.model, "prompt": "hi", "images": [b64[:-40]], "stream": False},
    )
    assert r.status_code == 400 and "does not decode" in r.json()["error"]
