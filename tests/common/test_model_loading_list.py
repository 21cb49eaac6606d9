"""The models workers are loading, as the API lists them: from their announcements in a real
Redis."""

from __future__ import annotations

import asyncio
import json
import time

import redis.asyncio as aioredis

from llmq.common.engine_client.model_registry import ModelRegistry
from llmq.common.settings import Settings
from llmq.common.transport import AsyncTransport, Keys
from llmq.common.transport.redis_server import RedisServer


def test_loading_records_list_until_served_or_expired():
    """A worker's announcement lists its model until it runs out (then it is deleted) or an
    engine of the model is live; a record llmq did not write is passed over."""

    def record(model: str, until: float) -> str:
        return json.dumps({"model": model, "source": f"/m/{model}", "since": 1.0, "until": until})

    async def check(url: str) -> None:
        client, keys = aioredis.Redis.from_url(url), Keys()
        registry = ModelRegistry(AsyncTransport(client, keys), Settings(model="/m/a"))
        now = time.time()
        await client.hset(
            keys.loading,
            mapping={"w1": record("a", now + 60), "w2": record("b", now - 1), "w3": "{"},
        )
        assert [r["model"] for r in await registry.loading()] == ["a"]
        assert sorted(await client.hkeys(keys.loading)) == [b"w1", b"w3"]  # w2 expired
        await client.zadd(keys.engines_index, {"w9": now})
        await client.hset(keys.engine("w9"), mapping={"model": "a", "started": now})
        fresh = ModelRegistry(AsyncTransport(client, keys), Settings(model="/m/a"))
        assert await fresh.loading() == []  # served now
        await client.aclose()

    with RedisServer() as server:
        asyncio.run(check(server.url))
