"""An engine counts the other live engines on its model's stream while it looks for orphans
(``EngineTransport.live_peers``): with none, its loop pulls all it has room for. On a real
redis-server."""

from __future__ import annotations

import time

import pytest
import redis

from llmq.common.engine_status import EngineStatus
from llmq.common.protocol import EngineRequest
from llmq.common.transport import EngineTransport, Keys
from llmq.common.transport.keys import ENQUEUE_SCRIPT, GROUP
from llmq.common.transport.redis_server import RedisServer

KEYS = Keys()


def enqueue(r: redis.Redis, n: int) -> None:
    script = r.register_script(ENQUEUE_SCRIPT)
    for i in range(n):
        req = EngineRequest(f"r{i}", [1, 2], model="m", reply_to="c", created=time.time())
        args = [req.id, req.to_json(), 0, GROUP, req.created, "m", 600, "generate", "0", 1, "c"]
        script(keys=[KEYS.requests("m"), KEYS.req(req.id)], args=args)


@pytest.fixture
def server():
    with RedisServer() as s:
        yield s


def transport(server: RedisServer, name: str) -> EngineTransport:
    t = EngineTransport(redis.Redis.from_url(server.url), KEYS, name, "m", 600)
    t.setup()
    return t


def test_live_peers_counts_the_engines_with_a_heartbeat(server):
    wa, wb, wc, wd = (transport(server, n) for n in ("wa", "wb", "wc", "wd"))
    enqueue(redis.Redis.from_url(server.url), 4)
    for t in (wa, wb, wc, wd):  # each reads the stream once: a consumer of the group
        t.pull(1, None)
    assert wa.live_peers is None  # not counted yet
    wa.claim_orphans(60_000, 10)
    assert wa.live_peers == 0  # wb, wc, wd: no heartbeat
    wd.heartbeat(EngineStatus(model="m"), 30)
    # wb and wc hold an entry each with no heartbeat; a claim capped at one takes wb's and
    # still counts wd, listed after wc.
    claimed = wa.claim_orphans(0, 1)
    assert [p.request.id for p in claimed] == ["r1"]
    assert wa.live_peers == 1
    wd.remove_heartbeat()
    wa.claim_orphans(0, 10)
    assert wa.live_peers == 0
