"""The API's list of live engines, on an in-memory fake of the transport: cached for a second,
except that a model none of its cached engines serves is looked up again before the request is
refused (a worker that just came up, or back after a failover, serves it at once)."""

from __future__ import annotations

import asyncio

import pytest

from llmq.common.engine_client.pipeline import TokenGeneratorPipeline
from llmq.common.engine_status import EngineStatus
from llmq.common.errors import Unavailable

pytestmark = pytest.mark.unit


class Transport:
    def __init__(self):
        self.live: list[EngineStatus] = []
        self.reads = 0

    async def engines(self) -> list[EngineStatus]:
        self.reads += 1
        return list(self.live)


def test_a_worker_up_within_the_cached_second_serves_at_once():
    transport = Transport()
    pipeline = TokenGeneratorPipeline(transport, tokenizer=None, model="m")

    async def scenario() -> None:
        with pytest.raises(Unavailable):
            await pipeline.require_engine("m")
        transport.live = [EngineStatus(model="m", worker="w1")]
        assert (await pipeline.require_engine("m")).worker == "w1"
        reads = transport.reads
        assert (await pipeline.require_engine("m")).worker == "w1"
        assert transport.reads == reads  # a model served: the cached list answers

    asyncio.run(scenario())
