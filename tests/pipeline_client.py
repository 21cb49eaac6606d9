"""The engines' client for integration tests: a TokenGeneratorPipeline on its own Redis
connection, random prompts, and the name of a model's request stream."""

from __future__ import annotations

import contextlib
import random

import redis.asyncio as aioredis

from llmq.common.model_loader import load_tokenizer
from llmq.common.pipeline import TokenGeneratorPipeline
from llmq.common.transport import AsyncTransport, Keys


def stream_of(model_dir) -> str:
    return Keys().requests(str(model_dir))


@contextlib.asynccontextmanager
async def open_pipeline(url: str, model_dir, **kwargs):
    client = aioredis.Redis.from_url(url)
    transport = AsyncTransport(client, Keys())
    pipeline = TokenGeneratorPipeline(
        transport, load_tokenizer(model_dir), str(model_dir), **kwargs
    )
    try:
        yield pipeline
    finally:
        await transport.close()
        await client.aclose()


def prompts(n: int, seed: int = 0, lo: int = 1, hi: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
