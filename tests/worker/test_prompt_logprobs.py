"""Prompt logprobs in the engine: every prompt token's logprob, rank and top k equal
``model(input_ids).logits.log_softmax(-1)`` of transformers in float32, whatever the chunking
of the prefill, with a prefix cache that already holds the prompt, after a preemption, and
for ``max_tokens`` 0 (the prompt alone, no token)."""

from __future__ import annotations

import random

import pytest
import torch

from llmq.common.sampling_params import SamplingParams
from llmq.worker.engine.sequence import FinishReason
from llmq.worker.llm_engine import EngineConfig, LLMEngine
from llmq.worker.loading.model_loader import load_causal_lm

pytestmark = pytest.mark.unit

K = 3
TOL = 1e-4


@pytest.fixture(scope="module")
def reference(llama_dir):
    return load_causal_lm(str(llama_dir), "float32", "cpu")


def expected(model, prompt: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logits = model(torch.tensor([prompt])).logits[0].float()
    return logits.log_softmax(-1)


def run(engine: LLMEngine, prompts: dict[str, list[int]], max_tokens: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, prompt_logprobs=K)
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params)
    firsts: dict[str, object] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.prompt_logprobs is not None:
                assert out.request_id not in firsts  # sent once, with the first output
                firsts[out.request_id] = out
            else:
                assert out.request_id in firsts
    return firsts


def check(entries: list, logp: torch.Tensor, prompt: list[int]) -> None:
    assert len(entries) == len(prompt) and entries[0] is None
    for i, e in enumerate(entries[1:], start=1):
        row = logp[i - 1]
        assert e["token_id"] == prompt[i]
        assert abs(e["logprob"] - row[prompt[i]].item()) < TOL
        assert e["rank"] == int((row > row[prompt[i]]).sum()) + 1
        top_vals, top_ids = row.topk(K)
        assert [t for t, _ in e["top"]] == top_ids.tolist()
        assert max(abs(v - w) for (_, v), w in zip(e["top"], top_vals.tolist(), strict=True)) < TOL


@pytest.mark.parametrize(
    "config",
    [
        dict(num_blocks=256),
        dict(num_blocks=256, max_batch_tokens=24, max_batch_size=4),  # chunked prefill
        dict(num_blocks=8, max_batch_size=4),  # preemption
    ],
    ids=["whole", "chunked", "preempted"],
)
def test_prompt_logprobs_equal_transformers(llama_dir, reference, config):
    model = load_causal_lm(str(llama_dir), "float32", "cpu")
    engine = LLMEngine(model, EngineConfig(cuda_graphs=False, **config))
    rng = random.Random(7)
    vocab = engine.vocab_size
    shared = [rng.randrange(3, vocab) for _ in range(40)]
    prompts = {
        "one": [5],
        "short": [rng.randrange(3, vocab) for _ in range(9)],
        "long": [rng.randrange(3, vocab) for _ in range(70)],
        "shared": shared,
    }
    # The prefix cache holds "shared" already: its rows are computed again all the same.
    engine.generate([shared + [7, 8]], SamplingParams(temperature=0.0, max_tokens=2))
    firsts = run(engine, prompts, max_tokens=12)
    for rid, prompt in prompts.items():
        check(firsts[rid].prompt_logprobs, expected(reference, prompt), prompt)
        assert len(firsts[rid].token_ids) == 1
    assert engine.block_manager.num_used_blocks == 0
    assert (engine.scheduler.num_preemptions > 0) == (config["num_blocks"] == 8)


def test_max_tokens_0_scores_the_prompt_and_generates_nothing(llama_dir, reference):
    model = load_causal_lm(str(llama_dir), "float32", "cpu")
    engine = LLMEngine(model, EngineConfig(num_blocks=64, cuda_graphs=False))
    prompt = list(range(10, 40))
    out = run(engine, {"p": prompt}, max_tokens=0)["p"]
    assert out.token_ids == [] and out.finish_reason == FinishReason.LENGTH
    assert out.num_output_tokens == 0 and out.num_prompt_tokens == len(prompt)
    check(out.prompt_logprobs, expected(reference, prompt), prompt)
    assert not engine.has_unfinished() and engine.block_manager.num_used_blocks == 0


def test_a_resumed_request_does_not_score_its_prompt_again(llama_dir):
    """Resumed after output (its first message, with the prompt logprobs, was recorded): its
    prompt comes from the prefix cache as any other's, and no prompt logprobs are sent."""
    model = load_causal_lm(str(llama_dir), "float32", "cpu")
    engine = LLMEngine(model, EngineConfig(num_blocks=64, cuda_graphs=False))
    params = SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=K)
    seq = engine.add_request("r", list(range(10, 30)), params, output_token_ids=[7, 8])
    assert not seq.prompt_logprobs_pending
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert [o.prompt_logprobs for o in outs] == [None, None]
