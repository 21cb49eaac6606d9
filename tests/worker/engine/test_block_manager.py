"""BlockManager: pure bookkeeping, no torch.

Allocation and reference counts, prefix caching (shared, partial and diverging prefixes,
revival of freed cached blocks), LRU eviction and the invariant checker.
"""

from __future__ import annotations

import pytest

from llmq.worker.engine.block_manager import BlockManager
from llmq.worker.engine.sequence import Sequence
from tests.engine_sequences import BS, make_seq, prefix

pytestmark = pytest.mark.unit


def compute(bm: BlockManager, seq: Sequence, num_tokens: int | None = None) -> None:
    """Pretend a runner computed the sequence's tokens (all of them by default)."""
    target = seq.num_tokens if num_tokens is None else num_tokens
    assert bm.allocate(seq, target - seq.num_computed_tokens)
    seq.num_computed_tokens = target
    bm.cache_full_blocks(seq)


def test_allocate_and_free_counts():
    bm = BlockManager(num_blocks=10, block_size=BS)
    seq = make_seq("a", prefix(40))
    assert bm.allocate(seq, 40)
    assert len(seq.block_table) == 3 == bm.num_used_blocks
    assert bm.num_free_blocks == 7
    assert bm.usage == pytest.approx(0.3)
    bm.check_invariants([seq])
    seq.num_computed_tokens = 40
    # Growing within the last block takes no new block; crossing it takes one.
    assert bm.allocate(seq, 8)
    assert len(seq.block_table) == 3
    assert bm.allocate(seq, 9)
    assert len(seq.block_table) == 4
    bm.check_invariants([seq])
    bm.free(seq)
    assert seq.block_table == [] and seq.num_computed_tokens == 0
    assert bm.num_free_blocks == 10
    bm.check_invariants([])


def test_allocate_failure_changes_nothing():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = make_seq("a", prefix(48))
    assert bm.allocate(a, 48)
    b = make_seq("b", prefix(40, 500))
    assert not bm.allocate(b, 40)  # needs 3 blocks, 1 free
    assert b.block_table == [] and bm.num_free_blocks == 1
    bm.check_invariants([a, b])
    assert bm.allocate(b, 16)
    assert bm.num_free_blocks == 0
    assert not bm.allocate(b, 17)
    assert len(b.block_table) == 1
    bm.check_invariants([a, b])


def test_invalid_sizes():
    with pytest.raises(ValueError):
        BlockManager(0, 16)
    with pytest.raises(ValueError):
        BlockManager(4, 0)


def test_check_invariants_detects_corruption():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = make_seq("a", prefix(20))
    assert bm.allocate(a, 20)
    bm.check_invariants([a])
    with pytest.raises(AssertionError):
        bm.check_invariants([])  # blocks with owners unaccounted for
    bm.blocks[a.block_table[0]].ref_count += 1
    with pytest.raises(AssertionError):
        bm.check_invariants([a])
    bm.blocks[a.block_table[0]].ref_count -= 1
    a.block_table.append(a.block_table[0])
    with pytest.raises(AssertionError):
        bm.check_invariants([a])


def test_prefix_cache_shares_three_blocks():
    bm = BlockManager(num_blocks=16, block_size=BS)
    shared = prefix(3 * BS)
    a = make_seq("a", shared + [1, 2, 3, 4, 5])
    compute(bm, a)
    assert a.num_registered_blocks == 3
    b = make_seq("b", shared + [9, 8, 7])
    hits = bm.find_cached_prefix(b)
    assert hits == a.block_table[:3]
    assert bm.allocate(b, b.num_tokens - 3 * BS, hits)
    assert b.block_table[:3] == a.block_table[:3]
    assert b.block_table[3] != a.block_table[3]
    for block_id in a.block_table[:3]:
        assert bm.blocks[block_id].ref_count == 2
    assert bm.blocks[a.block_table[3]].ref_count == 1
    assert b.num_computed_tokens == b.num_cached_tokens == 3 * BS
    assert bm.prefix_hits == 3 * BS
    assert bm.num_used_blocks == 5
    bm.check_invariants([a, b])
    # Freeing one owner keeps the shared blocks in use.
    bm.free(a)
    assert bm.num_used_blocks == 4
    for block_id in b.block_table[:3]:
        assert bm.blocks[block_id].ref_count == 1
    bm.check_invariants([b])


