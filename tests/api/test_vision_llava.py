"""LLaVA-1.5 and LLaVA-NeXT (tiny, random weights: ``llmq/tools/vision_models.py``) served
through real processes, exact against transformers: greedy tokens through the API equal the
model's ``generate`` in float32 on the same images and prompt, for one request, four at once
with different images (of different shapes: NeXT's tile grids differ), a second turn repeating
the image (encoded once: the heartbeat's counter), and through the openai, anthropic and
ollama packages; chunked (LLaVA-NeXT) and in a small cache (Idefics3). One Redis and one API;
a worker per family, and one given a Llama 3.2 Vision folder,
which it refuses by name (it exits without a traceback; the API's 400 names the class)."""

from __future__ import annotations

import asyncio
import base64
import io
import time

import anthropic
import httpx
import ollama
import pytest
import torch
from PIL import Image
from transformers import MllamaConfig

from llmq.common.transport.redis_server import RedisServer
from llmq.tools.model_factory import make_model
from tests.api.api_stack import aclient, client
from tests.harness import heartbeat, kill_all, start_api, start_worker, wait_for, wait_worker
from tests.worker.test_vision_refusal import vision_folder

pytestmark = pytest.mark.usefixtures("one_torch_thread")
FAMILIES = ("llava", "llava_next", "idefics3")
NEW = 6
SHAPES = [(40, 50), (80, 30), (50, 50), (20, 70)]
# LLaVA-NeXT's prompts prefilled in chunks of 20 tokens (cut inside images); Idefics3's four
# at once in a cache of 12 blocks (192 tokens): they cannot all run at once.
WORKER = {
    "llava": {},
    "llava_next": {"max_batch_tokens": 20},
    "idefics3": {"kv_blocks": 12},
}  # (width, height): NeXT picks other grids


def picture(seed: int, size: tuple[int, int] = (40, 50)) -> bytes:
    """A PNG of random colours."""
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels.numpy()).save(out, "PNG")
    return out.getvalue()


def url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm")
    return {f: make_model(root / f, arch=f) for f in FAMILIES}


@pytest.fixture(scope="module")
def refused(llama_dir, tmp_path_factory):
    """A Llama 3.2 Vision folder (config and tokenizer only): a family llmq refuses by name."""
    folder = tmp_path_factory.mktemp("refused") / "mllama"
    return vision_folder(llama_dir, folder, MllamaConfig)


@pytest.fixture(scope="module")
def served(models, refused, tmp_path_factory):
    logs = tmp_path_factory.mktemp("vlm-logs")
    with RedisServer() as server:
        workers = {
            f: start_worker(server.url, models[f], f"w-{f}", logs, wait=False, **WORKER[f])
            for f in FAMILIES
        }
        workers["refused"] = start_worker(server.url, refused, "w-refused", logs, wait=False)
        api, base = start_api(server.url, str(models["llava"]), logs, "api-vlm")
        try:
            for f in FAMILIES:
                wait_worker(server.url, f"w-{f}", workers[f])
            yield server.url, base, workers["refused"]
        finally:
            kill_all([*workers.values(), api])


@pytest.fixture(scope="module")
def references(models):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    def reference(path):
        processor = AutoProcessor.from_pretrained(path)
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()

        def answer(messages: list[dict], images: list[bytes], length: bool = False):
            """The greedy tokens (``length``: the prompt's token count)."""
            text = processor.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
            pil = [Image.open(io.BytesIO(d)).convert("RGB") for d in images]
            inputs = processor(images=pil, text=text, return_tensors="pt")
            if length:
                return inputs["input_ids"].shape[1]
            out = model.generate(
                **inputs, max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0
            )
            return out[0, inputs["input_ids"].shape[1] :].tolist()

        return answer

    return {f: reference(models[f]) for f in FAMILIES}


def _question(image: bytes, text: str = "What is in the picture?") -> list[dict]:
    parts = [
        {"type": "text", "text": text},
        {"type": "image_url", "image_url": {"url": url(image)}},
    ]
    return [{"role": "user", "content": parts}]


def _template(text: str = "What is in the picture?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": text}, {"type": "image"}]}]


async def _answer(base: str, model: str, messages: list[dict]) -> tuple[list[int], str]:
    answer = await aclient(base).chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=NEW,
        temperature=0,
        logprobs=True,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )
    choice = answer.choices[0]
    ids = [int(t.token.removeprefix("token_id:")) for t in choice.logprobs.content]
    return ids, choice.message.content


