"""The engine's KV cache as a model asks for it: what its attention needs (or why it is
refused), its KV groups where it has sliding windows (``engine/kv_groups.py``), the pool's size
(``engine/kv_sizing.py``) and the block manager that keeps it."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

from llmq.worker.engine.block_manager import BlockManager
from llmq.worker.engine.kv_groups import KVLayout, kv_layout
from llmq.worker.engine.kv_sizing import KVPoolSize, kv_pool_size
from llmq.worker.engine.windowed_blocks import WindowedBlockManager

if TYPE_CHECKING:
    from llmq.worker.runner.forward.model_support import ModelFeatures

log = logging.getLogger(__name__)


class PoolConfig(Protocol):
    """The engine settings the pool is sized and kept by (llm_engine.EngineConfig has them),
    named here so that the engine imports this module and not the other way round."""

    block_size: int
    num_blocks: int | None
    kv_cache_memory_gb: float | None
    kv_cache_dtype: str
    max_batch_size: int
    max_batch_tokens: int
    max_model_len: int | None
    enable_prefix_caching: bool
    prefix_cache_share: float | None


# The prefix cache may always fill this fraction of the pool, however few blocks the busiest
# moment used (block_manager.py): 1/16 of the SmolLM2-135M-shaped pool is 250 blocks, 90 MB,
# the prompts of 8 lone requests of 128 + 64 tokens several times over.
CACHE_FLOOR_DIVISOR = 16


def inspect_ahead(model) -> None:
    """Inspect ``model`` now, for ``served_features``: before a forward built ahead of the
    engine (``worker/preload.py``) packs its weights, after which transformers' own forward,
    which the inspection runs, has none to read."""
    from llmq.worker.runner.forward.model_support import inspect_model

    model.__dict__["_llmq_features"] = inspect_model(model)


def served_features(model) -> ModelFeatures:
    """What ``model``'s attention needs; raises UnsupportedModel, naming what llmq does not
    implement, rather than serve a wrong answer."""
    from llmq.worker.runner.forward.model_support import UnsupportedModel, inspect_model

    features = model.__dict__.pop("_llmq_features", None) or inspect_model(model)
    if features.refusals:
        model_type = getattr(model.config.get_text_config(), "model_type", "unknown")
        error = UnsupportedModel(model_type, features.refusals)
        log.error("%s", error)
        raise error
    log.info("attention: %s", features)
    return features


def kv_pool_and_layout(
    model, config: PoolConfig, features: ModelFeatures
) -> tuple[KVPoolSize, KVLayout | None]:
    """The pool for ``model`` under ``config``, its keys and values as wide as ``features``
    (what its attention calls showed) says, and its KV groups. A window counts only while it
    is shorter than the context the pool gives, which the groups change: sized again until
    the two agree."""
    from llmq.worker.runner.attention.paged import KVPool
    from llmq.worker.runner.forward.model_support import pool_dims

    text_config = model.config.get_text_config()
    dtype = next(model.parameters()).dtype
    layers, kv_heads, head_dim = pool_dims(model.config, features)
    model_limit = getattr(text_config, "max_position_embeddings", None) or 2048
    max_len = min(config.max_model_len or model_limit, model_limit)
    while True:
        layout = kv_layout(features.layer_windows, max_len)
        width = layout.width if layout else layers
        pool = kv_pool_size(
            # An 8-bit cache (LLMQ_KV_CACHE_DTYPE): its codes and scales, so the same memory
            # holds about 2x the blocks of bfloat16, 4x of float32.
            bytes_per_block=KVPool.bytes_per_block(
                width, kv_heads, head_dim, config.block_size, dtype, config.kv_cache_dtype
            ),
            block_size=config.block_size,
            model_limit=model_limit,
            max_model_len=max_len,
            max_batch_size=config.max_batch_size,
            num_blocks=config.num_blocks,
            kv_cache_memory_gb=config.kv_cache_memory_gb,
            group_windows=layout.windows if layout else (None,),
            max_chunk_tokens=max(config.max_batch_tokens, config.max_batch_size),
        )
        if kv_layout(features.layer_windows, pool.max_model_len) == layout:
            return pool, layout
        max_len = pool.max_model_len


def block_manager(
    config: PoolConfig, num_blocks: int, layout: KVLayout | None, lazily_resident: bool
) -> BlockManager:
    """The block manager of the pool: one table per sequence, or one per KV group."""
    args = dict(
        num_blocks=num_blocks,
        block_size=config.block_size,
        enable_prefix_caching=config.enable_prefix_caching,
        # A pool allocated whole (GPU) costs the same cached or not.
        cache_share=config.prefix_cache_share if lazily_resident else None,
        cache_floor=num_blocks // CACHE_FLOOR_DIVISOR,
    )
    if layout is None:
        return BlockManager(**args)
    return WindowedBlockManager(windows=layout.windows, **args)
