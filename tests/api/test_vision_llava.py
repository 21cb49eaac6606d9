"""A LLaVA-1.5 (tiny, random weights: ``llmq/tools/vision_models.py``) served through real
processes, exact against transformers: greedy tokens through the API equal
LlavaForConditionalGeneration.generate in float32 on the same image and prompt, for one
request, four at once with different images, a second turn repeating the image (encoded once:
the heartbeat's counter), and through the openai, anthropic and ollama packages."""

from __future__ import annotations

import asyncio
import base64
import io
import time

import anthropic
import ollama
import pytest
import torch
from PIL import Image

from llmq.common.transport.redis_server import RedisServer
from llmq.tools.model_factory import SHAPES, train_tokenizer
from llmq.tools.vision_models import make_llava
from tests.api.api_stack import aclient, client
from tests.harness import heartbeat, kill_all, start_api, start_worker, wait_for, wait_worker

pytestmark = pytest.mark.usefixtures("one_torch_thread")
NEW = 6


def picture(seed: int) -> bytes:
    """A 40 x 50 PNG of random colours (resized and cropped by the processor)."""
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (50, 40, 3), generator=g, dtype=torch.uint8).numpy()
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


def url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    shape = dict(SHAPES["tiny"])
    tok = train_tokenizer(shape["vocab_size"])
    ids = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id}
    return make_llava(tmp_path_factory.mktemp("llava") / "llava", shape, ids, tok, seed=0)


@pytest.fixture(scope="module")
def served(llava, tmp_path_factory):
    logs = tmp_path_factory.mktemp("llava-logs")
    with RedisServer() as server:
        worker = start_worker(server.url, llava, "w-llava", logs, wait=False)
        api, base = start_api(server.url, str(llava), logs, "api-llava")
        try:
            wait_worker(server.url, "w-llava", worker)
            yield server.url, base
        finally:
            kill_all([worker, api])


@pytest.fixture(scope="module")
def reference(llava):
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    processor = AutoProcessor.from_pretrained(llava)
    model = LlavaForConditionalGeneration.from_pretrained(llava, dtype=torch.float32).eval()

    def answer(messages: list[dict], images: list[bytes]) -> list[int]:
        text = processor.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        pil = [Image.open(io.BytesIO(d)).convert("RGB") for d in images]
        inputs = processor(images=pil, text=text, return_tensors="pt")
        out = model.generate(
            **inputs, max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        return out[0, inputs["input_ids"].shape[1] :].tolist()

    return answer


def _question(image: bytes, text: str = "What is in the picture?") -> list[dict]:
    parts = [
        {"type": "text", "text": text},
        {"type": "image_url", "image_url": {"url": url(image)}},
    ]
    return [{"role": "user", "content": parts}]


def _template(image_first_turn: str = "What is in the picture?") -> list[dict]:
    return [
        {"role": "user", "content": [{"type": "text", "text": image_first_turn}, {"type": "image"}]}
    ]


def _ids(choice) -> list[int]:
    return [int(t.token.removeprefix("token_id:")) for t in choice.logprobs.content]


async def _ask(base: str, messages: list[dict]) -> list[int]:
    return (await _answer(base, messages))[0]


async def _answer(base: str, messages: list[dict]) -> tuple[list[int], str]:
    answer = await aclient(base).chat.completions.create(
        model="llava",
        messages=messages,
        max_tokens=NEW,
        temperature=0,
        logprobs=True,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )
    choice = answer.choices[0]
    return _ids(choice), choice.message.content


def test_one_and_four_at_once_equal_generate(served, reference, llava):
    _, base = served
    images = [picture(s) for s in range(4)]
    expected = [reference(_template(), [img]) for img in images]
    assert len({tuple(e) for e in expected}) == 4, expected  # the image changes the answer
    assert asyncio.run(_ask(base, _question(images[0]))) == expected[0]

    async def at_once():
        return await asyncio.gather(*(_ask(base, _question(img)) for img in images))

    assert asyncio.run(at_once()) == expected


def _encoded_after(redis_url: str, moment: float) -> int:
    """The worker's images_encoded in a heartbeat written after ``moment``."""
    beat = {}

    def fresh():
        beat.update(heartbeat(redis_url, "w-llava"))
        return float(beat.get("updated", 0)) > moment

    wait_for(fresh, 30, "a fresh heartbeat", 0.05)
    return int(beat["images_encoded"])


def test_a_second_turn_reuses_the_image_and_equals_generate(served, reference):
    redis_url, base = served
    image = picture(11)
    before = _encoded_after(redis_url, time.time())
    _, text = asyncio.run(_answer(base, _question(image)))
    assert _encoded_after(redis_url, time.time()) == before + 1
    follow = [*_question(image), {"role": "assistant", "content": text}]
    follow.append({"role": "user", "content": "And the colours?"})
    template = [*_template(), {"role": "assistant", "content": text}, follow[-1]]
    assert asyncio.run(_ask(base, follow)) == reference(template, [image])
    assert _encoded_after(redis_url, time.time()) == before + 1


def test_the_anthropic_and_ollama_packages_send_an_image(served, reference):
    _, base = served
    image = picture(21)
    expected = reference(_template("Describe it."), [image])
    block = {
        "type": "image",
        "source": {
            "type": "base64",
            "media_type": "image/png",
            "data": base64.b64encode(image).decode(),
        },
    }
    message = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0).messages.create(
        model="llava",
        max_tokens=NEW,
        messages=[{"role": "user", "content": [{"type": "text", "text": "Describe it."}, block]}],
        extra_body={"temperature": 0},
    )
    chat = client(base).chat.completions.create(
        model="llava",
        messages=_question(image, "Describe it."),
        max_tokens=NEW,
        temperature=0,
    )
    assert message.content[0].text == chat.choices[0].message.content
    answer = ollama.Client(host=base).chat(
        model="llava",
        messages=[{"role": "user", "content": "Describe it.", "images": [image]}],
        options={"temperature": 0, "num_predict": NEW},
    )
    assert answer.message.content == chat.choices[0].message.content
    assert asyncio.run(_ask(base, _question(image, "Describe it."))) == expected
