"""A worker's output written once a step (common/transport/step_writer.py) on a real
redis-server: what a reader recovers is exactly what was published, through moves of the log
into the lists, and a claimer resumes from it while the old owner, fenced, publishes nothing."""

from __future__ import annotations

import random
import time

import pytest
import redis

from llmq.common.protocol import EngineRequest, OutputMessage
from llmq.common.transport import Emission, EngineTransport, Keys
from llmq.common.transport import step_writer as step_writer_module
from llmq.common.transport.keys import ENQUEUE_SCRIPT, GROUP
from llmq.common.transport.output_log import decode_frame
from llmq.common.transport.redis_server import RedisServer
from tests.harness import recorded_tokens

CHANNEL = "llmq:replies:test"
KEYS = Keys()


def token(rid: str, index: int) -> int:
    return 1000 * int(rid.removeprefix("r")) + index


def enqueue(r: redis.Redis, n: int) -> None:
    script = r.register_script(ENQUEUE_SCRIPT)
    for i in range(n):
        req = EngineRequest(f"r{i}", [1, 2], model="m", reply_to=CHANNEL, created=time.time())
        keys = [KEYS.requests("m"), KEYS.req(req.id)]
        script(
            keys=keys,
            args=[
                req.id,
                req.to_json(),
                0,
                GROUP,
                req.created,
                "m",
                600,
                "generate",
                "0",
                1,
                CHANNEL,
            ],
        )


def recorded(r: redis.Redis, rid: str) -> list[int]:
    return recorded_tokens(r, rid)


def step(t: EngineTransport, sent: dict[str, int], rng: random.Random, final: bool = False):
    emissions = []
    for rid in sorted(sent):
        if final or rng.random() < 0.8:
            n = rng.choice([1, 1, 2])
            tokens = [token(rid, sent[rid] + j) for j in range(n)]
            msg = OutputMessage(sent[rid], tokens, finish_reason="length" if final else None)
            emissions.append(Emission(rid, "", msg, CHANNEL))
            sent[rid] += n
    for e in emissions:  # the entry each was pulled under
        e.entry_id = t.writer.held[e.request_id].entry_id
    return t.emit(emissions)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_readers_and_claimers_see_exactly_what_was_published(seed, monkeypatch):
    monkeypatch.setattr(step_writer_module, "CONSOLIDATE_EVERY", 4)
    rng = random.Random(seed)
    with RedisServer() as server:
        r = redis.Redis.from_url(server.url)
        listener = r.pubsub()
        listener.subscribe(CHANNEL)
        a = EngineTransport(redis.Redis.from_url(server.url), KEYS, "wa", "m", 600)
        b = EngineTransport(redis.Redis.from_url(server.url), KEYS, "wb", "m", 600)
        a.setup(), b.setup()
        enqueue(r, 6)
        pulled = a.pull(6, None)
        assert not a.mark_running(pulled)
        sent = {p.request.id: 0 for p in pulled}
        for _ in range(rng.randint(5, 11)):  # through a move or two
            assert not step(a, sent, rng)
            assert {rid: recorded(r, rid) for rid in sent} == {
                rid: [token(rid, i) for i in range(n)] for rid, n in sent.items()
            }
        claimed = b.claim_orphans(0, 10)  # wa has no heartbeat: dead
        assert {p.request.id: p.prior_tokens for p in claimed} == {
            rid: [token(rid, i) for i in range(n)] for rid, n in sent.items()
        }
        frames_before = drain(listener)
        refused = step(a, dict(sent), rng, final=True)  # wa wakes: fenced, sends nothing
        assert sorted((x.request_id, x.owner) for x in refused) == [
            (rid, "wb") for rid in sorted(sent)
        ]
        assert drain(listener) == []
        assert not b.mark_running(claimed)
        assert not step(b, sent, rng)
        assert not step(b, sent, rng, final=True)
        published = frames_before + drain(listener)
        for rid, n in sent.items():
            assert recorded(r, rid) == [token(rid, i) for i in range(n)]
            assert r.hget(KEYS.req(rid), "state") == b"finished"
        by_index: dict[tuple[str, int], set[int]] = {}
        for frame in published:
            for rid, msg in frame.items():
                for j, t in enumerate(msg.tokens):
                    by_index.setdefault((rid, msg.index + j), set()).add(t)
        assert all(len(v) == 1 for v in by_index.values())
        assert r.xlen(KEYS.requests("m")) == 0


def drain(listener) -> list[dict[str, OutputMessage]]:
    frames = []
    while (msg := listener.get_message(timeout=0.2)) is not None:
        if msg["type"] == "message":
            frames.append(decode_frame(msg["data"]))
    return frames


def test_a_write_for_an_entry_its_request_left_is_refused_and_the_entry_dropped():
    """A request enqueued again under its id (a new entry) while a worker still holds the old
    one: that worker's write, alone (its first) or in a step (a final), records nothing and
    its old entry leaves the stream."""
    with RedisServer() as server:
        r = redis.Redis.from_url(server.url)
        for final in (False, True):
            r.flushall()
            a = EngineTransport(redis.Redis.from_url(server.url), KEYS, "wa", "m", 600)
            a.setup()
            enqueue(r, 1)
            (p,) = a.pull(1, None)
            assert not a.mark_running([p])
            if final:  # a first write, so that the final goes through the step script
                assert not a.emit([Emission("r0", p.entry_id, OutputMessage(0, [1]), CHANNEL)])
            r.hset(KEYS.req("r0"), "entry", "0-999")
            msg = OutputMessage(int(final), [2], finish_reason="length" if final else None)
            refused = a.emit([Emission("r0", p.entry_id, msg, CHANNEL)])
            assert [(x.request_id, x.owner) for x in refused] == [("r0", "wa")]
            assert r.xlen(KEYS.requests("m")) == 0
            assert r.xpending(KEYS.requests("m"), GROUP)["pending"] == 0
            assert recorded(r, "r0") == ([1] if final else [])
