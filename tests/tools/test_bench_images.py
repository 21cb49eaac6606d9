"""`llmq bench --images N`: each chat request carries N PNGs of random pixels after its
prompt, its own (drawn from the prompt), the same in every run; none by default."""

from __future__ import annotations

import base64
import io

import pytest
from PIL import Image

from llmq.tools.bench_load import RequestShape

pytestmark = pytest.mark.unit


def _images(body: dict) -> list[Image.Image]:
    parts = body["messages"][0]["content"]
    assert parts[0] == {"type": "text", "text": "a prompt"} or parts[0]["type"] == "text"
    urls = [p["image_url"]["url"] for p in parts[1:]]
    return [Image.open(io.BytesIO(base64.b64decode(u.split(",", 1)[1]))) for u in urls]


def test_each_request_carries_its_own_images():
    shape = RequestShape("m", "chat", 0.0, images=2, image_size=(32, 24))
    first = _images(shape.body("a prompt", 4, False))
    assert [i.size for i in first] == [(32, 24)] * 2 and first[0].tobytes() != first[1].tobytes()
    again = _images(shape.body("a prompt", 4, False))
    assert [i.tobytes() for i in again] == [i.tobytes() for i in first]
    other = _images(shape.body("another prompt", 4, False))
    assert other[0].tobytes() != first[0].tobytes()
    plain = RequestShape("m", "chat", 0.0).body("a prompt", 4, False)
    assert plain["messages"] == [{"role": "user", "content": "a prompt"}]
