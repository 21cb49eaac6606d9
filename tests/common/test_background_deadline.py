"""A background response past LLMQ_BACKGROUND_TIMEOUT ends failed, with a final event for its
followers, and is not run; against a real redis-server (no worker needed: the run gives up
before it submits anything)."""

from __future__ import annotations

import asyncio
import json
import time

import redis

from llmq.common.settings import Settings
from llmq.common.storage.background_responses import BackgroundResponses
from llmq.common.transport import Keys
from llmq.common.transport.redis_server import RedisServer
from llmq.worker.background import BackgroundRun

RESPONSE_ID = "resp_" + "a" * 32


def queued(created_at: int) -> dict:
    response = {"id": RESPONSE_ID, "status": "queued", "created_at": created_at, "background": True}
    body = {"model": "m", "input": "hi", "background": True}
    return {"response": response, "input": [], "owner": "o", "body": body, "history": []}


def test_a_response_past_its_deadline_ends_failed():
    with RedisServer() as server:
        settings = Settings(redis_url=server.url, background_timeout=60)
        r = redis.Redis.from_url(server.url)
        r.set(Keys().response(RESPONSE_ID), json.dumps(queued(int(time.time()) - 61)))
        result = asyncio.run(BackgroundRun(RESPONSE_ID, settings).run())
        assert result == {"response": RESPONSE_ID, "status": "failed"}
        record = json.loads(r.get(Keys().response(RESPONSE_ID)))
        assert record["response"]["status"] == "failed"
        assert "LLMQ_BACKGROUND_TIMEOUT" in record["response"]["error"]["message"]
        [(_, fields)] = r.xrange(Keys().response(RESPONSE_ID) + ":events")
        event = json.loads(fields[b"e"])
        assert (event["type"], event["sequence_number"]) == ("response.failed", 0)
        assert not r.exists(Keys().response(RESPONSE_ID) + ":lease")  # given back
        # A second run of it (a redelivered task) finds it finished.
        again = asyncio.run(BackgroundRun(RESPONSE_ID, settings).run())
        assert again == {"response": RESPONSE_ID, "skipped": "finished"}


def test_a_deleted_response_is_not_written_back():
    with RedisServer() as server:
        r = redis.Redis.from_url(server.url)

        async def saves() -> tuple[bool, bool]:
            client = redis.asyncio.Redis.from_url(server.url)
            store = BackgroundResponses(client, Keys(), 60)
            record = queued(int(time.time()))
            try:
                return await store.save(record, 60), await store.save(record, 60, create=True)
            finally:
                await client.aclose()

        assert asyncio.run(saves()) == (False, True)
        assert r.exists(Keys().response(RESPONSE_ID))