def _ask(base: str, model: str, messages: list[dict]) -> list[int]:
    return asyncio.run(_answer(base, model, messages))[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_one_and_four_at_once_equal_generate(served, references, family):
    _, base, _ = served
    images = [picture(s, size) for s, size in enumerate(SHAPES)]
    expected = [references[family](_template(), [img]) for img in images]
    assert len({tuple(e) for e in expected}) == 4, expected  # the image changes the answer
    assert _ask(base, family, _question(images[0])) == expected[0]

    async def at_once():
        return await asyncio.gather(*(_answer(base, family, _question(i)) for i in images))

    assert [ids for ids, _ in asyncio.run(at_once())] == expected


@pytest.mark.parametrize("family", FAMILIES)
def test_usage_tokenize_and_count_tokens_count_an_image_as_the_model(served, references, family):
    _, base, _ = served
    image = picture(31, (80, 30))
    expected = references[family](_template(), [image], length=True)
    answer = client(base).chat.completions.create(
        model=family, messages=_question(image), max_tokens=1
    )
    assert answer.usage.prompt_tokens == expected
    r = httpx.post(f"{base}/tokenize", json={"model": family, "messages": _question(image)})
    assert r.json()["count"] == expected, r.text
    data = base64.b64encode(image).decode()
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}
    content = [{"type": "text", "text": "What is in the picture?"}, block]
    counted = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0).messages.count_tokens(
        model=family, messages=[{"role": "user", "content": content}]
    )
    assert counted.input_tokens == expected


def _counters_after(redis_url: str, worker: str, moment: float) -> tuple[int, int]:
    """The worker's (images_encoded, prefix_cache_hit_tokens) in a heartbeat written after
    ``moment``."""
    beat = {}

    def fresh():
        beat.update(heartbeat(redis_url, worker))
        return float(beat.get("updated", 0)) > moment

    wait_for(fresh, 30, "a fresh heartbeat", 0.05)
    return int(beat["images_encoded"]), int(beat["prefix_cache_hit_tokens"])


@pytest.mark.parametrize("family", FAMILIES)
def test_a_second_turn_reuses_the_image_and_equals_generate(served, references, family):
    """The follow-up turn finds the first turn's blocks, image tokens among them, in the
    prefix cache, and the image is not encoded again."""
    redis_url, base, _ = served
    image, worker = picture(11, (60, 40)), f"w-{family}"
    encoded, _ = _counters_after(redis_url, worker, time.time())
    _, text = asyncio.run(_answer(base, family, _question(image)))
    after_first, hits = _counters_after(redis_url, worker, time.time())
    assert after_first == encoded + 1
    follow = [*_question(image), {"role": "assistant", "content": text}]
    follow.append({"role": "user", "content": "And the colours?"})
    template = [*_template(), {"role": "assistant", "content": text}, follow[-1]]
    assert _ask(base, family, follow) == references[family](template, [image])
    after_second, hits_second = _counters_after(redis_url, worker, time.time())
    assert after_second == encoded + 1
    image_end = references[family](_template(), [image], length=True) - 5  # past the image
    assert hits_second - hits >= image_end - 16  # all but a partial block: from the cache


def test_the_anthropic_and_ollama_packages_send_an_image(served, references):
    _, base, _ = served
    image = picture(21)
    data = base64.b64encode(image).decode()
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}
    message = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0).messages.create(
        model="llava",
        max_tokens=NEW,
        messages=[{"role": "user", "content": [{"type": "text", "text": "Describe it."}, block]}],
        extra_body={"temperature": 0},
    )
    chat = client(base).chat.completions.create(
        model="llava", messages=_question(image, "Describe it."), max_tokens=NEW, temperature=0
    )
    assert message.content[0].text == chat.choices[0].message.content
    answer = ollama.Client(host=base).chat(
        model="llava",
        messages=[{"role": "user", "content": "Describe it.", "images": [image]}],
        options={"temperature": 0, "num_predict": NEW},
    )
    assert answer.message.content == chat.choices[0].message.content
    assert "vision" in ollama.Client(host=base).show("llava").capabilities
    expected = references["llava"](_template("Describe it."), [image])
    assert _ask(base, "llava", _question(image, "Describe it.")) == expected


def test_a_worker_refuses_a_vision_family_not_served_by_name(served, refused):
    _, base, worker = served
    assert worker.proc.wait(120) != 0
    log = worker.log(20_000)
    assert "MllamaConfig is a vision-language model" in log
    assert "Traceback" not in log and "Unrecognized configuration" not in log, log
    body = {"model": str(refused), "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "model_not_supported" and "MllamaConfig" in error["message"]
