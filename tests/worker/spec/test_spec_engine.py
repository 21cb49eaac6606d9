"""Speculative decoding is lossless in the engine: the same tokens (and logprobs) as without it,
greedy and seeded sampling with penalties, batched, chunked, preempted, from the prefix cache,
stopping exactly at a stop token or max_tokens inside an accepted run. Drafts come from a
proposer that knows the output and gets every fourth token wrong (tests/worker/spec/oracle.py),
so steps accept and reject; each test checks that both happened. Prompt lookup itself runs
once, on outputs a negative frequency penalty makes repeat themselves."""

from __future__ import annotations

import random

import pytest

from llmq.common.sampling_params import SamplingParams
from llmq.worker.llm_engine import EngineConfig, LLMEngine
from llmq.worker.loading.model_loader import load_causal_lm
from llmq.worker.spec.ngram import NgramProposer
from llmq.worker.spec.speculator import Speculator
from tests.worker.spec.engines import GREEDY, SAMPLED, assert_same, prompts_and_lengths, run
from tests.worker.spec.oracle import OracleProposer

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def case(llama_dir):
    return str(llama_dir), *prompts_and_lengths()


def oracle(prompts, outputs):
    return OracleProposer({tuple(p): o for p, o in zip(prompts, outputs, strict=True)}, 1024)


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "seeded-sampling"])
@pytest.mark.parametrize(
    "config",
    [
        {},
        {"num_blocks": 10},  # preempted and recomputed
        {"max_batch_tokens": 16, "max_batch_size": 4},  # chunked prefill, drafts within budget
    ],
    ids=["batched", "preempted", "chunked"],
)
def test_same_output_with_drafts(case, params, config):
    path, prompts, max_tokens = case
    tokens, logprobs, _ = run(path, prompts, max_tokens, params, **config)
    s_tokens, s_logprobs, engine = run(
        path, prompts, max_tokens, params, oracle(prompts, tokens), **config
    )
    assert_same((tokens, logprobs), (s_tokens, s_logprobs), engine)
    if "num_blocks" in config:
        assert engine.scheduler.num_preemptions > 0


def test_same_output_from_the_prefix_cache(case):
    """Prompts sent twice: the second round starts from blocks the first registered, which
    hold only accepted tokens."""
    path, prompts, max_tokens = case
    base = run(path, prompts, max_tokens, GREEDY)
    spec = run(path, prompts, max_tokens, GREEDY, oracle(prompts, base[0]), repeat=2)
    assert_same(base[:2], spec[:2], spec[2])
    assert spec[2].block_manager.prefix_hits > sum(len(p) for p in prompts) // 2


def test_stops_inside_an_accepted_run(case):
    """A stop token, or max_tokens, that falls inside a run of accepted drafts ends the output
    exactly there."""
    path, prompts, max_tokens = case
    full, _, _ = run(path, prompts, max_tokens, GREEDY)
    stops = [out[6] for out in full]  # drafts of four span it
    short = [min(n, 9) for n in max_tokens]
    for i, stop in enumerate(stops):
        params = dict(GREEDY, stop_token_ids=[stop])
        base = run(path, prompts[i : i + 1], max_tokens[i : i + 1], params)
        spec = run(path, prompts[i : i + 1], max_tokens[i : i + 1], params, oracle(prompts, full))
        assert spec[0] == base[0] and spec[0][0][-1] == stop
        assert len(spec[0][0]) <= 7
    base = run(path, prompts, short, GREEDY)
    spec = run(path, prompts, short, GREEDY, oracle(prompts, full))
    assert_same(base[:2], spec[:2], spec[2])


def test_prompt_lookup_in_the_engine(case):
    """Prompt lookup's own drafts: a negative frequency penalty (which every draft row must
    apply as it stands after the drafts before it) makes some outputs repeat themselves, and
    the proposer finds the repeats."""
    path, prompts, _ = case
    n = [60] * 4
    params = dict(GREEDY, frequency_penalty=-0.5)
    base = run(path, prompts[:4], n, params)
    spec = run(path, prompts[:4], n, params, NgramProposer(2, 3))
    assert_same(base[:2], spec[:2], spec[2])


def test_structured_output_with_drafts(llama_dir):
    """JSON-schema and regex requests draft too: a draft is cut at its first token the grammar
    forbids, every position is masked as the grammar stands there, and the output (greedy and
    seeded) is the same, ending where the grammar completes."""
    from llguidance import LLMatcher

    from llmq.common.model_files import load_tokenizer
    from llmq.worker.loading.model_loader import eos_token_ids
    from tests.worker.test_constrained_engine import PERSON, REGEX, json_grammar

    path = str(llama_dir)
    tokenizer = load_tokenizer(path)
    grammars = [json_grammar(PERSON), LLMatcher.grammar_from_regex(REGEX)]
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 1024) for _ in range(9)] for _ in range(4)]

    def outputs(proposer):
        model = load_causal_lm(path, "float32", "cpu")
        eos = eos_token_ids(model, tokenizer)
        engine = LLMEngine(model, EngineConfig(num_blocks=128), eos, tokenizer=tokenizer)
        if proposer is not None:
            engine.speculator = Speculator(proposer, 4, 64, engine.max_model_len)
        results = {}
        for i, prompt in enumerate(prompts):
            temperature = 0.0 if i % 2 else 1.0
            params = SamplingParams(
                temperature=temperature, seed=i, max_tokens=200, grammar=grammars[i // 2]
            )
            engine.add_request(str(i), prompt, params)
            results[str(i)] = []
        while engine.has_unfinished():
            for out in engine.step():
                assert out.error is None, out.error
                results[out.request_id] += out.token_ids
                if out.finished:
                    assert out.finish_reason.value == "stop"
        return [results[str(i)] for i in range(len(prompts))], engine

    base, _ = outputs(None)
    spec, engine = outputs(oracle(prompts, base))
    assert spec == base
    stats = engine.speculator.stats
    assert 0 < stats.accepted < stats.proposed, stats


def test_lora_adapters_with_drafts(lora_cases):
    """Requests under four LoRA adapters and the base model, with drafts: PEFT's tokens."""
    from tests.worker.lora_cases import ADAPTERS, drive, mismatches, mixed_requests

    names = ["", *ADAPTERS]
    lora = lora_cases("llama")
    outputs = {
        (name, tuple(p)): lora.expected[name][i]
        for name in names
        for i, p in enumerate(lora.prompts)
    }
    proposer = OracleProposer(
        outputs, 1024, key=lambda s: (s.lora.name if s.lora else "", tuple(s.prompt_token_ids))
    )
    model = load_causal_lm(lora.base, "float32", "cpu")
    engine = LLMEngine(model, EngineConfig(num_blocks=256), eos_token_ids={2})
    engine.speculator = Speculator(proposer, 4, 64, engine.max_model_len)
    result = drive(engine, mixed_requests(lora, names))
    assert not result.errors and not mismatches(lora, result, names)
    stats = engine.speculator.stats
    assert 0 < stats.accepted < stats.proposed, stats
