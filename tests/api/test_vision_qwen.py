"""Qwen2.5-VL (tiny, random weights: ``llmq/tools/vision_qwen.py``) served through real
processes, exact against transformers: greedy tokens through the API equal the model's float32
``generate`` on the same images and prompt, for images of different grids (so different
M-RoPE positions and shifts after them), one request and four at once (prefilled in chunks
cut inside images, in a cache too small for all four: some are preempted and computed again),
the four again (some of their image blocks found in the prefix cache), and a second turn that finds the image's blocks in the prefix cache (the image not encoded
again), all on llmq's own forward and fused C++ step. One Redis, one worker, one API."""

from __future__ import annotations

import asyncio
import io
import time

import pytest
import torch
from PIL import Image

from llmq.common.transport.redis_server import RedisServer
from llmq.tools.model_factory import make_model
from tests.api.vision_client import (
    NEW,
    SHAPES,
    answer,
    ask,
    counters_after,
    picture,
    question,
    second_turn_reuses_the_image,
    template,
)
from tests.harness import heartbeat, kill_all, start_api, start_worker, wait_worker

pytestmark = pytest.mark.usefixtures("one_torch_thread")
MODEL, WORKER = "qwen2_5_vl", "w-qwen"
# SHAPES (width, height): grids of 6 x 5, 4 x 10, 6 x 6 and 9 x 2 image tokens.
# Chunks of 24 tokens (cut inside images); 6 blocks of 16 tokens: the four prompts (50 to 80
# tokens) cannot all be held at once.
SETTINGS = {"max_batch_tokens": 24, "kv_blocks": 6}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("qwen-vl") / "qwen2_5_vl", arch="qwen2_5_vl")


@pytest.fixture(scope="module")
def served(model, tmp_path_factory):
    logs = tmp_path_factory.mktemp("qwen-vl-logs")
    with RedisServer() as server:
        worker = start_worker(server.url, model, WORKER, logs, wait=False, **SETTINGS)
        api, base = start_api(server.url, str(model), logs, "api-qwen-vl")
        try:
            wait_worker(server.url, WORKER, worker)
            yield server.url, base
        finally:
            kill_all([worker, api])


class Reference:
    """transformers' Qwen2.5-VL in float32: the image pad token repeated as its processor
    repeats it, then ``generate``."""

    def __init__(self, path):
        from transformers import (
            AutoImageProcessor,
            AutoTokenizer,
            Qwen2_5_VLForConditionalGeneration,
        )

        self.images = AutoImageProcessor.from_pretrained(path)
        self.tok = AutoTokenizer.from_pretrained(path)
        self.model = Qwen2_5_VLForConditionalGeneration.from_pretrained(
            path, dtype=torch.float32
        ).eval()

    def inputs(self, messages: list[dict], images: list[bytes]) -> dict:
        text = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        pil = [Image.open(io.BytesIO(d)).convert("RGB") for d in images]
        pixels = self.images(pil, return_tensors="pt")
        merge = self.images.merge_size**2
        pieces = text.split("<|image_pad|>")
        counts = [int(g.prod()) // merge for g in pixels["image_grid_thw"]]
        runs = zip(counts, pieces[1:], strict=True)
        text = pieces[0] + "".join("<|image_pad|>" * n + p for n, p in runs)
        ids = self.tok(text, return_tensors="pt")["input_ids"]
        mm = (ids == self.model.config.image_token_id).int()
        return {"input_ids": ids, "mm_token_type_ids": mm, **pixels}

    def answer(self, messages: list[dict], images: list[bytes]) -> list[int]:
        inputs = self.inputs(messages, images)
        with torch.inference_mode():
            out = self.model.generate(
                **inputs, max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0
            )
        return out[0, inputs["input_ids"].shape[1] :].tolist()


@pytest.fixture(scope="module")
def reference(model):
    return Reference(model)


def _preemptions(redis_url: str) -> int:
    return int(heartbeat(redis_url, WORKER).get("preemptions_total", 0))


def test_one_and_four_at_once_equal_generate(served, reference):
    redis_url, base = served
    images = [picture(s, size) for s, size in enumerate(SHAPES)]
    expected = [reference.answer(template(), [img]) for img in images]
    assert len({tuple(e) for e in expected}) == 4, expected  # the image changes the answer
    assert ask(base, MODEL, question(images[0])) == expected[0]
    before = _preemptions(redis_url)

    async def at_once():
        return await asyncio.gather(*(answer(base, MODEL, question(i)) for i in images))

    # Whether the four meet in the engine depends on when each reaches the worker: send them
    # again (each round exact) until a round pressed the cache into a preemption.
    for _ in range(8):
        assert [ids for ids, _ in asyncio.run(at_once())] == expected
        _, hits = counters_after(redis_url, WORKER, time.time())
        if _preemptions(redis_url) > before:
            break
    assert _preemptions(redis_url) > before  # some were computed again
    assert [ids for ids, _ in asyncio.run(at_once())] == expected  # again: blocks from the cache
    _, hits_again = counters_after(redis_url, WORKER, time.time())
    assert hits_again > hits


def test_a_request_without_images_equals_generate(served, reference):
    """Text alone, beside nothing: every row's three positions are its index."""
    _, base = served
    messages = [{"role": "user", "content": "Name three colours."}]
    ids = reference.tok.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    with torch.inference_mode():
        out = reference.model.generate(
            input_ids=ids, max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    assert ask(base, MODEL, messages) == out[0, ids.shape[1] :].tolist()


def test_the_text_model_runs_on_llmqs_forward(served):
    """The worker's plan: llmq's forward and its fused C++ step (each row's M-RoPE cos and sin
    built from its three positions), not transformers' forward."""
    redis_url, _ = served
    plan = heartbeat(redis_url, WORKER)["forward_plan"]
    assert plan.startswith("llmq forward") and "fused C++ step" in plan, plan


def test_plain_positions_would_give_other_tokens(reference):
    """The exactness test above can fail for positions: the same model with every token's
    three positions equal to its index answers otherwise."""
    inputs = reference.inputs(template(), [picture(0, SHAPES[1])])
    ids = inputs["input_ids"]
    plain = torch.arange(ids.shape[1])[None]
    with torch.inference_mode():
        mrope = reference.model(**inputs).logits[0]
        flat = reference.model(**inputs, position_ids=plain).logits[0]
    image_end = int(torch.nonzero(inputs["mm_token_type_ids"][0])[-1]) + 1
    changed = (mrope.argmax(-1) != flat.argmax(-1))[image_end:]
    assert changed.any()


def test_a_second_turn_reuses_the_image_and_equals_generate(served, reference):
    redis_url, base = served
    image = picture(11, (48, 32))
    image_end = reference.inputs(template(), [image])["input_ids"].shape[1] - 6
    second_turn_reuses_the_image(redis_url, base, MODEL, WORKER, image, reference.answer, image_end)