def test_prefix_cache_partial_match_and_divergence():
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = make_seq("a", prefix(4 * BS))
    compute(bm, a)
    # Same first block, different second block: one block hit only.
    tokens = prefix(BS) + prefix(3 * BS, 900)
    b = make_seq("b", tokens)
    assert bm.find_cached_prefix(b) == a.block_table[:1]
    # A different first block: nothing, even though later blocks are equal.
    c = make_seq("c", prefix(BS, 700) + prefix(3 * BS)[BS:])
    assert bm.find_cached_prefix(c) == []


def test_tokens_to_compute_counts_a_waiting_prompt_net_of_its_cached_prefix():
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = make_seq("a", prefix(3 * BS + 4))
    compute(bm, a)
    repeat = make_seq("b", prefix(3 * BS + 4))
    assert bm.tokens_to_compute(repeat) == 4  # three blocks cached
    assert bm.tokens_to_compute(make_seq("c", prefix(3 * BS))) == 1  # cached whole
    assert bm.tokens_to_compute(make_seq("d", prefix(BS, 900))) == BS  # nothing cached
    # Running, it has what it has not computed yet; done with its prompt, one token a step.
    assert bm.allocate(repeat, 4, bm.find_cached_prefix(repeat))
    assert bm.tokens_to_compute(repeat) == 4
    repeat.num_computed_tokens = repeat.num_tokens
    assert bm.tokens_to_compute(repeat) == 1


def test_prefix_cache_leaves_one_token_to_compute():
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = make_seq("a", prefix(3 * BS + 4))
    compute(bm, a)
    one_more = make_seq("c", prefix(3 * BS + 1))
    assert bm.find_cached_prefix(one_more) == a.block_table[:3]
    assert bm.hit_tokens(one_more, a.block_table[:3]) == 3 * BS
    # Exactly three full cached blocks: all three are shared, and only the last token is
    # computed again (not the whole last block).
    same = make_seq("b", prefix(3 * BS))
    hits = bm.find_cached_prefix(same)
    assert hits == a.block_table[:3]
    assert bm.hit_tokens(same, hits) == 3 * BS - 1
    used = bm.num_used_blocks
    assert bm.allocate(same, 1, hits)
    assert same.block_table == hits and bm.num_used_blocks == used  # no new block
    assert same.num_computed_tokens == same.num_cached_tokens == 3 * BS - 1
    assert same.num_registered_blocks == 3
    assert bm.prefix_hits == 3 * BS - 1
    bm.check_invariants([a, same])
    # Computing that token registers nothing new; its first output token takes a new block.
    same.num_computed_tokens = 3 * BS
    bm.cache_full_blocks(same)
    assert same.num_registered_blocks == 3
    same.token_ids.append(7)
    assert bm.allocate(same, 1)
    assert len(same.block_table) == 4 and bm.blocks[same.block_table[3]].ref_count == 1
    bm.check_invariants([a, same])


def test_free_blocks_taken_is_what_allocate_takes():
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = make_seq("a", prefix(3 * BS + 2))
    compute(bm, a)
    bm.free(a)  # its 3 full blocks stay cached, free
    cases = [
        (make_seq("whole", prefix(3 * BS)), 1),  # 3 revived, no new block
        (make_seq("longer", prefix(3 * BS + 7)), 7),  # 3 revived, 1 new
        (make_seq("fresh", prefix(2 * BS + 1, 900)), 2 * BS + 1),  # 3 new, nothing cached
    ]
    for seq, num_new in cases:
        hits = bm.find_cached_prefix(seq)
        taken = bm.free_blocks_taken(seq, num_new, hits)
        free = bm.num_free_blocks
        assert bm.allocate(seq, num_new, hits)
        assert free - bm.num_free_blocks == taken, seq.request_id
    bm.check_invariants([s for s, _ in cases])


