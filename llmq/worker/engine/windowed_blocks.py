"""The block manager of a model with sliding windows: one block table per KV group
(``engine/kv_groups.py``), every group drawing on one pool. Pure bookkeeping (no torch).

A sliding group of window W gives its blocks back once every token in them is more than W - 1
positions behind the sequence's next query (the first new token of its next step): after each
step (``cache_full_blocks``), and so holds at most ``window_bound`` blocks per sequence: the
window behind the step's first new token, and the step's new tokens. Its table keeps their
places, pointing nowhere (``NULL_BLOCK``), so that entry i is always block i of the sequence.

Prefix caching: a full block is registered per group under (group, hash of the token chain). A
block given back by a sliding group stays registered (free and evictable, as a finished
sequence's blocks are). A cached prefix of n blocks is a hit only where every full-attention
group holds all n and every sliding group holds the blocks its window needs at the hit point
(those that the first recomputed token reads); the longest such n is taken. A hit's output is
exact: each layer reads the keys it would have computed.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

from llmq.worker.engine.block_manager import BlockManager
from llmq.worker.engine.kv_groups import NULL_BLOCK, first_window_block, window_bound
from llmq.worker.engine.sequence import Sequence


@dataclass(frozen=True, slots=True)
class GroupHit:
    """A cached prefix of ``num_blocks`` blocks: per group, the table entries it gives (the
    entries of a sliding group before its window ``NULL_BLOCK``)."""

    tables: list[list[int]]
    num_blocks: int

    def __len__(self) -> int:  # as the plain manager's list of cached blocks
        return self.num_blocks

    def __bool__(self) -> bool:
        return self.num_blocks > 0


class WindowedBlockManager(BlockManager):
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        windows: Seq[int | None],
        enable_prefix_caching: bool = True,
        cache_share: float | None = None,
        cache_floor: int = 0,
    ):
        """``windows``: per KV group, its sliding window (None: full attention)."""
        super().__init__(num_blocks, block_size, enable_prefix_caching, cache_share, cache_floor)
        self.windows = tuple(windows)

    def tables(self, seq: Sequence) -> list[list[int]]:
        """The sequence's tables, one per group (made empty on first use)."""
        if len(seq.block_tables) != len(self.windows):
            seq.block_tables = [[] for _ in self.windows]
            seq.block_table = seq.block_tables[0]
        return seq.block_tables

    def held_blocks(self, seq: Sequence) -> list[int]:
        """Per group, the blocks the sequence holds."""
        return [sum(1 for b in t if b != NULL_BLOCK) for t in self.tables(seq)]

    # ---- prefix cache --------------------------------------------------------------------
    def cached_hashes(self) -> list[int]:
        """The chain hashes the first group holds (what placement weighs: a hit needs every
        full-attention group's blocks, and the groups are registered together)."""
        return [h for group, h in self._cached if group == 0]

    def find_cached_prefix(self, seq: Sequence) -> GroupHit | list:
        if not self.enable_prefix_caching or any(self.tables(seq)):
            return []
        bs = self.block_size
        hashes = self._block_hashes(seq, seq.num_tokens // bs)
        found = [self._cached_run(seq, g, hashes) for g in range(len(self.windows))]
        for n in range(min(len(f) for f in found), 0, -1):
            starts = self._hit_starts(seq, n)
            if all(f[n - 1][1] >= n - lo for f, lo in zip(found, starts, strict=True)):
                tables = [
                    [NULL_BLOCK] * lo + [b for b, _ in f[lo:n]]
                    for f, lo in zip(found, starts, strict=True)
                ]
                return GroupHit(tables, n)
        return []

    def _cached_run(self, seq: Sequence, group: int, hashes: list[int]) -> list[tuple[int, int]]:
        """Per leading block of ``seq``, the group's cached block for it and how many cached
        blocks run up to it (0: none cached), up to the last cached one; a full-attention
        group stops at its first miss."""
        bs, full = self.block_size, self.windows[group] is None
        out: list[tuple[int, int]] = []
        last_hit, run = 0, 0
        for i, h in enumerate(hashes):
            block_id = self._cached.get((group, h))
            if block_id is not None and self.blocks[block_id].tokens != tuple(
                seq.token_ids[i * bs : (i + 1) * bs]
            ):
                block_id = None
            if block_id is None:
                if full:
                    break
                out.append((NULL_BLOCK, 0))
                run = 0
                continue
            run += 1
            out.append((block_id, run))
            last_hit = i + 1
        return out[:last_hit]

    def _hit_starts(self, seq: Sequence, num_blocks: int) -> list[int]:
        """Per group, the first block a hit of ``num_blocks`` blocks must hold: its first
        recomputed token reads keys back to its window (all of them: full attention)."""
        first_query = min(num_blocks * self.block_size, seq.num_tokens - 1)
        return [
            0 if w is None else first_window_block(first_query, w, self.block_size)
            for w in self.windows
        ]

    # ---- allocation ----------------------------------------------------------------------
    def _group_growth(
        self, seq: Sequence, num_new_tokens: int, hit: GroupHit | list
    ) -> tuple[int, list[int]]:
        """The tokens held computed before the new ones, and per group the blocks to take."""
        computed = self.hit_tokens(seq, hit) if hit else seq.num_computed_tokens
        total = self.blocks_needed(computed + num_new_tokens)
        held = hit.tables if hit else self.tables(seq)
        return computed, [max(total - len(t), 0) for t in held]

    def free_blocks_taken(
        self, seq: Sequence, num_new_tokens: int, cached_blocks: GroupHit | list = ()
    ) -> int:
        _, growth = self._group_growth(seq, num_new_tokens, cached_blocks)
        revived = 0
        if cached_blocks:
            revived = sum(
                1
                for t in cached_blocks.tables
                for b in t
                if b != NULL_BLOCK and self.blocks[b].ref_count == 0
            )
        return sum(growth) + revived

    def allocate(
        self, seq: Sequence, num_new_tokens: int, cached_blocks: GroupHit | list = ()
    ) -> bool:
        tables = self.tables(seq)
        fresh = not any(tables)
        if self.free_blocks_taken(seq, num_new_tokens, cached_blocks) > self.num_free_blocks:
            return False
        computed, growth = self._group_growth(seq, num_new_tokens, cached_blocks)
        if fresh:
            seq.num_cached_tokens = computed if cached_blocks else 0
        if cached_blocks:
            for table, entries in zip(tables, cached_blocks.tables, strict=True):
                for block_id in entries:
                    if block_id != NULL_BLOCK:
                        block = self.blocks[block_id]
                        if block.ref_count == 0:
                            del self._free[block_id]
                        block.ref_count += 1
                    table.append(block_id)
            seq.num_computed_tokens = computed
            seq.num_registered_blocks = cached_blocks.num_blocks
            self.prefix_hits += computed
        for table, count in zip(tables, growth, strict=True):
            for _ in range(count):
                block = self.blocks[self._take_block()]
                self._evict(block)
                block.ref_count = 1
                table.append(block.block_id)
        self.most_used = max(self.most_used, self.num_used_blocks)
        return True

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks that became full, then give back those out of every window."""
        if self.enable_prefix_caching:
            start, num_full = seq.num_registered_blocks, seq.num_computed_tokens // self.block_size
            if num_full > start:
                hashes = self._block_hashes(seq, num_full)
                bs = self.block_size
                for g, table in enumerate(self.tables(seq)):
                    for i in range(start, num_full):
                        key = (g, hashes[i])
                        if table[i] != NULL_BLOCK and key not in self._cached:
                            block = self.blocks[table[i]]
                            block.hash = key
                            block.tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
                            self._cached[key] = block.block_id
                seq.num_registered_blocks = num_full
        self._release_out_of_window(seq)

    def _release_out_of_window(self, seq: Sequence) -> None:
        next_query = seq.num_computed_tokens
        for window, table in zip(self.windows, self.tables(seq), strict=True):
            if window is None:
                continue
            i = min(first_window_block(next_query, window, self.block_size), len(table)) - 1
            while i >= 0 and table[i] != NULL_BLOCK:  # those before were given back already
                self._release(table[i])
                table[i] = NULL_BLOCK
                i -= 1

    def _release(self, block_id: int) -> None:
        """One owner fewer. Unowned, a registered block goes to the back of the free queue
        (still a cache hit until evicted), an unregistered one to the front."""
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free[block_id] = None
            if block.hash is None:
                self._free.move_to_end(block_id, last=False)

    def trim(self, seq: Sequence) -> None:
        """Per group, give back the blocks past those ``seq``'s tokens need (the tail a rejected
        draft took; a sliding group's window only ever gives back leading blocks)."""
        keep = self.blocks_needed(seq.num_tokens)
        for table in self.tables(seq):
            while len(table) > keep:
                block_id = table.pop()
                if block_id != NULL_BLOCK:
                    self._release(block_id)

    def free(self, seq: Sequence) -> None:
        for table in self.tables(seq):
            for block_id in reversed(table):
                if block_id != NULL_BLOCK:
                    self._release(block_id)
        seq.block_tables = []
        self.tables(seq)
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0

    # ---- checking ------------------------------------------------------------------------
    def check_invariants(self, live: list[Sequence], max_chunk_tokens: int | None = None) -> None:
        """As the plain manager's, and: a sliding group holds no block before its window (of
        the sequence's next query), nor more than ``window_bound`` blocks for steps of up to
        ``max_chunk_tokens`` new tokens (None: unchecked)."""
        owners = [0] * self.num_blocks
        bs = self.block_size
        for seq in live:
            held = [b for t in self.tables(seq) for b in t if b != NULL_BLOCK]
            assert len(set(held)) == len(held), "a sequence owns a block twice"
            for b in held:
                owners[b] += 1
            for window, table in zip(self.windows, self.tables(seq), strict=True):
                if window is None:
                    assert NULL_BLOCK not in table, "a full-attention group lost a block"
                    continue
                lo = first_window_block(seq.num_computed_tokens, window, bs)
                assert all(b == NULL_BLOCK for b in table[:lo]), "a block out of its window"
                if max_chunk_tokens is not None:
                    count = sum(1 for b in table if b != NULL_BLOCK)
                    assert count <= window_bound(window, bs, max_chunk_tokens), (
                        f"a sliding group holds {count} blocks for a window of {window}"
                    )
        self._check_blocks(owners)
