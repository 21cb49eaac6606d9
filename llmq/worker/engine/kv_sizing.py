"""How many KV cache blocks a worker allocates, and why: a pure function of the model's numbers
and the settings, so that the rule is tested without a model.

The pool must read as zeros (`runner/attention/paged.py`: masked-out slots are multiplied by zero
probabilities, and 0 * NaN is NaN). On the CPU it is anonymous memory, resident only once
written: a worker's RSS grows with the blocks its sequences and cached prefixes have used, up to
the pool (the least recently freed block is reused first, so a long-running worker fills it
with cached prefixes). On a GPU it is allocated whole. By default the pool is sized to what the
batch can use, within a budget; an explicit block count or memory budget is taken as given.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

from llmq.worker.engine.kv_groups import sequence_blocks

# The budget when none is set: the ceiling of the pool sized to need.
DEFAULT_KV_BUDGET_GB = 2.0
# Tokens per running sequence the default pool holds, where the model's context is longer: a full
# batch of 64 such sequences is four times the 192-256-token sequences of bench/compare.py's
# loads, the rest of the pool keeping repeated prompts' prefixes. The SmolLM2-135M shape
# (23,040 bytes of bfloat16 KV per token) then holds 1.41 GiB per worker instead of 2 GiB;
# a longer sequence still fits (the pool always holds one of max_model_len), and a batch of
# longer ones is preempted and resumed as blocks free up.
KV_TOKENS_PER_SEQUENCE = 1024


@dataclass(frozen=True, slots=True)
class KVPoolSize:
    num_blocks: int
    max_model_len: int  # the longest sequence: the model's limit, or what the pool holds
    reason: str  # for the log: which rule set the size


def kv_pool_size(
    *,
    bytes_per_block: int,
    block_size: int,
    model_limit: int,
    max_model_len: int | None,
    max_batch_size: int,
    num_blocks: int | None,
    kv_cache_memory_gb: float | None,
    group_windows: Seq[int | None] = (None,),
    max_chunk_tokens: int = 1,
) -> KVPoolSize:
    """The pool for a model whose context is ``model_limit`` tokens and whose block of
    ``block_size`` tokens takes ``bytes_per_block`` bytes. ``num_blocks`` (LLMQ_KV_BLOCKS) wins,
    then ``kv_cache_memory_gb`` (the pool fills that budget); with neither, the pool holds
    ``max_batch_size`` sequences of min(max_model_len, KV_TOKENS_PER_SEQUENCE) tokens, and at
    least one of max_model_len, within DEFAULT_KV_BUDGET_GB.

    ``group_windows``: per KV group (``engine/kv_groups.py``), its sliding window (None: full
    attention), a block holding one group's layers; a sliding group counts a sequence's
    blocks at most up to its window (and a prefill chunk of ``max_chunk_tokens`` tokens, for
    the one longest sequence)."""
    max_len = min(max_model_len or model_limit, model_limit)
    if num_blocks is not None:
        blocks, reason = num_blocks, f"LLMQ_KV_BLOCKS={num_blocks}"
    elif kv_cache_memory_gb is not None:
        blocks = int(kv_cache_memory_gb * 2**30) // bytes_per_block
        reason = f"the LLMQ_KV_CACHE_MEMORY_GB={kv_cache_memory_gb:g} budget"
    else:
        per_seq = min(max_len, KV_TOKENS_PER_SEQUENCE)
        need = max(
            max_batch_size * sequence_blocks(group_windows, per_seq, block_size),
            sequence_blocks(group_windows, max_len, block_size, max_chunk_tokens),
        )
        budget = int(DEFAULT_KV_BUDGET_GB * 2**30) // bytes_per_block
        blocks = min(need, budget)
        reason = (
            f"{max_batch_size} sequences (LLMQ_MAX_BATCH_SIZE) x {per_seq} tokens "
            f"(min of max_model_len {max_len} and {KV_TOKENS_PER_SEQUENCE}), at least one "
            f"sequence of {max_len}"
        )
        if budget < need:
            reason += f": {need} blocks, capped by the default {DEFAULT_KV_BUDGET_GB:g} GiB budget"
    blocks = max(1, blocks)
    # One sequence alone must always fit, or it could preempt itself forever.
    fits = _longest_fitting(group_windows, blocks, block_size, max_len, max_chunk_tokens)
    return KVPoolSize(blocks, fits, reason)


def _longest_fitting(
    windows: Seq[int | None], blocks: int, block_size: int, max_len: int, chunk: int
) -> int:
    """The longest sequence (at most ``max_len``) whose blocks fit in ``blocks``."""
    if tuple(windows) == (None,):
        return min(max_len, blocks * block_size)
    lo, hi = 0, max_len  # fits(lo); binary search on tokens
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if sequence_blocks(windows, mid, block_size, min(chunk, mid)) <= blocks:
            lo = mid
        else:
            hi = mid - 1
    return lo
