"""Gemma 3's vision-language model (tiny, random weights: ``llmq/tools/vision_gemma3.py``)
served through real processes, exact against transformers: greedy tokens through the API equal
``generate`` in float32 on the same images and prompt, for one request and four at once with
different images, a prompt sent again (from the prefix cache, its cached blocks ending inside
the image) and a second turn repeating the image (not encoded again). An image's tokens attend
to each other both ways: the worker prefills in chunks of 24 tokens, each image's 16 kept
whole, and without the two-way mask transformers' own answer differs."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from llmq.common.transport.redis_server import RedisServer
from llmq.tools.model_factory import make_model
from tests.api.vision_client import (
    SHAPES,
    answer,
    ask,
    counters_after,
    picture,
    processor_reference,
    question,
    second_turn_reuses_the_image,
    template,
)
from tests.harness import kill_all, start_api, start_worker, wait_worker

pytestmark = pytest.mark.usefixtures("one_torch_thread")
MODEL, WORKER = "gemma3", "w-gemma3"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("gemma3-vl") / "gemma3", arch="gemma3_vl")


@pytest.fixture(scope="module")
def served(model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("gemma3-vl-logs")
    with RedisServer() as server:
        # Chunks of 24 tokens: the first would end inside the image, which starts at 17.
        worker = start_worker(server.url, model_dir, WORKER, logs, wait=False,
                              max_batch_tokens=24)  # fmt: skip
        api, base = start_api(server.url, str(model_dir), logs, "api-gemma3")
        try:
            wait_worker(server.url, WORKER, worker)
            yield server.url, base
        finally:
            kill_all([worker, api])


@pytest.fixture(scope="module")
def reference(model_dir):
    """transformers' greedy tokens (``length``: the prompt's token count; ``causal``: without
    the two-way mask over an image's tokens, as a causal model would attend)."""
    return processor_reference(model_dir)


def test_one_four_at_once_and_again_from_the_cache_equal_generate(served, reference):
    redis_url, base = served
    images = [picture(s, size) for s, size in enumerate(SHAPES)]
    expected = [reference(template(), [img]) for img in images]
    assert len({tuple(e) for e in expected}) == 4, expected  # the image changes the answer
    assert ask(base, MODEL, question(images[0])) == expected[0]

    async def at_once():
        return await asyncio.gather(*(answer(base, MODEL, question(i)) for i in images))

    assert [ids for ids, _ in asyncio.run(at_once())] == expected
    # Sent again: its blocks up to the one the image ends in come from the cache.
    _, hits = counters_after(redis_url, WORKER, time.time())
    assert ask(base, MODEL, question(images[1])) == expected[1]
    assert counters_after(redis_url, WORKER, time.time())[1] - hits >= 32


def test_cached_blocks_ending_inside_the_image_equal_generate(served, reference):
    """A 47-token prompt, its image at 21..36: sent again, the cache holds its first two
    blocks (32 tokens, the image's first 11 among them, computed with the rest of it) and the
    step computes the image's last 5 rows, which attend to each other both ways."""
    redis_url, base = served
    text = "Tell me: what is in the picture?"
    image = picture(7, (30, 60))
    assert reference(template(text), [image], length=True) == 47
    expected = reference(template(text), [image])
    assert ask(base, MODEL, question(image, text)) == expected
    _, hits = counters_after(redis_url, WORKER, time.time())
    assert ask(base, MODEL, question(image, text)) == expected
    assert counters_after(redis_url, WORKER, time.time())[1] - hits == 32


def test_without_the_two_way_mask_the_answer_differs(served, reference):
    """transformers with an image's tokens attending causally answers otherwise, for an
    image the engine answers exactly: the mask is not a no-op on this model."""
    _, base = served
    image = picture(0, SHAPES[0])
    expected = reference(template(), [image])
    assert reference(template(), [image], causal=True) != expected
    assert ask(base, MODEL, question(image)) == expected


def test_a_second_turn_reuses_the_image_and_equals_generate(served, reference):
    redis_url, base = served
    image = picture(11, (60, 40))
    image_end = reference(template(), [image], length=True) - 5  # past the image
    second_turn_reuses_the_image(redis_url, base, MODEL, WORKER, image, reference, image_end)


def test_usage_counts_an_image_as_the_model(served, reference):
    _, base = served
    image = picture(31, (80, 30))
    body = {"model": MODEL, "messages": question(image), "max_tokens": 1}
    r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == reference(template(), [image], length=True)
