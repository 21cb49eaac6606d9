"""The KV block manager: which cache blocks each sequence owns. Pure bookkeeping (no torch).

Blocks hold ``block_size`` tokens. A full block is registered under the hash of its tokens
chained with its predecessor's hash, so a later sequence with the same prefix reuses it (prefix
caching). Blocks are shared by reference count; a block whose count drops to zero goes to the
free queue but keeps its contents, so a cache hit can still revive it until it is evicted, least
recently freed first.

Blocks never written yet are kept apart: on a CPU the pool is resident only where written, so
the cache may grow into them only up to ``cache_share`` times the most blocks ever in use at
once; past that, a new block evicts the least recently freed cached one instead. Without it a
worker's pool became resident whole over a few loads (the cache kept every block a load had
written: peak RSS at 64 streams 3.70 GiB after the 32-stream load had run, against 3.08 GiB on
a fresh server). A floor (``cache_floor`` blocks) keeps a quiet server's cache useful: bound
by a lone stream's dozen blocks alone, eight prompts sent one after another were all evicted
before they came again (round 2 of a lone stream's load at 0.65-0.69x llama.cpp's output).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from llmq.common.placement.block_hashes import chain_hashes
from llmq.worker.engine.sequence import Sequence


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set while the block is registered in the prefix cache
    tokens: tuple[int, ...] = ()  # its tokens while registered, to rule out hash collisions


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        cache_share: float | None = None,
        cache_floor: int = 0,
    ):
        """``cache_share``: how many blocks, per block of the busiest moment's, the free cached
        ones may add to the blocks ever written before a block never written is taken while a
        cached one could be evicted; None: no bound (the whole pool may cache).
        ``cache_floor``: blocks ever written the share never holds the cache under."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.cache_share = cache_share
        self.cache_floor = cache_floor
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks once written, in eviction order: the first is reused first.
        self._free: OrderedDict[int, None] = OrderedDict()
        self._unwritten = list(range(num_blocks - 1, -1, -1))  # taken from the end: 0 first
        self.most_used = 0  # the most blocks in use at once
        self._cached: dict[int, int] = {}  # block hash -> block id
        self.prefix_hits = 0  # tokens served from the prefix cache, for metrics and tests

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._unwritten)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_written_blocks(self) -> int:
        """Blocks ever taken: on a CPU, the pool's resident part."""
        return self.num_blocks - len(self._unwritten)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def cached_hashes(self):
        """The hashes of the blocks the prefix cache holds now (a live view: copy it on the
        engine's thread), which the worker publishes for placement."""
        return self._cached.keys()

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- hashing -------------------------------------------------------------------------
    def _block_hashes(self, seq: Sequence, num_full_blocks: int) -> list[int]:
        """Hash chain of the sequence's first ``num_full_blocks`` blocks, memoized on it; chained
        from its adapter's root, so that no block is shared across adapters, and a block holding
        image tokens salted with the images' hashes, so that no block is shared across images."""
        return chain_hashes(
            seq.token_ids,
            self.block_size,
            num_full_blocks,
            seq.block_hashes,
            root=seq.hash_root,
            salts=seq.hash_salts,
        )

    # ---- allocation ----------------------------------------------------------------------
    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Ids of cached blocks that hold a prefix of the sequence's tokens, up to all its full
        blocks (see ``hit_tokens``)."""
        if not self.enable_prefix_caching or seq.block_table:
            return []
        max_blocks = seq.num_tokens // self.block_size
        hits: list[int] = []
        bs = self.block_size
        for i, h in enumerate(self._block_hashes(seq, max_blocks)):
            block_id = self._cached.get(h)
            if block_id is None:
                break
            if self.blocks[block_id].tokens != tuple(seq.token_ids[i * bs : (i + 1) * bs]):
                break
            hits.append(block_id)
        return hits

    def hit_tokens(self, seq: Sequence, cached_blocks: list[int]) -> int:
        """Tokens of ``seq`` that ``cached_blocks`` (from ``find_cached_prefix``) spare it from
        computing. At least one token is always left, since the step that computes it yields
        the next token. A sequence cached whole computes only its last token again, reading
        that token's KV from the cache and writing it nowhere (the runner skips writes into
        registered blocks): recomputing the whole last block made a repeated 128-token prompt
        cost 16 tokens of a step instead of 1."""
        return min(len(cached_blocks) * self.block_size, seq.num_tokens - 1)

    def uncached(self, seq: Sequence) -> tuple[int, list[int]]:
        """The tokens a waiting sequence has to compute, and the cached blocks that spare it
        the rest. Prompt logprobs need every prompt row's logits: none come from the cache."""
        cached = [] if seq.prompt_logprobs_pending else self.find_cached_prefix(seq)
        return seq.num_tokens - self.hit_tokens(seq, cached), cached

    def tokens_to_compute(self, seq: Sequence) -> int:
        """The tokens ``seq`` has still to compute (its load, as the API weighs it against the
        prefix cache a worker holds), net of what the cache spares a waiting prompt: counted
        whole, a burst of repeats queued on the worker holding their prefix looked like its
        full prompts' work, and drew the rest of the burst to a worker without it."""
        if seq.num_computed_tokens == 0:
            return self.uncached(seq)[0]  # at least one: hit_tokens leaves one
        return max(1, seq.num_tokens - seq.num_computed_tokens)

    def free_blocks_taken(
        self, seq: Sequence, num_new_tokens: int, cached_blocks: list[int] = ()
    ) -> int:
        """Blocks of the free queue that ``allocate`` with these arguments takes: new ones, and
        freed cached ones it revives."""
        _, num_new_blocks = self._growth(seq, num_new_tokens, cached_blocks)
        revived = sum(1 for b in cached_blocks if self.blocks[b].ref_count == 0)
        return max(num_new_blocks, 0) + revived

    def _growth(
        self, seq: Sequence, num_new_tokens: int, cached_blocks: list[int]
    ) -> tuple[int, int]:
        """The tokens ``seq`` holds computed before the new ones (its cache hit, for a
        sequence given ``cached_blocks``), and the blocks beyond those it holds and the cached
        ones that the new tokens need (negative: none)."""
        computed = self.hit_tokens(seq, cached_blocks) if cached_blocks else seq.num_computed_tokens
        needed = self.blocks_needed(computed + num_new_tokens) - len(seq.block_table)
        return computed, needed - len(cached_blocks)

    def allocate(self, seq: Sequence, num_new_tokens: int, cached_blocks: list[int] = ()) -> bool:
        """Give the sequence blocks for ``num_new_tokens`` more tokens (after ``cached_blocks``,
        taken from ``find_cached_prefix`` for a sequence that holds no blocks yet: then
        ``num_new_tokens`` counts from ``hit_tokens``). Returns False and changes nothing when
        there are not enough free blocks."""
        fresh = not seq.block_table
        if self.free_blocks_taken(seq, num_new_tokens, cached_blocks) > self.num_free_blocks:
            return False
        computed, num_new_blocks = self._growth(seq, num_new_tokens, cached_blocks)
        if fresh:  # admitted (again, after a preemption): this admission's hit
            seq.num_cached_tokens = computed if cached_blocks else 0
        for block_id in cached_blocks:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
        if cached_blocks:
            seq.num_computed_tokens = computed
            seq.num_registered_blocks = len(cached_blocks)
            self.prefix_hits += computed
        for _ in range(max(num_new_blocks, 0)):
            block = self.blocks[self._take_block()]
            self._evict(block)
            block.ref_count = 1
            seq.block_table.append(block.block_id)
        self.most_used = max(self.most_used, self.num_used_blocks)
        return True

    def _take_block(self) -> int:
        """A free block: one holding nothing cached, else a never-written one while the cache
        is within its share, else the least recently freed cached one."""
        if self._free:
            first = next(iter(self._free))
            if self.blocks[first].hash is None or not self._unwritten or self._cache_is_full():
                del self._free[first]
                return first
        return self._unwritten.pop()

    def _cache_is_full(self) -> bool:
        if self.cache_share is None:
            return False
        busiest = max(self.most_used, self.num_used_blocks + 1)
        bound = max(busiest * (1 + self.cache_share), self.cache_floor)
        return self.num_written_blocks >= bound

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the sequence's blocks that became full with computed tokens."""
        if not self.enable_prefix_caching:
            return
        start = seq.num_registered_blocks
        num_full = seq.num_computed_tokens // self.block_size
        if num_full <= start:
            return
        hashes = self._block_hashes(seq, num_full)
        bs = self.block_size
        for i in range(start, num_full):
            h = hashes[i]
            if h not in self._cached:
                block = self.blocks[seq.block_table[i]]
                block.hash = h
                block.tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
                self._cached[h] = block.block_id
        seq.num_registered_blocks = num_full

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks. Registered blocks go to the back of the free queue,
        tail blocks first, so a shared prefix is evicted last; unregistered ones go to the
        front, to be reused first."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                if block.hash is None:
                    self._free.move_to_end(block_id, last=False)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0  # num_cached_tokens stays: the finished request's usage

    def trim(self, seq: Sequence) -> None:
        """Give back the blocks past those ``seq``'s tokens need (the tail a rejected draft
        took): unregistered, they go to the front of the free queue."""
        keep = self.blocks_needed(seq.num_tokens)
        while len(seq.block_table) > keep:
            block = self.blocks[seq.block_table.pop()]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block.block_id] = None
                self._free.move_to_end(block.block_id, last=False)

    def _evict(self, block: Block) -> None:
        if block.hash is not None:
            if self._cached.get(block.hash) == block.block_id:
                del self._cached[block.hash]
            block.hash = None
            block.tokens = ()

    def reset_prefix_cache(self) -> None:
        for block_id in self._free:
            self._evict(self.blocks[block_id])

    # ---- checking ------------------------------------------------------------------------
    def check_invariants(self, live: list[Sequence]) -> None:
        """Raise AssertionError when the bookkeeping is inconsistent with ``live`` sequences."""
        owners = [0] * self.num_blocks
        for seq in live:
            assert len(set(seq.block_table)) == len(seq.block_table), (
                "a sequence owns a block twice"
            )
            for b in seq.block_table:
                owners[b] += 1
        self._check_blocks(owners)

    def _check_blocks(self, owners: list[int]) -> None:
        """Reference counts equal to ``owners`` (per block, the table entries naming it); free
        exactly when unowned; the free queue, unwritten blocks and the prefix cache agree."""
        unwritten = set(self._unwritten)
        assert len(unwritten) == len(self._unwritten)
        for block in self.blocks:
            assert block.ref_count == owners[block.block_id], (
                f"block {block.block_id}: ref_count {block.ref_count} != owners {owners[block.block_id]}"
            )
            free = block.block_id in self._free or block.block_id in unwritten
            assert (block.ref_count == 0) == free
            assert not (block.block_id in self._free and block.block_id in unwritten)
            assert block.block_id not in unwritten or block.hash is None
        for h, b in self._cached.items():
            assert self.blocks[b].hash == h
