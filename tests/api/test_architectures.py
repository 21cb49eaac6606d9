"""Architectures beyond the fast families, through real processes: exact, or refused by name.

One Redis, one `llmq api`, and one `llmq worker` per model, started side by side: tiny models
(``llmq/tools/model_archs.py``) of Gemma 3 (interleaved sliding windows), DeepSeek V2 (MLA's
keys wider than its values) and gpt-oss (sinks and windows), each answering four prompts sent
at once through the openai SDK with ``generate``'s greedy text; and a Llama whose config asks
for chunked attention, which its worker refuses: it exits non-zero naming the feature, the API
neither lists it nor counts it ready, a request for it gets a 400 ``model_not_supported``
naming the feature, and `llmq inspect` shows the refusal.
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
import torch

from llmq.common.model_files import load_tokenizer
from llmq.common.transport.redis_server import RedisServer
from llmq.tools.model_factory import make_model
from llmq.worker.loading.model_loader import load_causal_lm
from tests.api.api_stack import aclient, assert_error
from tests.harness import LLMQ, base_env, kill_all, start_api, start_worker, wait_worker

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SERVED = ("gemma3_text", "deepseek_v2", "gpt_oss")  # windows; MLA; sinks and windows
REFUSED_FEATURE = "chunked attention (attention_chunk_size=8)"
NEW_TOKENS = 24


def prompts(vocab_size: int) -> list[list[int]]:
    """Four prompts of 5 to 200 tokens (every one past the models' 8-token windows), the last
    sharing the 200's first 100 (a prefix cache hit when it lands after it)."""
    rng = random.Random(11)
    out = [[rng.randrange(3, vocab_size) for _ in range(n)] for n in (5, 40, 200)]
    return out + [out[2][:100] + [rng.randrange(3, vocab_size) for _ in range(20)]]


def expected_texts(path: Path) -> tuple[list[list[int]], list[str]]:
    """The prompts, and transformers' greedy continuation of each, in float32, as text."""
    model = load_causal_lm(str(path), "float32", "cpu")
    tok = load_tokenizer(str(path))
    batch, texts = prompts(model.config.vocab_size), []
    with torch.inference_mode():
        for prompt in batch:
            out = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            texts.append(tok.decode(out[0, len(prompt) :].tolist(), skip_special_tokens=True))
    return batch, texts


@pytest.fixture(scope="module")
def models(tmp_path_factory, llama_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("archs")
    built = {arch: make_model(root / arch, arch=arch) for arch in SERVED}
    # Llama 4's chunked attention reaches only the attention mask, which llmq never sees.
    chunked = Path(shutil.copytree(llama_dir, root / "llama_chunked"))
    config = json.loads((chunked / "config.json").read_text())
    (chunked / "config.json").write_text(json.dumps({**config, "attention_chunk_size": 8}))
    return {**built, "refused": chunked}


@pytest.fixture(scope="module")
def archs(models, logs):
    """(redis URL, API base URL, the workers by model key), every worker started at once."""
    with RedisServer() as server:
        workers = {
            key: start_worker(server.url, path, f"w-{key}", logs, wait=False)
            for key, path in models.items()
        }
        api = None
        try:
            api, base = start_api(server.url, models[SERVED[0]], logs, "api-archs")
            for key in SERVED:
                wait_worker(server.url, f"w-{key}", workers[key], timeout=180)
            yield server.url, base, workers
        finally:
            kill_all([*workers.values(), *([api] if api is not None else [])])


async def _complete_at_once(base: str, model: str, batch: list[list[int]]) -> list[str]:
    async with aclient(base, timeout=120) as client:
        answers = await asyncio.gather(
            *(
                client.completions.create(
                    model=model,
                    prompt=prompt,
                    max_tokens=NEW_TOKENS,
                    temperature=0,
                    extra_body={"ignore_eos": True},
                )
                for prompt in batch
            )
        )
    return [a.choices[0].text for a in answers]


@pytest.mark.parametrize("arch", SERVED)
def test_four_prompts_at_once_equal_generate(archs, models, arch):
    _, base, _ = archs
    path = models[arch]
    batch, expected = expected_texts(path)
    assert len(set(expected)) == len(expected) and all(expected), expected
    assert asyncio.run(_complete_at_once(base, str(path), batch)) == expected


def test_a_refused_model_is_refused_everywhere_by_name(archs, models):
    redis_url, base, workers = archs
    worker, name = workers["refused"], str(models["refused"])
    assert worker.proc.wait(180) != 0
    assert REFUSED_FEATURE in worker.log(), worker.log()

    listed = httpx.get(f"{base}/v1/models", timeout=10).json()
    assert {m["id"] for m in listed["data"]} == {str(models[a]) for a in SERVED}
    ready = httpx.get(f"{base}/ready", timeout=10)
    assert ready.status_code == 200 and name not in ready.json()["models"]

    body = {"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=30)
    error = assert_error(r, 400, code="model_not_supported", param="model")
    assert REFUSED_FEATURE in error["message"]

    shown = subprocess.run(
        [LLMQ, "inspect"], env=base_env(redis_url, name), capture_output=True, text=True, timeout=60
    )
    assert shown.returncode == 0, shown.stderr
    refusal = next(line for line in shown.stdout.splitlines() if "REFUSED" in line)
    assert name in refusal and REFUSED_FEATURE in refusal
