"""The inactivity timeout of a running request, on an in-memory fake of the reader's seams
(the request's record, the live engines): a request whose worker keeps stepping is in service
however long its first token takes (a long prefill, others' before it); one whose worker stops
stepping fails with ``inactivity_timeout``."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest

from llmq.common.engine_client import request_output
from llmq.common.engine_client.request_output import OutputReader
from llmq.common.engine_status import EngineStatus
from llmq.common.errors import DeadlineExceeded
from llmq.common.protocol import EngineRequest, OutputMessage
from llmq.common.sampling_params import SamplingParams

TIMEOUT = 0.2  # seconds of inactivity
SILENT = 3 * TIMEOUT  # seconds before the output comes


class Record:
    """The request's record: running on w1, no tokens yet."""

    async def request_state(self, request_id: str, model: str, logprobs: bool = False):
        return {"state": "running", "worker": "w1"}, [], []


def _reader(steps, queue: asyncio.Queue) -> OutputReader:
    started = time.monotonic()

    async def engines(max_age: float) -> list[EngineStatus]:
        if time.monotonic() - started > SILENT and queue.empty():  # long past the timeout
            queue.put_nowait(OutputMessage(index=0, tokens=[7], finish_reason="length"))
        return [EngineStatus(model="m", worker="w1", steps_total=next(steps))]

    return OutputReader(Record(), engines, inactivity_timeout=TIMEOUT)


async def _read(steps) -> list[OutputMessage]:
    queue: asyncio.Queue = asyncio.Queue()
    params = SamplingParams(max_tokens=1)
    request = EngineRequest(
        id="r", prompt_token_ids=[1, 2], params=params, model="m", deadline=time.time() + 60
    )
    return [m async for m in _reader(steps, queue).messages(request, queue)]


@pytest.fixture(autouse=True)
def fast_polls(monkeypatch):
    monkeypatch.setattr(request_output, "_POLL", 0.02)
    monkeypatch.setattr(request_output, "_LIVENESS_AGE", 0.0)


@pytest.mark.unit
def test_a_request_on_a_stepping_worker_waits_past_the_inactivity_timeout():
    started = time.monotonic()
    messages = asyncio.run(_read(itertools.count()))
    assert time.monotonic() - started > SILENT
    assert [m.tokens for m in messages] == [[7]]


@pytest.mark.unit
def test_a_request_on_a_worker_that_stopped_stepping_fails_as_inactive():
    with pytest.raises(DeadlineExceeded) as raised:
        asyncio.run(_read(itertools.repeat(5)))
    assert raised.value.code == "inactivity_timeout"
