"""Under a LoRA adapter a sequence's block hashes chain from its root: for an adapter's first
folder, the chain the API computes for placement (``prompt_hashes(..., root=adapter_root(name))``);
no block is shared between adapters, with the base model, or with an adapter replaced under
the same name."""

from __future__ import annotations

import pytest

from llmq.common.placement.block_hashes import adapter_root, prompt_hashes
from llmq.worker.engine.block_manager import BlockManager
from llmq.worker.engine.sequence import LoraRef, Sequence
from llmq.worker.lora_pool import LoraPool

pytestmark = pytest.mark.unit

BS = 4
PROMPT = list(range(10, 30))  # 5 full blocks
SQL, CHAT = LoraRef("sql", "/adapters/sql"), LoraRef("chat", "/adapters/chat")
SQL_V2 = LoraRef("sql", "/adapters/sql-v2")  # the same name, another folder


def _seq(rid: str, pool: LoraPool, lora: LoraRef | None) -> Sequence:
    root = pool.hash_root(lora) if lora is not None else 0
    return Sequence(rid, PROMPT, lora=lora, hash_root=root)


def _run(bm: BlockManager, seq: Sequence) -> Sequence:
    """A sequence computed whole and finished: its full blocks stay in the prefix cache."""
    cached = bm.find_cached_prefix(seq)
    assert bm.allocate(seq, len(PROMPT), cached)
    seq.num_computed_tokens = len(PROMPT)
    bm.cache_full_blocks(seq)
    bm.free(seq)
    return seq


@pytest.fixture
def pool():
    pool = LoraPool(lambda ref: None, max_loras=2)
    yield pool
    pool.close()


def test_the_chain_starts_at_the_adapter_s_root(pool):
    bm = BlockManager(num_blocks=32, block_size=BS)
    a = _run(bm, _seq("a", pool, SQL))
    assert a.block_hashes == prompt_hashes(PROMPT, BS, root=adapter_root("sql"))
    base = _run(bm, _seq("b", pool, None))
    assert base.block_hashes == prompt_hashes(PROMPT, BS)
    assert not set(a.block_hashes) & set(base.block_hashes)


def test_blocks_are_shared_under_the_same_adapter_only(pool):
    bm = BlockManager(num_blocks=32, block_size=BS)
    _run(bm, _seq("a", pool, SQL))
    for lora, blocks in [(SQL, 5), (CHAT, 0), (None, 0), (SQL_V2, 0), (SQL, 5)]:
        assert len(bm.find_cached_prefix(_seq("probe", pool, lora))) == blocks, lora
    assert pool.hash_root(SQL) == adapter_root("sql") != pool.hash_root(SQL_V2)
