"""Decode steps replayed from CUDA graphs give ``generate``'s tokens (needs a CUDA GPU).

The engine's exactness load (tests/worker/test_engine_exact.py: 16 prompts arriving while others
decode) on the GPU in float32 with graphs on, against ``model.generate`` on the same GPU:
batches and contexts change every few steps, so many (batch, blocks) buckets are captured and
replayed, beside chunked prefills and preemption."""

from __future__ import annotations

import pytest
import torch

from llmq.worker.llm_engine import EngineConfig, LLMEngine
from llmq.worker.loading.model_loader import load_causal_lm
from tests.worker.test_engine_exact import EOS, drive, reference_outputs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

VARIANTS = {
    "plain": EngineConfig(num_blocks=256, enable_prefix_caching=False),
    "preemption": EngineConfig(num_blocks=16, max_batch_tokens=512),
    "odd_blocks": EngineConfig(block_size=3, num_blocks=80, max_batch_tokens=50),
    "prefix_cache": EngineConfig(num_blocks=256, max_batch_size=6),
}


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def gpu_case(request):
    path = str(request.getfixturevalue(f"{request.param}_dir"))
    _, prompts, max_tokens, expected = reference_outputs(path, "cuda")
    return path, prompts, max_tokens, expected


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_decode_graphs_give_generates_tokens(gpu_case, variant):
    path, prompts, max_tokens, expected = gpu_case
    engine = LLMEngine(
        load_causal_lm(path, "float32", "cuda"), VARIANTS[variant], eos_token_ids={EOS}
    )
    graphs = engine.runner.graphs
    assert graphs is not None
    results, _, _ = drive(engine, prompts, max_tokens)
    mismatched = [i for i in range(len(prompts)) if results[str(i)] != expected[i]]
    assert not mismatched, [(i, expected[i], results[str(i)]) for i in mismatched[:3]]
    # Most steps were decode-only and ran as graphs, over several shapes.
    assert graphs.steps >= engine.num_steps // 2, (graphs.steps, engine.num_steps)
    assert len(graphs.graphs) >= 4, sorted(graphs.graphs)


def test_graphs_off_is_the_eager_path(llama_dir):
    config = EngineConfig(num_blocks=64, cuda_graphs=False)
    engine = LLMEngine(load_causal_lm(str(llama_dir), "float32", "cuda"), config)
    assert engine.runner.graphs is None
