"""The engines of the speculation tests and what they are checked on: the tiny Llama in float32,
with a proposer attached or a draft model configured, the same prompts run through each, and
the tokens and logprobs compared with those of an engine without speculation."""

from __future__ import annotations

import random

import pytest

from llmq.common.model_files import load_tokenizer
from llmq.common.sampling_params import SamplingParams
from llmq.worker.llm_engine import EngineConfig, LLMEngine
from llmq.worker.loading.model_loader import load_causal_lm
from llmq.worker.spec.config import SpecConfig
from llmq.worker.spec.speculator import Speculator

GREEDY = dict(temperature=0, ignore_eos=True, logprobs=2)
# Seeded draws with every kind of processing: the same uniforms with or without speculation.
SAMPLED = dict(
    temperature=0.9,
    top_k=40,
    top_p=0.95,
    min_p=0.02,
    repetition_penalty=1.2,
    presence_penalty=0.3,
    frequency_penalty=0.2,
    ignore_eos=True,
    logprobs=1,
)


def prompts_and_lengths(seed: int = 55, vocab: int = 1024) -> tuple[list, list[int]]:
    """Eight random prompts (two sharing a 40-token start) and each one's max_tokens."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab) for _ in range(40)]
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(3, 70))] for _ in range(6)]
    prompts += [shared + [rng.randrange(3, vocab) for _ in range(n)] for n in (2, 9)]
    return prompts, [rng.randint(12, 30) for _ in prompts]


def build(path, proposer=None, draft=None, **config) -> LLMEngine:
    """The engine of the float32 model at ``path``: without speculation, with ``proposer``
    attached (4 tokens a draft), or drafting with the model at ``draft`` (every step)."""
    model = load_causal_lm(str(path), "float32", "cpu")
    if draft is not None:
        spec = SpecConfig(method="draft", draft_model=str(draft), dtype="float32", device="cpu")
        spec.max_batch = 64  # every step drafts
        config = {"speculative": spec, **config}
        return LLMEngine(model, EngineConfig(**config), tokenizer=load_tokenizer(str(path)))
    engine = LLMEngine(model, EngineConfig(**config))
    if proposer is not None:
        engine.speculator = Speculator(proposer, 4, 64, engine.max_model_len)
    return engine


def drive(engine, prompts, max_tokens, params, repeat=1):
    """Each prompt's tokens and logprobs (the last of ``repeat`` rounds), the block pool's
    invariants checked after every step and its blocks all given back at the end."""
    for r in range(repeat):
        ids = []
        for i, (prompt, n) in enumerate(zip(prompts, max_tokens, strict=True)):
            p = SamplingParams(max_tokens=n, seed=i, **params)
            ids.append(engine.add_request(f"{r}-{i}", prompt, p).request_id)
        tokens = {i: [] for i in ids}
        logprobs = {i: [] for i in ids}
        while engine.has_unfinished():
            for out in engine.step():
                tokens[out.request_id] += out.token_ids
                logprobs[out.request_id] += [lp.logprob for lp in out.logprobs or []]
                assert len(logprobs[out.request_id]) == len(tokens[out.request_id])
            engine.block_manager.check_invariants(list(engine.requests.values()))
    assert engine.block_manager.num_used_blocks == 0
    return [tokens[i] for i in ids], [logprobs[i] for i in ids]


def run(path, prompts, max_tokens, params, proposer=None, repeat=1, **config):
    """Each prompt's tokens and logprobs (the last of ``repeat`` rounds), and the engine."""
    engine = build(path, proposer, **config)
    return *drive(engine, prompts, max_tokens, params, repeat), engine


def assert_same(base, spec, engine):
    (b_tokens, b_logprobs), (s_tokens, s_logprobs) = base, spec
    assert s_tokens == b_tokens
    for b, s in zip(b_logprobs, s_logprobs, strict=True):
        assert s == pytest.approx(b, abs=1e-4)
    stats = engine.speculator.stats
    assert 0 < stats.accepted < stats.proposed, stats  # drafts were kept, and some rejected
