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

import anthropic
import httpx
import ollama
import pytest
from transformers import MllamaConfig

from llmq.common.transport.redis_server import RedisServer
from llmq.tools.model_factory import make_model
from tests.api.api_stack import client
from tests.api.vision_client import (
    NEW,
    SHAPES,
    answer,
    ask,
    picture,
    processor_reference,
    question,
    second_turn_reuses_the_image,
    template,
)
from tests.harness import kill_all, start_api, start_worker, wait_worker
from tests.worker.test_vision_refusal import vision_folder

pytestmark = pytest.mark.usefixtures("one_torch_thread")
FAMILIES = ("llava", "llava_next", "idefics3")
# LLaVA-NeXT's prompts prefilled in chunks of 20 tokens (cut inside images); Idefics3's four
# at once in a cache of 12 blocks (192 tokens): they cannot all run at once.
WORKER = {
    "llava": {},
    "llava_next": {"max_batch_tokens": 20},
    "idefics3": {"kv_blocks": 12},
}


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
    """Per family, transformers' greedy tokens (``length``: the prompt's token count)."""
    return {f: processor_reference(models[f]) for f in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_one_and_four_at_once_equal_generate(served, references, family):
    _, base, _ = served
    images = [picture(s, size) for s, size in enumerate(SHAPES)]
    expected = [references[family](template(), [img]) for img in images]
    assert len({tuple(e) for e in expected}) == 4, expected  # the image changes the answer
    assert ask(base, family, question(images[0])) == expected[0]

    async def at_once():
        return await asyncio.gather(*(answer(base, family, question(i)) for i in images))

    assert [ids for ids, _ in asyncio.run(at_once())] == expected


@pytest.mark.parametrize("family", FAMILIES)
def test_usage_tokenize_and_count_tokens_count_an_image_as_the_model(served, references, family):
    _, base, _ = served
    image = picture(31, (80, 30))
    expected = references[family](template(), [image], length=True)
    answer = client(base).chat.completions.create(
        model=family, messages=question(image), max_tokens=1
    )
    assert answer.usage.prompt_tokens == expected
    r = httpx.post(f"{base}/tokenize", json={"model": family, "messages": question(image)})
    assert r.json()["count"] == expected, r.text
    data = base64.b64encode(image).decode()
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}
    content = [{"type": "text", "text": "What is in the picture?"}, block]
    counted = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0).messages.count_tokens(
        model=family, messages=[{"role": "user", "content": content}]
    )
    assert counted.input_tokens == expected


@pytest.mark.parametrize("family", FAMILIES)
def test_a_second_turn_reuses_the_image_and_equals_generate(served, references, family):
    """The follow-up turn finds the first turn's blocks, image tokens among them, in the
    prefix cache, and the image is not encoded again."""
    redis_url, base, _ = served
    image, reference = picture(11, (60, 40)), references[family]
    image_end = reference(template(), [image], length=True) - 5  # past the image
    second_turn_reuses_the_image(
        redis_url, base, family, f"w-{family}", image, reference, image_end
    )


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
        model="llava", messages=question(image, "Describe it."), max_tokens=NEW, temperature=0
    )
    assert message.content[0].text == chat.choices[0].message.content
    answer = ollama.Client(host=base).chat(
        model="llava",
        messages=[{"role": "user", "content": "Describe it.", "images": [image]}],
        options={"temperature": 0, "num_predict": NEW},
    )
    assert answer.message.content == chat.choices[0].message.content
    assert "vision" in ollama.Client(host=base).show("llava").capabilities
    expected = references["llava"](template("Describe it."), [image])
    assert ask(base, "llava", question(image, "Describe it.")) == expected


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
