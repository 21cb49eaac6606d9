"""KV groups of models with sliding windows and the pool sized with them: pure, no torch."""

from __future__ import annotations

import pytest

from llmq.worker.engine.kv_groups import kv_layout, sequence_blocks, window_bound
from llmq.worker.engine.kv_sizing import kv_pool_size

pytestmark = pytest.mark.unit

GEMMA3_1B = [None if (i + 1) % 6 == 0 else 512 for i in range(26)]  # 22 local, 4 global


def test_layers_group_by_window_in_groups_of_the_fewest():
    layout = kv_layout(GEMMA3_1B, max_model_len=32768)
    assert layout.width == 4  # the 4 global layers: one group; the 22 local: six (two slots idle)
    assert [g.window for g in layout.groups].count(None) == 1
    assert [g.window for g in layout.groups].count(512) == 6
    slots = layout.layer_slots()
    for g, group in enumerate(layout.groups):
        for slot, layer in enumerate(group.layers):
            assert layout.layer_group(layer) == g and slots[layer] == slot
    assert sorted(x for g in layout.groups for x in g.layers) == list(range(26))


def test_no_window_shorter_than_the_context_is_no_layout():
    assert kv_layout([None, None], 4096) is None
    assert kv_layout([4096, None], 4096) is None  # covers every key a query can see
    mistral = kv_layout([256, 256], 4096)
    assert mistral.width == 2 and mistral.windows == (256,)


def test_a_sliding_group_counts_at_most_its_window():
    assert window_bound(1024, 16) == 65  # ceil(1024 / 16) + 1
    assert window_bound(1024, 16, chunk_tokens=512) == 97
    assert sequence_blocks((1024, None), 16000, 16) == 65 + 1000
    assert sequence_blocks((1024, None), 100, 16) == 2 * 7  # shorter than the window: all


def test_the_pool_is_sized_with_the_windows():
    common = dict(
        bytes_per_block=2 * 64 * 16 * 2,
        block_size=16,
        model_limit=32768,
        max_model_len=None,
        max_batch_size=4,
        kv_cache_memory_gb=None,
        max_chunk_tokens=512,
    )
    windows = (1024,) * 5 + (None,)
    sized = kv_pool_size(num_blocks=None, group_windows=windows, **common)
    # 4 sequences of 1,024 tokens (64 blocks in each group), or one of 32,768 (its 2,048 global
    # blocks and 97 per local group, a prefill chunk in flight): the larger.
    assert sized.num_blocks == max(4 * 6 * 64, 2048 + 5 * 97) and sized.max_model_len == 32768
    # A pool given in blocks: the longest sequence that fits alone, with its windows.
    given = kv_pool_size(num_blocks=1485, group_windows=windows, **common)
    assert given.max_model_len == 16000
    plain = kv_pool_size(num_blocks=1485, **common)
    assert plain.max_model_len == 1485 * 16
