"""Redis Sentinel: one `sentinel://` URL list for every client, and a failover the worker and the
API follow by themselves. Real redis-server processes: a master, its replica, three sentinels."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
from flower.utils.broker import Broker

from llmq.common.settings import Settings
from llmq.common.transport.celery_client import make_celery
from llmq.common.transport.redis_clients import async_client
from llmq.common.transport.redis_sentinel import SentinelAddress, parse_sentinel_url
from tests.faults.stack import completion, greedy_texts
from tests.harness import heartbeat, kill_all, start_api, start_worker, wait_for
from tests.sentinel_cluster import SentinelCluster
from tests.worker.batches.batch_stack import (
    assert_output_lines,
    chat_lines,
    create_batch,
    jsonl,
    wait_batch,
)

PROMPTS = [[5 + i, 17, 33, 2 + 3 * i, 40 + i] for i in range(16)]
BATCH_LINES = 12
MAX_TOKENS = 48


@pytest.mark.unit
def test_sentinel_url_lists_every_sentinel_and_the_masters_password():
    address = parse_sentinel_url("sentinel://:p%40ss@h1:26380/2;sentinel://:p%40ss@h2;")
    assert address == SentinelAddress([("h1", 26380), ("h2", 26379)], "p@ss", None, 2)
    assert address.master_kwargs() == {"db": 2, "password": "p@ss"}
    assert parse_sentinel_url("sentinel://h").master_kwargs() == {"db": 0}


@pytest.mark.unit
@pytest.mark.parametrize(
    "url", ["redis://h:6379", "sentinel://h;redis://:secret@h2", "sentinel://", "sentinel://h/x"]
)
def test_sentinel_url_refuses_what_is_not_a_sentinel_list(url):
    with pytest.raises(ValueError) as err:
        parse_sentinel_url(url)
    assert "secret" not in str(err.value)


@pytest.mark.unit
def test_celery_asks_the_sentinels_for_the_named_master():
    url = "sentinel://:pw@127.0.0.1:26379;sentinel://127.0.0.1:26380"
    app = make_celery(Settings(redis_url=url, redis_sentinel_master="llmq-main"))
    assert app.conf.broker_url == url
    assert app.conf.broker_transport_options["master_name"] == "llmq-main"
    assert app.conf.result_backend_transport_options["master_name"] == "llmq-main"
    assert type(app.backend).__name__ == "SentinelBackend"
    # Flower's broker view builds its Redis client from the same options.
    first = app.connection().as_uri(include_password=True)
    flower = Broker(first, broker_options=app.conf.broker_transport_options)
    assert type(flower).__name__ == "RedisSentinel" and flower.master_name == "llmq-main"
    plain = make_celery(Settings(redis_url="redis://127.0.0.1:1/0"))
    assert "master_name" not in plain.conf.broker_transport_options


async def stream(http: httpx.AsyncClient, base: str, body: dict, started: list) -> tuple:
    """(status, text, error code or None) of a streamed completion; ``started`` gets one entry
    at its first token."""
    text, error = [], None
    async with http.stream("POST", f"{base}/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            return resp.status_code, "", json.loads(await resp.aread())["error"]["code"]
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            error = event.get("error", {}).get("code", error)
            text += [c["text"] for c in event.get("choices", [])]
            if len(text) == 1:
                started.append(1)
    return resp.status_code, "".join(text), error


async def streams_across_failover(cluster: SentinelCluster, base: str) -> tuple[list, float]:
    """16 greedy streams; the master SIGKILLed once half of them produce tokens."""
    started: list = []
    async with httpx.AsyncClient(timeout=120) as http:
        bodies = [completion(p, MAX_TOKENS, stream=True) for p in PROMPTS]
        calls = [asyncio.ensure_future(stream(http, base, b, started)) for b in bodies]
        await asyncio.to_thread(wait_for, lambda: len(started) >= 8, 60, "streams under way")
        cluster.kill_master()
        killed = time.monotonic()
        # None hangs: all end well before the request timeout (60 s).
        answers = await asyncio.wait_for(asyncio.gather(*calls), 45)
    return answers, time.monotonic() - killed


async def whole_answers(base: str) -> list[str]:
    async with httpx.AsyncClient(timeout=60) as http:
        calls = [
            http.post(f"{base}/v1/completions", json=completion(p, MAX_TOKENS)) for p in PROMPTS
        ]
        resps = await asyncio.gather(*calls)
    assert [r.status_code for r in resps] == [200] * len(PROMPTS), resps[0].text
    return [r.json()["choices"][0]["text"] for r in resps]


def test_worker_and_api_follow_the_master_across_a_failover(llama_dir, tmp_path):
    """The master SIGKILLed during 16 streams and a running batch: every stream ends exact,
    every batch line appears exactly once, and the same processes serve on afterwards."""
    expected = greedy_texts(llama_dir, PROMPTS, MAX_TOKENS)
    with SentinelCluster(tmp_path / "redis", password="sentinel-pw") as cluster:
        worker = start_worker(cluster.url, llama_dir, "w-sentinel", tmp_path, max_batch_size=16)
        api, base = start_api(cluster.url, llama_dir, tmp_path, request_timeout=60)
        try:
            assert asyncio.run(whole_answers(base)) == expected
            client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=5)
            lines = chat_lines(str(llama_dir), BATCH_LINES, 24)
            batch = create_batch(client, lines)
            answers, ended = asyncio.run(streams_across_failover(cluster, base))
            cluster.wait_promoted()
            for (status, text, code), want in zip(answers, expected, strict=True):
                assert (status, code, text) == (200, None, want)
            print(f"sentinel failover: {len(answers)}/{len(answers)} streams exact; all ended "
                  f"{ended:.1f}s after the kill")  # fmt: skip
            done = wait_batch(client, batch.id, 120)
            assert done.status == "completed" and done.request_counts.failed == 0, done
            ids = {f"r{i}" for i in range(BATCH_LINES)}
            assert_output_lines(jsonl(client, done.output_file_id), ids, "chat.completion")
            assert jsonl(client, done.error_file_id) == []

            # The same processes, now on the promoted replica: heartbeat and exact answers.
            wait_for(lambda: heartbeat(cluster.url, "w-sentinel"), 30, "the heartbeat back")
            assert asyncio.run(whole_answers(base)) == expected
            assert worker.alive() and api.alive()
            assert "engine loop crashed" not in worker.log(10**6)
            assert "unhandled error" not in api.log(10**6)
        finally:
            kill_all([api, worker])


def test_async_client_reaches_the_new_master_on_its_first_command(tmp_path):
    """Pooled connections to the dead master reconnect to the promoted replica at once."""
    with SentinelCluster(tmp_path) as cluster:

        async def write(client, value: str) -> bytes | None:
            await client.set("k", value)
            return await client.get("k")

        async def scenario() -> tuple:
            client = async_client(cluster.url, max_connections=4)
            before = await write(client, "before")
            # Blocking the loop on purpose: the pooled connection does not see its socket close,
            # as when the master's host vanishes; its next command meets the dead socket.
            cluster.kill_master()
            cluster.wait_promoted()
            after = await write(client, "after")
            await client.aclose()
            return before, after

        assert asyncio.run(scenario()) == (b"before", b"after")
