"""Prompt logprobs are recorded with their request (real redis-server): a client that missed the
first message gets them from the record, and only with the output's start."""

from __future__ import annotations

import asyncio

import redis

from llmq.common.protocol import EngineRequest, OutputMessage
from llmq.common.sampling_params import SamplingParams
from llmq.common.transport import Emission, EngineTransport, Keys, PulledRequest
from llmq.common.transport.redis_server import RedisServer
from tests.pipeline_client import open_pipeline


def test_a_missed_first_message_brings_its_prompt_logprobs_back(llama_dir):
    prompt = [None, {"token_id": 2, "logprob": -1.5, "rank": 3, "top": [[9, -0.1]]}]
    with RedisServer() as server:

        async def run():
            async with open_pipeline(server.url, llama_dir) as p:
                engine = EngineTransport(redis.Redis.from_url(server.url), Keys(), "w", "m", 60)
                params = SamplingParams(max_tokens=3, prompt_logprobs=1)
                asked = EngineRequest(id="plp", prompt_token_ids=[1, 2], params=params)
                first = OutputMessage(index=0, tokens=[5], prompt_logprobs=prompt)
                assert not engine.mark_running([PulledRequest("0-1", asked, [])])
                engine.emit([Emission("plp", "0-1", first)])  # nobody subscribed: missed
                engine.emit([Emission("plp", "0-1", OutputMessage(index=1, tokens=[6]))])
                return await p.output.recover(asked, 0), await p.output.recover(asked, 1)

        (whole, _, _), (tail, _, _) = asyncio.run(run())
    assert whole.tokens == [5, 6] and whole.prompt_logprobs == prompt
    assert tail.tokens == [6] and tail.prompt_logprobs is None
