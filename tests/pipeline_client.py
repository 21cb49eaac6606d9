"""The engines' client for integration tests: a TokenGeneratorPipeline on its own Redis
connection, random prompts, the name of a model's request stream, and the in-process engine
whose greedy tokens the workers must reproduce."""

from __future__ import annotations

import contextlib
import random

import redis.asyncio as aioredis

from llmq.common.engine_client.pipeline import TokenGeneratorPipeline
from llmq.common.model_files import load_tokenizer
from llmq.common.sampling_params import SamplingParams
from llmq.common.transport import AsyncTransport, Keys
from llmq.worker.loading.model_loader import eos_token_ids, load_causal_lm

GREEDY = dict(temperature=0.0, ignore_eos=True)


def greedy_reference(model_dir, num_blocks: int = 2048):
    """The in-process engine: run(prompts, max_tokens) -> each prompt's greedy tokens."""
    from llmq.worker.llm_engine import EngineConfig, LLMEngine

    model = load_causal_lm(str(model_dir), "float32", "cpu")
    tok = load_tokenizer(str(model_dir))
    engine = LLMEngine(model, EngineConfig(num_blocks=num_blocks), eos_token_ids(model, tok))

    def run(batch: list[list[int]], max_tokens: int) -> list[list[int]]:
        return engine.generate(batch, SamplingParams(max_tokens=max_tokens, **GREEDY))

    return run


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
