"""GenerationService.answer (what batch lines call) against real processes: redis-server and
`llmq worker`, with `llmq api` beside it: the same validation messages, the same bodies, and
batch-line ids (attached to on a second run)."""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import pytest
import redis
import redis.asyncio as aioredis

from llmq.common.engine_client.model_registry import ModelRegistry
from llmq.common.protocol import PRIORITY_BATCH
from llmq.common.serving import GenerationService, SubmitOptions
from llmq.common.settings import Settings
from llmq.common.transport import AsyncTransport, Keys

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "What does XREADGROUP do?"}]


@pytest.fixture(scope="module")
def served(llama_stack):
    """The session's shared Redis, worker and API of the tiny Llama: (Redis URL, API base
    URL, model)."""
    return llama_stack.redis_url, llama_stack.base, llama_stack.model


@contextlib.asynccontextmanager
async def open_service(url: str, model: str):
    client = aioredis.Redis.from_url(url)
    transport = AsyncTransport(client, Keys())
    try:
        yield GenerationService(ModelRegistry(transport, Settings(model=model, redis_url=url)))
    finally:
        await transport.close()
        await client.aclose()


def answer(served, endpoint: str, body: dict, options: SubmitOptions | None = None):
    url, _, model = served

    async def run():
        async with open_service(url, model) as service:
            return await service.answer(endpoint, body, options or SubmitOptions())

    return asyncio.run(run())


def over_http(served, endpoint: str, body: dict) -> tuple[int, dict]:
    r = httpx.post(served[1] + endpoint, json=body, timeout=120)
    return r.status_code, r.json()


def without_ids(body: dict) -> dict:
    """The answer less its ids and what the prefix cache's state sets (how many prompt tokens
    were cached: n choices pulled in one step share none, pulled a step apart the second
    reuses the first's blocks)."""
    out = {k: v for k, v in body.items() if k not in ("id", "created")}
    if "usage" in out:
        out["usage"] = {k: v for k, v in out["usage"].items() if k != "prompt_tokens_details"}
    return out


@pytest.mark.parametrize(
    "endpoint, body",
    [
        (CHAT, {"messages": MESSAGES, "max_tokens": 12, "temperature": 0, "n": 2}),
        (COMPLETIONS, {"prompt": ["def f(x):", "import os"], "max_tokens": 8, "temperature": 0}),
        (COMPLETIONS, {"prompt": "import os", "max_tokens": 6, "temperature": 0, "logprobs": 2}),
        (COMPLETIONS, {"prompt": "import os", "max_tokens": 4, "temperature": 0, "echo": True}),
        (CHAT, {"messages": MESSAGES, "max_tokens": 5, "temperature": 0, "logprobs": True}),
        (COMPLETIONS, {"prompt": [[5, 6], [7, 8, 9]], "max_tokens": 3, "temperature": 0}),
    ],
)
def test_answer_equals_the_routes_answer(served, endpoint, body):
    status, got = answer(served, endpoint, {**body, "stream": True})  # never streamed
    want_status, want = over_http(served, endpoint, body)
    assert (status, want_status) == (200, 200), got
    assert got["id"].startswith("chatcmpl-" if endpoint == CHAT else "cmpl-")
    assert without_ids(got) == without_ids(want)
    assert got["usage"]["completion_tokens"] > 0


@pytest.mark.parametrize(
    "endpoint, body",
    [
        (CHAT, {"messages": []}),
        (CHAT, {"messages": MESSAGES, "temperature": 5}),
        (CHAT, {"messages": MESSAGES, "top_logprobs": 2}),
        (CHAT, {"messages": [{"role": "user"}]}),
        (COMPLETIONS, {"prompt": 5}),
        (COMPLETIONS, {"prompt": ["x", [5, 6]]}),
        (COMPLETIONS, {"prompt": [[5, 6], [7, 8]], "max_tokens": 2, "temperature": 0, "n": 9}),
        (COMPLETIONS, {"prompt": "x", "n": 2, "best_of": 3}),
        (COMPLETIONS, {"prompt": "x", "max_tokens": 100000}),
        (COMPLETIONS, {"prompt": "x", "model": "no-such-model"}),
    ],
)
def test_answer_refuses_as_the_route_does(served, endpoint, body):
    status, got = answer(served, endpoint, body)
    assert status in (400, 404), got
    assert (status, got) == over_http(served, endpoint, body)


def test_a_batch_line_runs_under_its_ids_and_attaches_on_a_second_run(served):
    url = served[0]
    body = {"prompt": "def main():", "max_tokens": 16, "temperature": 1.0, "ignore_eos": True}
    line = SubmitOptions(priority=PRIORITY_BATCH, request_id_prefix="batch_x-3")
    first = answer(served, COMPLETIONS, {**body, "n": 2}, line)
    assert first[0] == 200, first
    r = redis.Redis.from_url(url)
    for k in (0, 1):
        assert r.exists(Keys().req(f"batch_x-3-{k}")), k
    assert not r.exists(Keys().req("batch_x-3-2"))
    again = answer(served, COMPLETIONS, {**body, "n": 2}, line)
    # Unseeded sampling: equal texts only because the second run followed the first's requests.
    assert without_ids(again[1]) == without_ids(first[1])
