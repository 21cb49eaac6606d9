"""Placement's transport on a real redis-server (no worker processes): an entry placed on
another worker is handed over into its pending list and taken there; a target that is gone
keeps nothing; the published cached set follows what a cache holds and evicts."""

from __future__ import annotations

import asyncio

import pytest
import redis
import redis.asyncio as aioredis

from llmq.common.engine_status import EngineStatus
from llmq.common.placement.block_hashes import prompt_hashes
from llmq.common.protocol import EngineRequest
from llmq.common.sampling_params import SamplingParams
from llmq.common.transport import GROUP, AsyncTransport, EngineTransport, Keys
from llmq.common.transport.redis_server import RedisServer
from tests.harness import wait_for

MODEL = "m"


@pytest.fixture(scope="module")
def server():
    with RedisServer() as s:
        yield s


@pytest.fixture
def client(server):
    r = redis.Redis.from_url(server.url)
    r.flushall()
    yield r
    r.close()


def engine(client, name: str) -> EngineTransport:
    t = EngineTransport(client, Keys(), name, MODEL, request_ttl=60, placement=True)
    t.setup(EngineStatus(model=MODEL))
    t.heartbeat(EngineStatus(model=MODEL, kv_blocks_total=100), ttl=30)
    return t


def enqueue(server, rid: str, target: str, prompt: list[int] | None = None) -> None:
    async def run():
        r = aioredis.Redis.from_url(server.url)
        t = AsyncTransport(r, Keys())
        req = EngineRequest(rid, prompt or [1, 2, 3], SamplingParams(), model=MODEL)
        assert await t.enqueue(req, 0, 60, target=target)
        await r.aclose()

    asyncio.run(run())


def pending_of(client, worker: str) -> list[str]:
    rows = client.xpending_range(Keys().requests(MODEL), GROUP, "-", "+", 100, worker)
    return [r["message_id"].decode() for r in rows]


def test_an_entry_placed_on_another_worker_is_handed_over_and_taken_there(server, client):
    a, b = engine(client, "a"), engine(client, "b")
    b.handover_waiting = False  # (a worker looks once at start)
    enqueue(server, "r1", target="b")
    enqueue(server, "r2", target="a")
    enqueue(server, "r3", target="")
    assert sorted(p.request.id for p in a.pull(10, None)) == ["r2", "r3"]
    handed = pending_of(client, "b")
    assert len(handed) == 1 and not b.handover_waiting

    def told() -> bool:  # on the cancel channel, which is no cancel
        assert b.drain_cancels() == []
        return b.handover_waiting

    wait_for(told, 5, "the hand-over notice")
    taken = b.pull_handed(10)
    assert [p.request.id for p in taken] == ["r1"] and taken[0].running
    assert taken[0].deliveries == 1  # a hand-over is not a delivery
    assert client.hget(Keys().req("r1"), "worker") == b"b"
    assert b.pull_handed(10) == []  # taken once
    assert pending_of(client, "a") != handed  # in one pending list only
    assert handed == pending_of(client, "b")


def test_a_reader_keeps_an_entry_whose_target_is_gone(server, client):
    a = engine(client, "a")
    enqueue(server, "r1", target="ghost")
    assert [p.request.id for p in a.pull(10, None)] == ["r1"]
    assert pending_of(client, "ghost") == []


def test_the_published_set_follows_the_cache_and_the_api_reads_prefixes(server, client):
    a, b = engine(client, "a"), engine(client, "b")
    prompt = list(range(64))
    hashes = prompt_hashes(prompt, 16)
    a.publish_cached(hashes[:3], ttl=30)
    b.publish_cached(hashes[:1] + [99], ttl=30)

    async def held():
        r = aioredis.Redis.from_url(server.url)
        got = await AsyncTransport(r, Keys()).cached_prefixes(MODEL, ["a", "b", "c"], hashes)
        await r.aclose()
        return got

    assert asyncio.run(held()) == {"a": 3, "b": 1, "c": 0}
    a.publish_cached(hashes[2:3], ttl=30)  # the first two evicted
    assert asyncio.run(held())["a"] == 0
    assert client.smembers(Keys().cached("a")) == {str(hashes[2]).encode()}
    assert 0 < client.pttl(Keys().cached("a")) <= 30_000
