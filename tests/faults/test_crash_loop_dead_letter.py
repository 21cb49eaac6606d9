"""A request that crashed its worker each time it ran reaches the dead letters instead of
crashing it forever."""

from __future__ import annotations

import asyncio
import time

import redis
import redis.asyncio as aioredis

from llmq.common.protocol import EngineRequest
from llmq.common.sampling_params import SamplingParams
from llmq.common.transport import AsyncTransport, Keys
from llmq.common.transport.redis_server import RedisServer
from tests.harness import heartbeat, kill_all, start_worker, wait_for
from tests.pipeline_client import stream_of


def test_a_request_that_crashed_its_worker_each_time_is_dead_lettered_on_restart(
    llama_dir, tmp_path
):
    """A worker restarted under the same name takes back the entries it held; their delivery
    count goes on from where the crashes left it, so a request that killed the worker three
    times (max_deliveries 3) is dead-lettered, not run a fourth time."""
    with RedisServer() as server:
        stream = stream_of(llama_dir)
        request = EngineRequest(
            id="crasher",
            prompt_token_ids=[5, 6, 7],
            params=SamplingParams(max_tokens=4),
            model=str(llama_dir),
            created=time.time(),
        )

        async def enqueue() -> None:
            client = aioredis.Redis.from_url(server.url)
            transport = AsyncTransport(client, Keys())
            await transport.ensure_group(str(llama_dir))
            assert await transport.enqueue(request, 0, 60)
            await client.aclose()

        asyncio.run(enqueue())
        r = redis.Redis.from_url(server.url)
        r.xreadgroup("engines", "w-loop", {stream: ">"})  # three runs that died with it
        for _ in range(2):
            r.xreadgroup("engines", "w-loop", {stream: "0"})
        worker = start_worker(server.url, llama_dir, "w-loop", tmp_path, max_deliveries=3)
        try:
            wait_for(lambda: r.xlen("llmq:dead") == 1, 30, "the dead letter", 0.05)
            ((_, fields),) = r.xrange("llmq:dead")
            assert fields[b"id"] == b"crasher" and fields[b"deliveries"] == b"4", fields
            assert r.hget("llmq:req:crasher", "state") == b"failed"
            assert r.xlen(stream) == 0
            assert heartbeat(server.url, "w-loop")["tokens_total"] == "0"  # it never ran
        finally:
            kill_all([worker])
