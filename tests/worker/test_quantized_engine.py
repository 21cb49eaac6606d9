"""A quantized model's greedy output in the engine equals the same quantized model stepped on
each prompt alone, token for token, whatever shares its batch: under preemption, chunked
prefill, the prefix cache and torch's ops in place of llmq's C++ ones (the prompts and arrival
schedule of ``test_engine_exact``)."""

from __future__ import annotations

import pytest
import torch

from llmq.common.sampling_params import SamplingParams
from llmq.worker.llm_engine import EngineConfig, LLMEngine
from llmq.worker.loading.model_loader import load_causal_lm
from tests.worker.test_engine_exact import EOS, drive, make_prompts

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VARIANTS = {
    "preemption": EngineConfig(num_blocks=16, max_batch_tokens=512),
    "tight": EngineConfig(num_blocks=16, max_batch_size=4, max_batch_tokens=40),
    "prefix_cache": EngineConfig(num_blocks=256),
    "torch_ops": EngineConfig(num_blocks=16, max_batch_tokens=40, cpu_kernels=False),
}


def _engine(path: str, scheme: str, config: EngineConfig) -> LLMEngine:
    return LLMEngine(load_causal_lm(path, "float32", "cpu", scheme), config, eos_token_ids={EOS})


def _each_alone(engine: LLMEngine, prompts, max_tokens) -> list[list[int]]:
    return [
        engine.generate([p], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0]
        for p, n in zip(prompts, max_tokens, strict=True)
    ]


@pytest.fixture(scope="module", params=["int8", "int4", "fp8"])
def alone(request, llama_dir):
    """(scheme, path, prompts, max_tokens, each prompt's tokens stepped alone: with llmq's C++
    ops, and with torch's)."""
    path = str(llama_dir)
    engine = _engine(path, request.param, EngineConfig(num_blocks=64))
    prompts, max_tokens = make_prompts(engine.runner.model.config.vocab_size)
    expected = {True: _each_alone(engine, prompts, max_tokens)}
    engine = _engine(path, request.param, EngineConfig(num_blocks=64, cpu_kernels=False))
    expected[False] = _each_alone(engine, prompts, max_tokens)
    return request.param, path, prompts, max_tokens, expected


def test_quantized_outputs_are_varied(alone):
    _, _, _, max_tokens, expected = alone
    expected = expected[True]
    for tokens, n in zip(expected, max_tokens, strict=True):
        assert len(tokens) == n and len(set(tokens)) >= n // 2, tokens
    assert len({tuple(t) for t in expected}) == len(expected)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_batched_quantized_steps_equal_each_prompt_alone(alone, variant):
    scheme, path, prompts, max_tokens, expected = alone
    config = VARIANTS[variant]
    expected = expected[config.cpu_kernels]  # torch's ops round otherwise than llmq's
    engine = _engine(path, scheme, config)
    assert engine.runner.forward.layout == scheme
    results, _, cached = drive(engine, prompts, max_tokens)
    mismatched = [i for i in range(len(prompts)) if results[str(i)] != expected[i]]
    assert not mismatched, [(i, expected[i], results[str(i)]) for i in mismatched[:3]]
    if variant in ("preemption", "tight", "torch_ops"):
        assert engine.scheduler.num_preemptions > 0
    if variant == "prefix_cache":
        assert max(cached.values()) >= 96  # the shared 100-token prefix was reused


def test_quantized_weights_need_the_fast_forward(llama_dir):
    config = EngineConfig(num_blocks=16, fast_forward=False)
    with pytest.raises(ValueError, match="fast forward"):
        _engine(str(llama_dir), "int8", config)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("scheme", ["int8", "int4", "fp8"])
def test_cuda_quantized_graph_steps_equal_each_prompt_alone(llama_dir, scheme):
    """On a GPU (tinygemm's int4, W8A8 int8 and fp8): batched steps, decode steps replayed
    from CUDA graphs, preemption and prefix hits give each prompt's tokens stepped alone."""
    path = str(llama_dir)

    def engine(config: EngineConfig) -> LLMEngine:
        model = load_causal_lm(path, "float32", "cuda", scheme)
        return LLMEngine(model, config, eos_token_ids={EOS})

    alone = engine(EngineConfig(num_blocks=64, cuda_graphs=False))
    prompts, max_tokens = make_prompts(alone.runner.model.config.vocab_size)
    expected = _each_alone(alone, prompts, max_tokens)
    assert len({tuple(t) for t in expected}) == len(expected)
    for config in (VARIANTS["preemption"], VARIANTS["prefix_cache"]):
        batched = engine(config)
        assert batched.runner.forward.layout == scheme and batched.runner.graphs is not None
        results, _, _ = drive(batched, prompts, max_tokens)
        mismatched = [i for i in range(len(prompts)) if results[str(i)] != expected[i]]
        assert not mismatched, [(i, expected[i], results[str(i)]) for i in mismatched[:3]]
        assert batched.runner.graphs.steps > 0
