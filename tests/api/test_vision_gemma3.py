"""Gemma 3's vision-language model (tiny, random weights: ``llmq/tools/vision_gemma3.py``)
served through real processes, exact against transformers: greedy tokens through the API equal
``generate`` in float32 on the same images and prompt, for one request and four at once with
different images, a prompt sent again (from the prefix cache, its cached blocks ending inside
the image) and a second turn repeating the image (not encoded again). An image's tokens attend
to each other both ways: the worker prefills in chunks of 24 tokens, each image's 16 kept
whole, and without the two-way mask transformers' own answer differs."""

from __future__ import annotations

import asyncio
import io
import time

import httpx
import pytest
import torch
from PIL import Image

from llmq.common.transport.redis_server import RedisServer
from llmq.tools.model_factory import make_model
from tests.api.api_stack import aclient
from tests.api.test_vision_llava import SHAPES, picture, url
from tests.harness import heartbeat, kill_all, start_api, start_worker, wait_for, wait_worker

pytestmark = pytest.mark.usefixtures("one_torch_thread")
NEW = 6
MODEL = "gemma3"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("gemma3-vl") / "gemma3", arch="gemma3_vl")


@pytest.fixture(scope="module")
def served(model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("gemma3-vl-logs")
    with RedisServer() as server:
        # Chunks of 24 tokens: the first would end inside the image, which starts at 17.
        worker = start_worker(server.url, model_dir, "w-gemma3", logs, wait=False,
                              max_batch_tokens=24)  # fmt: skip
        api, base = start_api(server.url, str(model_dir), logs, "api-gemma3")
        try:
            wait_worker(server.url, "w-gemma3", worker)
            yield server.url, base
        finally:
            kill_all([worker, api])


@pytest.fixture(scope="module")
def reference(model_dir):
    """transformers' greedy tokens (``length``: the prompt's token count; ``causal``: without
    the two-way mask over an image's tokens, as a causal model would attend)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()

    def answer(messages, images, length=False, causal=False):
        text = processor.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        pil = [Image.open(io.BytesIO(d)).convert("RGB") for d in images]
        inputs = processor(images=pil, text=text, return_tensors="pt")
        if length:
            return inputs["input_ids"].shape[1]
        if causal:
            inputs.pop("token_type_ids")
        out = model.generate(
            **inputs, max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        return out[0, inputs["input_ids"].shape[1] :].tolist()

    return answer


def question(image: bytes, text: str = "What is in the picture?") -> list[dict]:
    parts = [
        {"type": "text", "text": text},
        {"type": "image_url", "image_url": {"url": url(image)}},
    ]
    return [{"role": "user", "content": parts}]


def template(text: str = "What is in the picture?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": text}, {"type": "image"}]}]


async def answer(base: str, messages: list[dict]) -> tuple[list[int], str]:
    out = await aclient(base).chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=NEW,
        temperature=0,
        logprobs=True,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )
    choice = out.choices[0]
    ids = [int(t.token.removeprefix("token_id:")) for t in choice.logprobs.content]
    return ids, choice.message.content


def ask(base: str, messages: list[dict]) -> list[int]:
    return asyncio.run(answer(base, messages))[0]


def counters_after(redis_url: str, moment: float) -> tuple[int, int]:
    """(images_encoded, prefix_cache_hit_tokens) of a heartbeat written after ``moment``."""
    beat: dict = {}

    def fresh():
        beat.update(heartbeat(redis_url, "w-gemma3"))
        return float(beat.get("updated", 0)) > moment

    wait_for(fresh, 30, "a fresh heartbeat", 0.05)
    return int(beat["images_encoded"]), int(beat["prefix_cache_hit_tokens"])


def test_one_four_at_once_and_again_from_the_cache_equal_generate(served, reference):
    redis_url, base = served
    images = [picture(s, size) for s, size in enumerate(SHAPES)]
    expected = [reference(template(), [img]) for img in images]
    assert len({tuple(e) for e in expected}) == 4, expected  # the image changes the answer
    assert ask(base, question(images[0])) == expected[0]

    async def at_once():
        return await asyncio.gather(*(answer(base, question(i)) for i in images))

    assert [ids for ids, _ in asyncio.run(at_once())] == expected
    # Sent again: its blocks up to the one the image ends in come from the cache.
    _, hits = counters_after(redis_url, time.time())
    assert ask(base, question(images[1])) == expected[1]
    assert counters_after(redis_url, time.time())[1] - hits >= 32


def test_cached_blocks_ending_inside_the_image_equal_generate(served, reference):
    """A 47-token prompt, its image at 21..36: sent again, the cache holds its first two
    blocks (32 tokens, the image's first 11 among them, computed with the rest of it) and the
    step computes the image's last 5 rows, which attend to each other both ways."""
    redis_url, base = served
    text = "Tell me: what is in the picture?"
    image = picture(7, (30, 60))
    assert reference(template(text), [image], length=True) == 47
    expected = reference(template(text), [image])
    assert ask(base, question(image, text)) == expected
    _, hits = counters_after(redis_url, time.time())
    assert ask(base, question(image, text)) == expected
    assert counters_after(redis_url, time.time())[1] - hits == 32


def test_without_the_two_way_mask_the_answer_differs(served, reference):
    """transformers with an image's tokens attending causally answers otherwise, for an
    image the engine answers exactly: the mask is not a no-op on this model."""
    _, base = served
    image = picture(0, SHAPES[0])
    expected = reference(template(), [image])
    assert reference(template(), [image], causal=True) != expected
    assert ask(base, question(image)) == expected


def test_a_second_turn_reuses_the_image_and_equals_generate(served, reference):
    redis_url, base = served
    image = picture(11, (60, 40))
    encoded, _ = counters_after(redis_url, time.time())
    _, text = asyncio.run(answer(base, question(image)))
    after_first, hits = counters_after(redis_url, time.time())
    assert after_first == encoded + 1
    follow = [*question(image), {"role": "assistant", "content": text}]
    follow.append({"role": "user", "content": "And the colours?"})
    turns = [*template(), {"role": "assistant", "content": text}, follow[-1]]
    assert ask(base, follow) == reference(turns, [image])
    after_second, hits_second = counters_after(redis_url, time.time())
    assert after_second == encoded + 1
    image_end = reference(template(), [image], length=True) - 5  # past the image
    assert hits_second - hits >= image_end - 16  # all but a partial block: from the cache


def test_usage_counts_an_image_as_the_model(served, reference):
    _, base = served
    image = picture(31, (80, 30))
    body = {"model": MODEL, "messages": question(image), "max_tokens": 1}
    r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == reference(template(), [image], length=True)
