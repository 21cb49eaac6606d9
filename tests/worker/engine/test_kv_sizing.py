"""The KV pool's size: sized to the batch by default, capped by the default budget, at least one
full-length sequence; an explicit block count or budget taken as given. Numbers injected; one
test builds a real engine to check that it allocates what the rule says."""

from __future__ import annotations

import logging

import pytest

from llmq.common.settings import Settings
from llmq.worker.engine.kv_sizing import (
    DEFAULT_KV_BUDGET_GB,
    KV_TOKENS_PER_SEQUENCE,
    KVPoolSize,
    kv_pool_size,
)
from llmq.worker.llm_engine import EngineConfig, LLMEngine
from llmq.worker.loading.model_loader import load_causal_lm

GIB = 2**30
# SmolLM2-135M in bfloat16: 30 layers x 3 KV heads x 64 dims, keys and values, 2 bytes.
SMOL_BLOCK = 2 * 30 * 3 * 64 * 2 * 16
# A Llama-7B-shaped model in float16: 32 layers x 32 KV heads x 128 dims (8 MiB a block).
BIG_BLOCK = 2 * 32 * 32 * 128 * 2 * 16


def size(**kw) -> KVPoolSize:
    args = dict(
        bytes_per_block=SMOL_BLOCK,
        block_size=16,
        model_limit=8192,
        max_model_len=None,
        max_batch_size=64,
        num_blocks=None,
        kv_cache_memory_gb=None,
    )
    return kv_pool_size(**(args | kw))


@pytest.mark.unit
def test_a_small_model_gets_its_batch_not_the_budget():
    pool = size()
    assert KV_TOKENS_PER_SEQUENCE == 1024
    assert pool.num_blocks == 64 * 1024 // 16 == 4096
    assert pool.max_model_len == 8192
    assert pool.num_blocks * SMOL_BLOCK / GIB == pytest.approx(1.406, abs=0.001)
    assert "64 sequences" in pool.reason and "capped" not in pool.reason


@pytest.mark.unit
def test_a_shorter_context_or_batch_shrinks_the_pool():
    assert size(max_model_len=256).num_blocks == 64 * 16
    assert size(model_limit=512).num_blocks == 64 * 32
    # A model's limit bounds max_model_len as set.
    assert size(model_limit=512, max_model_len=4096).max_model_len == 512
    assert size(max_batch_size=8).num_blocks == 8 * 64


@pytest.mark.unit
def test_one_full_length_sequence_always_fits_when_the_budget_allows():
    pool = size(max_batch_size=1)
    assert pool.num_blocks == 8192 // 16
    assert pool.max_model_len == 8192


@pytest.mark.unit
def test_a_big_model_is_capped_by_the_default_budget():
    pool = size(bytes_per_block=BIG_BLOCK, model_limit=4096)
    assert pool.num_blocks == int(DEFAULT_KV_BUDGET_GB * GIB) // BIG_BLOCK == 256
    assert pool.max_model_len == 4096
    assert "capped by the default 2 GiB budget" in pool.reason
    # Where the budget holds less than one sequence, the context shrinks to what it holds.
    long = size(bytes_per_block=BIG_BLOCK, model_limit=32768)
    assert long.num_blocks == 256 and long.max_model_len == 256 * 16


@pytest.mark.unit
def test_explicit_settings_win():
    blocks = size(num_blocks=100, kv_cache_memory_gb=8.0)
    assert (blocks.num_blocks, blocks.max_model_len) == (100, 1600)
    assert blocks.reason == "LLMQ_KV_BLOCKS=100"
    # An explicit budget is filled, even past what the batch needs (the default stops at 4096).
    budget = size(kv_cache_memory_gb=4.0)
    assert budget.num_blocks == 4 * GIB // SMOL_BLOCK == 11650
    assert budget.reason == "the LLMQ_KV_CACHE_MEMORY_GB=4 budget"
    assert size(kv_cache_memory_gb=1e-9).num_blocks == 1


@pytest.mark.unit
def test_settings_default_to_sizing_by_need(monkeypatch):
    monkeypatch.delenv("LLMQ_KV_CACHE_MEMORY_GB", raising=False)
    monkeypatch.delenv("LLMQ_KV_BLOCKS", raising=False)
    config = EngineConfig.from_settings(Settings(_env_file=None))
    assert (config.num_blocks, config.kv_cache_memory_gb) == (None, None)
    monkeypatch.setenv("LLMQ_KV_CACHE_MEMORY_GB", "0.5")
    assert EngineConfig.from_settings(Settings(_env_file=None)).kv_cache_memory_gb == 0.5


def test_the_engine_allocates_the_sized_pool(llama_dir, caplog):
    """A real engine on the tiny model: its pool tensor holds exactly the blocks the rule gives
    (a batch of 4 sequences of min(context, 1024) tokens) and the runner's scratch block, and
    the log says why."""
    model = load_causal_lm(str(llama_dir), "float32", "cpu")
    limit = model.config.max_position_embeddings
    with caplog.at_level(logging.INFO, logger="llmq.worker.llm_engine"):
        engine = LLMEngine(model, EngineConfig(max_batch_size=4, cuda_graphs=False))
    per_seq = min(limit, KV_TOKENS_PER_SEQUENCE)
    assert engine.num_blocks == max(4 * -(-per_seq // 16), -(-limit // 16))
    assert engine.runner.pool.kv.shape[2] == (engine.num_blocks + 1) * 16
    assert engine.max_model_len == limit
    assert any("4 sequences (LLMQ_MAX_BATCH_SIZE)" in r.getMessage() for r in caplog.records)
    explicit = LLMEngine(model, EngineConfig(num_blocks=7, cuda_graphs=False))
    assert explicit.runner.pool.kv.shape[2] == (7 + 1) * 16