def test_cached_tokens_outlive_free():
    """A finished request's usage reports its prefix-cache hit: freeing its blocks (which
    finishing does before the last output is built) keeps the count; a new admission sets it."""
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = make_seq("a", prefix(2 * BS + 3))
    compute(bm, a)
    b = make_seq("b", prefix(2 * BS + 3))
    hits = bm.find_cached_prefix(b)
    assert bm.allocate(b, 3, hits)
    bm.free(b)
    assert b.num_cached_tokens == 2 * BS and b.num_computed_tokens == 0
    bm.free(a)
    bm.reset_prefix_cache()  # readmitted with no hit (as after a preemption): 0 again
    assert bm.find_cached_prefix(b) == []
    assert bm.allocate(b, b.num_tokens)
    assert b.num_cached_tokens == 0


def test_prefix_cache_only_computed_blocks_registered():
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = make_seq("a", prefix(3 * BS + 5))
    assert bm.allocate(a, a.num_tokens)
    a.num_computed_tokens = BS + 3  # one full block computed so far (a prefill chunk)
    bm.cache_full_blocks(a)
    assert a.num_registered_blocks == 1
    b = make_seq("b", prefix(3 * BS + 5))
    assert bm.find_cached_prefix(b) == a.block_table[:1]


def test_freed_cached_blocks_are_free_but_revivable():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_seq("a", prefix(3 * BS + 2))
    compute(bm, a)
    cached_ids = a.block_table[:3]
    bm.free(a)
    assert bm.num_free_blocks == 8
    b = make_seq("b", prefix(3 * BS + 7))
    hits = bm.find_cached_prefix(b)
    assert hits == cached_ids
    assert bm.allocate(b, 7, hits)
    assert bm.num_free_blocks == 8 - 4
    assert all(bm.blocks[i].ref_count == 1 for i in b.block_table)
    assert b.num_cached_tokens == 3 * BS
    bm.check_invariants([b])


def test_revival_counts_against_free_blocks():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = make_seq("a", prefix(2 * BS + 1))
    compute(bm, a)
    bm.free(a)
    filler = make_seq("f", prefix(BS, 600))
    assert bm.allocate(filler, 1)  # takes the unregistered tail block of a (reused first)
    b = make_seq("b", prefix(2 * BS) + prefix(2 * BS, 900))
    hits = bm.find_cached_prefix(b)
    assert len(hits) == 2
    # 2 revived + 2 new > 3 free: refused, nothing changed.
    assert not bm.allocate(b, 2 * BS, hits)
    assert b.block_table == [] and b.num_computed_tokens == 0
    assert bm.num_free_blocks == 3
    assert all(bm.blocks[h].ref_count == 0 for h in hits)
    bm.check_invariants([filler, b])
    assert bm.allocate(b, BS, hits)
    bm.check_invariants([filler, b])


def test_lru_eviction_of_cached_free_blocks():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_seq("a", prefix(3 * BS, 100))
    b = make_seq("b", prefix(3 * BS, 500))
    compute(bm, a)
    compute(bm, b)
    bm.free(a)  # freed first: least recently used
    bm.free(b)
    assert bm.num_free_blocks == 8
    probe_a = make_seq("pa", prefix(3 * BS, 100) + [1])
    probe_b = make_seq("pb", prefix(3 * BS, 500) + [1])
    assert len(bm.find_cached_prefix(probe_a)) == 3
    assert len(bm.find_cached_prefix(probe_b)) == 3
    # Two never-registered blocks go first, then a's blocks tail first.
    c = make_seq("c", prefix(2 * BS, 800))
    assert bm.allocate(c, 2 * BS)
    assert len(bm.find_cached_prefix(make_seq("pa", prefix(3 * BS, 100) + [1]))) == 3
    c2 = make_seq("c2", [1])
    assert bm.allocate(c2, 1)
    assert len(bm.find_cached_prefix(make_seq("pa", prefix(3 * BS, 100) + [1]))) == 2
    assert len(bm.find_cached_prefix(make_seq("pb", prefix(3 * BS, 500) + [1]))) == 3
    d = make_seq("d", prefix(2 * BS, 1000))
    assert bm.allocate(d, 2 * BS)
    assert bm.find_cached_prefix(make_seq("pa", prefix(3 * BS, 100) + [1])) == []
    assert len(bm.find_cached_prefix(make_seq("pb", prefix(3 * BS, 500) + [1]))) == 3
    bm.check_invariants([c, c2, d])


