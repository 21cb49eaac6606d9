"""Redis restarts with AOF under load: queued requests come back with it and complete token
for token, and the API's pooled connections, dead with the restart, retry on fresh ones."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import redis

from llmq.common.errors import DeadlineExceeded
from llmq.common.redis_server import RedisServer
from llmq.common.sampling_params import SamplingParams
from tests.harness import heartbeat, start_api, start_worker, wait_for, wait_worker
from tests.pipeline_client import GREEDY, greedy_reference, open_pipeline, prompts, stream_of


@pytest.fixture(scope="module")
def reference(llama_dir):
    """The in-process engine: what the worker must reproduce token for token."""
    return greedy_reference(llama_dir)


def test_redis_restart_with_queued_requests(llama_dir, reference, tmp_path):
    batch = prompts(6, seed=9)
    expected = reference(batch, 60)
    with RedisServer(appendonly=True) as server:
        worker = start_worker(server.url, llama_dir, "w-aof", tmp_path, max_batch_size=2)
        client = redis.Redis.from_url(server.url)
        try:

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
        finally:
            worker.terminate()


def test_requests_right_after_a_redis_restart_succeed(llama_dir, tmp_path):
    """The API's pooled connections die with a Redis restart; the first requests after it
    retry on fresh ones instead of answering 503."""
    with RedisServer(appendonly=True) as server:
        worker = start_worker(server.url, llama_dir, "w-rr", tmp_path, wait=False)
        api, base = start_api(server.url, llama_dir, tmp_path, "api-rr")
        try:
            wait_worker(server.url, "w-rr", worker)
            body = {"prompt": "hello", "max_tokens": 2}

            async def burst() -> list[int]:
                async with httpx.AsyncClient(base_url=base, timeout=60) as c:
                    rs = await asyncio.gather(
                        *(c.post("/v1/completions", json=body) for _ in range(16))
                    )
                return [r.status_code for r in rs]

            assert asyncio.run(burst()) == [200] * 16  # the pool now holds idle connections
            server.restart()
            r = redis.Redis.from_url(server.url)
            wait_for(lambda: heartbeat(server.url, "w-rr"), 20, "the worker back", 0.1)
            wait_for(lambda: r.xinfo_groups(stream_of(llama_dir)), 20, "its group back", 0.1)
            assert asyncio.run(burst()) == [200] * 16
            assert "redis unavailable" not in api.log(100_000)
        finally:
            api.terminate()
            worker.terminate()
