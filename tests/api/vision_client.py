"""What the vision-language API tests send and read back: random-colour images as data URLs,
a question about one, the served model's greedy token ids, the worker's image and prefix-cache
counters from a fresh heartbeat, and transformers' answer through a model's processor."""

from __future__ import annotations

import asyncio
import base64
import io
import time

import torch
from PIL import Image

from tests.api.api_stack import aclient
from tests.harness import heartbeat, wait_for

NEW = 6  # tokens an answer is long
# (width, height) of four images: different grids of image tokens in every family.
SHAPES = [(40, 50), (80, 30), (50, 50), (20, 70)]
QUESTION = "What is in the picture?"


def picture(seed: int, size: tuple[int, int] = (40, 50)) -> bytes:
    """A PNG of random colours."""
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels.numpy()).save(out, "PNG")
    return out.getvalue()


def url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def question(image: bytes, text: str = QUESTION) -> list[dict]:
    """A user turn asking ``text`` about ``image``, as the API receives it."""
    parts = [
        {"type": "text", "text": text},
        {"type": "image_url", "image_url": {"url": url(image)}},
    ]
    return [{"role": "user", "content": parts}]


def template(text: str = QUESTION) -> list[dict]:
    """The same turn as a chat template takes it (the image a placeholder)."""
    return [{"role": "user", "content": [{"type": "text", "text": text}, {"type": "image"}]}]


async def answer(base: str, model: str, messages: list[dict]) -> tuple[list[int], str]:
    """The greedy token ids and text of the served model's answer."""
    out = await aclient(base).chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=NEW,
        temperature=0,
        logprobs=True,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )
    choice = out.choices[0]
    ids = [int(t.token.removeprefix("token_id:")) for t in choice.logprobs.content]
    return ids, choice.message.content


def ask(base: str, model: str, messages: list[dict]) -> list[int]:
    return asyncio.run(answer(base, model, messages))[0]


def counters_after(redis_url: str, worker: str, moment: float) -> tuple[int, int]:
    """The worker's (images_encoded, prefix_cache_hit_tokens) in a heartbeat written after
    ``moment``."""
    beat: dict = {}

    def fresh():
        beat.update(heartbeat(redis_url, worker))
        return float(beat.get("updated", 0)) > moment

    wait_for(fresh, 30, "a fresh heartbeat", 0.05)
    return int(beat["images_encoded"]), int(beat["prefix_cache_hit_tokens"])


def processor_reference(path):
    """transformers' answer for a folder its processor reads: ``answer(messages, images)``,
    the greedy tokens in float32 (``length``: the prompt's token count instead; ``causal``:
    without the ``token_type_ids`` that give an image's tokens a two-way mask)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()

    def answer(messages: list[dict], images: list[bytes], length=False, causal=False):
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


def second_turn_reuses_the_image(redis_url, base, model, worker, image, generate, image_end):
    """Ask about ``image``, then follow up with the answer and another question: the image is
    encoded once, the second turn's tokens equal ``generate(turns, [image])``, and all of
    its prompt up to ``image_end`` (past the image) but a partial block comes from the
    prefix cache."""
    encoded, _ = counters_after(redis_url, worker, time.time())
    _, text = asyncio.run(answer(base, model, question(image)))
    after_first, hits = counters_after(redis_url, worker, time.time())
    assert after_first == encoded + 1
    follow = [*question(image), {"role": "assistant", "content": text}]
    follow.append({"role": "user", "content": "And the colours?"})
    turns = [*template(), {"role": "assistant", "content": text}, follow[-1]]
    assert ask(base, model, follow) == generate(turns, [image])
    after_second, hits_second = counters_after(redis_url, worker, time.time())
    assert after_second == encoded + 1
    assert hits_second - hits >= image_end - 16  # all but a partial block: from the cache