def test_reset_prefix_cache_and_disabled_cache():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_seq("a", prefix(2 * BS + 1))
    compute(bm, a)
    bm.free(a)
    bm.reset_prefix_cache()
    assert bm.find_cached_prefix(make_seq("b", prefix(2 * BS + 1))) == []
    bm.check_invariants([])

    off = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    a = make_seq("a", prefix(2 * BS + 1))
    compute(off, a)
    assert off.find_cached_prefix(make_seq("b", prefix(2 * BS + 1))) == []
    assert off.prefix_hits == 0


def test_duplicate_blocks_computed_side_by_side():
    """Two sequences compute the same prefix in the same step: the second copy stays
    unregistered, both are counted and freed correctly."""
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_seq("a", prefix(2 * BS + 1))
    b = make_seq("b", prefix(2 * BS + 1))
    assert bm.allocate(a, a.num_tokens)
    assert bm.allocate(b, b.num_tokens)
    for s in (a, b):
        s.num_computed_tokens = s.num_tokens
        bm.cache_full_blocks(s)
    bm.check_invariants([a, b])
    assert bm.find_cached_prefix(make_seq("c", prefix(2 * BS + 1))) == a.block_table[:2]
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 8
    bm.check_invariants([])


def _prompts(first: int, width: int) -> list[list[int]]:
    """``width`` prompts of two full blocks, each its own tokens."""
    return [[10_000 * (first + i) + t for t in range(2 * BS)] for i in range(width)]


def _serve_round(bm: BlockManager, prompts: list[list[int]]) -> int:
    """The prompts' sequences at once, computed and freed; returns the prompt tokens the cache
    served."""
    seqs = [make_seq(f"s{i}", tokens) for i, tokens in enumerate(prompts)]
    hits = 0
    for seq in seqs:
        cached = bm.find_cached_prefix(seq)
        hit = bm.hit_tokens(seq, cached) if cached else 0
        assert bm.allocate(seq, seq.num_tokens - hit, cached)
        hits += hit
        seq.num_computed_tokens = seq.num_tokens
        bm.cache_full_blocks(seq)
    for seq in seqs:
        bm.free(seq)
    return hits


@pytest.mark.parametrize("share", [None, 1.0])
def test_cache_grows_into_unwritten_blocks_only_within_its_share(share):
    """Rounds of new prompts, 4 at a time (8 blocks at once): unbounded, the cache writes a new
    part of the pool each round until all of it is written; with share 1.0 it stops at twice
    the busiest moment and evicts the least recently freed instead."""
    bm = BlockManager(num_blocks=100, block_size=BS, cache_share=share)
    for rnd in range(10):
        written = bm.num_written_blocks
        assert _serve_round(bm, _prompts(4 * rnd, 4)) == 0
        bm.check_invariants([])
        assert bm.most_used == 8
        if share is None:
            assert bm.num_written_blocks == written + 8
    assert bm.num_written_blocks == (80 if share is None else 16)


def test_the_cache_floor_keeps_a_quiet_servers_prompts():
    """One prompt at a time (2 blocks at once): the share alone keeps 4 blocks written, so eight
    prompts sent again all miss; with a floor of 16 blocks all eight are served from the
    cache, and the pool is written no further than the floor."""
    prompts = _prompts(0, 8)
    for floor, hits in ((0, 0), (16, 8 * (2 * BS - 1))):
        bm = BlockManager(num_blocks=100, block_size=BS, cache_share=1.0, cache_floor=floor)
        for prompt in prompts:
            _serve_round(bm, [prompt])
        assert bm.most_used == 2 and bm.num_written_blocks == max(4, floor)
        assert sum(_serve_round(bm, [prompt]) for prompt in prompts) == hits
        bm.check_invariants([])


def test_a_repeated_round_within_the_share_is_served_from_the_cache():
    bm = BlockManager(num_blocks=100, block_size=BS, cache_share=1.0)
    assert _serve_round(bm, _prompts(0, 4)) == 0
    assert _serve_round(bm, _prompts(4, 4)) == 0
    # Both rounds fit the share (16 blocks): each prompt is cached whole and computes its last
    # token only.
    assert _serve_round(bm, _prompts(0, 4)) == 4 * (2 * BS - 1)
    assert _serve_round(bm, _prompts(4, 4)) == 4 * (2 * BS - 1)
    assert bm.num_written_blocks == 16
