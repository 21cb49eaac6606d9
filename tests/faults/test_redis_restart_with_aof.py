"""Redis restarts with AOF under load: queued requests come back with it and complete token
for token, and the API's pooled connections, dead with the restart, retry on fresh ones."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import redis

from llmq.common.errors import DeadlineExceeded
from llmq.common.sampling_params import SamplingParams
from llmq.common.transport.redis_server import RedisServer
from tests.harness import heartbeat, kill_all, start_api, start_worker, wait_for, wait_worker
from tests.pipeline_client import GREEDY, greedy_reference, open_pipeline, prompts, stream_of


@pytest.fixture(scope="module")
def aof(llama_dir, tmp_path_factory):
    """A Redis with AOF, a worker (two sequences at a time: requests wait in the stream) and an
    API on it, shared by the module's tests: each restarts the Redis under them."""
    logs = tmp_path_factory.mktemp("aof")
    with RedisServer(appendonly=True) as server:
        worker = start_worker(server.url, llama_dir, "w-aof", logs, wait=False, max_batch_size=2)
        try:
            api, base = start_api(server.url, llama_dir, logs, "api-aof")
        except BaseException:
            worker.terminate()
            raise
        try:
            wait_worker(server.url, "w-aof", worker)
            yield server, worker, api, base
        finally:
            kill_all([api, worker])


@pytest.fixture(scope="module")
def reference(llama_dir):
    """The in-process engine: what the worker must reproduce token for token."""
    return greedy_reference(llama_dir)


def test_redis_restart_with_queued_requests(llama_dir, reference, aof):
    batch = prompts(6, seed=9)
    expected = reference(batch, 60)
    server, worker, _, _ = aof
    client = redis.Redis.from_url(server.url)

    async def run():
        async with open_pipeline(server.url, llama_dir, inactivity_timeout=120) as p:
            tasks = [
                asyncio.create_task(
                    p.all_tokens(q, SamplingParams(max_tokens=60, **GREEDY), timeout=60)
                )
                for q in batch
            ]
            await asyncio.to_thread(
                wait_for,
                lambda: client.xlen(stream_of(llama_dir)) == len(batch),
                10,
                "enqueue",
                0.01,
            )
            await asyncio.to_thread(server.restart)
            return await asyncio.gather(*tasks, return_exceptions=True)

    started = time.monotonic()
    results = asyncio.run(run())
    assert time.monotonic() - started < 60
    for res, exp in zip(results, expected, strict=True):
        if isinstance(res, DeadlineExceeded):
            pytest.fail(f"a request was lost across the restart: {res}")
        assert not isinstance(res, BaseException), res
        assert res.token_ids == exp
    assert worker.alive()


def test_requests_right_after_a_redis_restart_succeed(llama_dir, aof):
    """The API's pooled connections die with a Redis restart; the first requests after it
    retry on fresh ones instead of answering 503."""
    server, worker, api, base = aof
    logged = len(api.log_path.read_text(errors="replace"))  # what an earlier restart logged
    body = {"prompt": "hello", "max_tokens": 2}

    async def burst() -> list[int]:
        async with httpx.AsyncClient(base_url=base, timeout=60) as c:
            rs = await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(16)))
        return [r.status_code for r in rs]

    assert asyncio.run(burst()) == [200] * 16  # the pool now holds idle connections
    server.restart()
    r = redis.Redis.from_url(server.url)
    wait_for(lambda: heartbeat(server.url, "w-aof"), 20, "the worker back", 0.1)
    wait_for(lambda: r.xinfo_groups(stream_of(llama_dir)), 20, "its group back", 0.1)
    assert asyncio.run(burst()) == [200] * 16
    assert "redis unavailable" not in api.log_path.read_text(errors="replace")[logged:]
    assert worker.alive()
