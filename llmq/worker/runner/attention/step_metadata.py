"""The attention metadata of one step (``attention.StepMetadata``): cache slots, decode chunks
(or the decode kernel's tables) and prefill chunks with their masks, built once per step from
the packed batch; each layer only reads them.

Decodes are cut into chunks of similar context (``decode_cuts.py``), each gathered up to its own
longest context. Masks are additive, in the model's dtype: SDPA on CPU takes them as they are.

A model with sliding windows (``engine/kv_groups.py``) gets one step per KV group: each group's
own cache slots, decode chunks and prefill chunks, built from its own block tables; each layer
reads its group's (``StepMetadata.layer_steps``). A sliding group's chunks reach back only to the
first block its window needs: the sequence's table from that block on, with the contexts
shifted by the blocks left out. Masks depend only on positions relative to the query (causal,
and ``k < q - W + 1`` for the window), so the same mask builders serve on shifted positions, and
the keys a window hides were given back (``NULL_BLOCK``) and are never read. A full-attention
group reads its whole table, as a model without windows does.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from llmq.worker.engine.kv_groups import KVLayout, blocks_for, first_window_block
from llmq.worker.engine.scheduler import ScheduledSequence
from llmq.worker.runner.attention.decode_cuts import best_cuts
from llmq.worker.runner.attention.paged import (
    DecodeChunk,
    DecodeTables,
    KVPool,
    PrefillChunk,
    StepMetadata,
)
from llmq.worker.runner.packed_batch import PackedBatch


@dataclass(slots=True)
class TableView:
    """The part of one sequence's block table a group's chunks read (as ``Sequence`` for the
    chunk builders)."""

    block_table: list[int]


class StepBuilder:
    """Builds each step's ``StepMetadata`` for one pool, reusing its position and mask buffers."""

    def __init__(
        self,
        pool: KVPool,
        dtype: torch.dtype,
        device: torch.device,
        block_size: int,
        windows: frozenset[int],
        featured: bool,
        max_model_len: int,
        scratch_slot: int,
        layout: KVLayout | None,
    ):
        """``windows``: the sliding windows whose masks every step builds; ``featured``: layers
        that need more than causal attention (every prefill gets a mask)."""
        self.pool = pool
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.windows = windows
        self.featured = featured
        self.max_model_len = max_model_len
        self.scratch_slot = scratch_slot
        self.layout = layout
        self._arange = torch.arange(0, device=self.device)
        self._no_mask = torch.zeros((1, 1, 1), dtype=self.dtype, device=self.device)

    def build(self, batch: PackedBatch, kernel: bool) -> StepMetadata:
        """What the attention layers read: cache slots, decode chunks, prefill chunks.
        ``kernel``: the decode kernel attends the decodes (it reads their tables)."""
        if self.layout is not None:
            return self._grouped(batch, kernel)
        return StepMetadata(
            pool=self.pool,
            slot_mapping=torch.tensor(batch.slots, dtype=torch.long, device=self.device),
            num_decodes=len(batch.decodes),
            decode_chunks=self.decode_chunks(batch.decodes) if batch.decodes and not kernel else [],
            prefills=[
                self.prefill_chunk(item, q_start, _runs(item, 0))
                for item, q_start in batch.prefills
            ],
            decode_tables=self.decode_tables(batch.decodes) if kernel else None,
            windows=self.windows,
            max_model_len=self.max_model_len,
        )

    def positions(self, n: int) -> torch.Tensor:
        if self._arange.numel() < n:
            self._arange = torch.arange(max(n, 2 * self._arange.numel()), device=self.device)
        return self._arange[:n]

    def decode_tables(self, items: list[ScheduledSequence]) -> DecodeTables:
        """Every decode's block table (padded to the longest) and context length."""
        bs = self.block_size
        contexts = [item.start + 1 for item in items]
        widest = -(-max(contexts) // bs)
        rows = []
        for item, ctx in zip(items, contexts, strict=True):
            n = -(-ctx // bs)
            rows.append(item.seq.block_table[:n] + [0] * (widest - n))
        return DecodeTables(
            block_tables=torch.tensor(rows, dtype=torch.int32),
            context_lens=torch.tensor(contexts, dtype=torch.int32),
        )

    def prefill_chunk(
        self, item: ScheduledSequence, q_start: int, runs: list[tuple[int, int]] = ()
    ) -> PrefillChunk:
        """``runs``: the chunk's bidirectional runs (``Sequence.bidirectional``), in the
        item's positions: their queries see the run's later keys too."""
        dev = self.device
        ctx_len = item.start + item.num_new_tokens
        n_blocks = -(-ctx_len // self.block_size)
        mask = None
        window_masks = None
        if item.start or self.featured or runs:
            # Additive, in the model's dtype: SDPA on CPU takes it as is (a bool mask it
            # first converts). Query i sits at position start + i and sees keys 0..start+i.
            q_pos = self.positions(ctx_len)[item.start :]
            k_pos = self.positions(ctx_len)[None, :]
            hidden = k_pos > q_pos[:, None]
            if runs:  # and the keys of its own run after it
                hidden &= ~_same_run(runs, item.start, ctx_len, dev)
            mask = _additive(hidden, self.dtype)
            # A window of W: keys more than W - 1 positions before the query are hidden too
            # (transformers' AND of the window with the causal-or-run mask).
            window_masks = {
                w: _additive(hidden | (k_pos <= q_pos[:, None] - w), self.dtype)
                for w in self.windows
            }
        return PrefillChunk(
            q_start=q_start,
            q_len=item.num_new_tokens,
            ctx_len=ctx_len,
            block_ids=torch.tensor(item.seq.block_table[:n_blocks], device=dev),
            mask=mask,
            window_masks=window_masks,
        )

    def decode_chunks(self, items: list[ScheduledSequence]) -> list[DecodeChunk]:
        """Cut the decodes (sorted by context) into chunks, each gathered up to its own longest
        context; where to cut minimizes gathered slots plus a fixed cost per chunk."""
        bs = self.block_size
        ctxs = [item.start + 1 for item in items]
        nbs = [-(-c // bs) for c in ctxs]
        # Runs of equal block counts: a cut inside one never saves anything.
        ends: list[int] = []  # end row of each run
        for i in range(1, len(nbs)):
            if nbs[i] != nbs[i - 1]:
                ends.append(i)
        ends.append(len(nbs))
        cuts = best_cuts(ends, nbs, bs)

        dev = self.device
        chunks: list[DecodeChunk] = []
        start = 0
        for end in cuts:
            nb = nbs[end - 1]
            flat: list[int] = []
            for item, n_i in zip(items[start:end], nbs[start:end], strict=True):
                table = item.seq.block_table
                flat.extend(table[:n_i])
                if n_i < nb:
                    flat.extend([0] * (nb - n_i))
            chunk_ctx = ctxs[start:end]
            if chunk_ctx[0] == nb * bs:  # sorted: the shortest is first; no padding at all
                mask = self._no_mask
            else:
                ctx = torch.tensor(chunk_ctx, device=dev)
                mask = self.decode_mask(self.positions(nb * bs)[None, :] >= ctx[:, None])
            chunks.append(
                DecodeChunk(
                    start=start,
                    end=end,
                    num_blocks=nb,
                    block_ids=torch.tensor(flat, dtype=torch.long, device=dev),
                    mask=mask,
                    window_masks=self.decode_window_masks(chunk_ctx, nb * bs),
                )
            )
            start = end
        return chunks

    def decode_mask(self, hidden: torch.Tensor) -> torch.Tensor:
        """[sequences, keys] hidden -> additive, one row per (kv head, sequence), as the
        attention batches them: [Hkv * sequences, 1, keys]."""
        return _additive(hidden, self.dtype).repeat(self.pool.num_kv_heads, 1).unsqueeze(1)

    def decode_window_masks(self, contexts: list[int], width: int) -> dict | None:
        """Per sliding window, the decode mask that also hides the keys out of it: the query
        sits at position ctx - 1 and sees ctx - W .. ctx - 1."""
        if not self.windows:
            return None
        ctx = torch.tensor(contexts, device=self.device)[:, None]
        k_pos = self.positions(width)[None, :]
        return {w: self.decode_mask((k_pos >= ctx) | (k_pos < ctx - w)) for w in self.windows}

    def _grouped(self, batch: PackedBatch, kernel: bool) -> StepMetadata:
        """The step's metadata, with every layer's group's in ``layer_steps``: at the top a
        full-attention group's (its contexts the sequences' own), else the first group's."""
        layout = self.layout
        groups = [
            self._group_step(batch, g, group.window, kernel)
            for g, group in enumerate(layout.groups)
        ]
        layer_steps = [groups[layout.layer_group(layer)] for layer in range(layout.num_layers)]
        full = [s for s, group in zip(groups, layout.groups, strict=True) if group.window is None]
        return replace((full or groups)[0], layer_steps=layer_steps)

    def _group_step(
        self, batch: PackedBatch, group: int, window: int | None, kernel: bool
    ) -> StepMetadata:
        decodes = [_view(item, group, window, self.block_size) for item in batch.decodes]
        prefills = []
        for item, q_start in batch.prefills:
            view = _view(item, group, window, self.block_size)
            prefills.append((view, q_start, _runs(item, item.start - view.start)))
        # Where every query sees at most the window's keys in its group's part of the table, the
        # window hides nothing there (a layer may drop it); else the layer must ask it.
        longest = max([v.start + v.num_new_tokens for v in decodes + [p[0] for p in prefills]])
        if not decodes or kernel:
            chunks = []
        elif window is None:
            chunks = self.decode_chunks(decodes)
        else:  # shifted contexts are not sorted: one chunk, padded to the widest window
            chunks = [self._window_decode_chunk(decodes)]
        return StepMetadata(
            pool=self.pool,
            slot_mapping=torch.tensor(self._group_slots(batch, group), device=self.device),
            num_decodes=len(decodes),
            decode_chunks=chunks,
            prefills=[self.prefill_chunk(*prefill) for prefill in prefills],
            decode_tables=self.decode_tables(decodes) if decodes and kernel else None,
            windows=self.windows,
            max_model_len=self.max_model_len,
            group_window=window if window is not None and longest > window else None,
        )

    def _window_decode_chunk(self, decodes: list[ScheduledSequence]) -> DecodeChunk:
        bs = self.block_size
        contexts = [item.start + 1 for item in decodes]
        counts = [blocks_for(c, bs) for c in contexts]
        widest = max(counts)
        flat: list[int] = []
        for item, n in zip(decodes, counts, strict=True):
            flat += item.seq.block_table[:n] + [0] * (widest - n)
        ctx = torch.tensor(contexts, device=self.device)
        hidden = self.positions(widest * bs)[None, :] >= ctx[:, None]
        return DecodeChunk(
            start=0,
            end=len(decodes),
            num_blocks=widest,
            block_ids=torch.tensor(flat, dtype=torch.long, device=self.device),
            mask=self.decode_mask(hidden),
            window_masks=self.decode_window_masks(contexts, widest * bs),
        )

    def _group_slots(self, batch: PackedBatch, group: int) -> list[int]:
        """The group's cache slot of every packed token, in the packed order (as ``pack_step``'s:
        a decode whose block is registered writes to the scratch slot)."""
        bs, slots = self.block_size, []
        for item in batch.decodes:
            seq, p = item.seq, item.start
            block = p // bs
            if block < seq.num_registered_blocks:
                slots.append(self.scratch_slot)
            else:
                slots.append(seq.block_tables[group][block] * bs + p % bs)
        for item, _ in batch.prefills:
            table = item.seq.block_tables[group]
            slots += [
                table[p // bs] * bs + p % bs
                for p in range(item.start, item.start + item.num_new_tokens)
            ]
        return slots


def _view(
    item: ScheduledSequence, group: int, window: int | None, block_size: int
) -> ScheduledSequence:
    """``item`` as its group's chunks read it: from the first block its window needs."""
    table = item.seq.block_tables[group]
    if window is None:
        return ScheduledSequence(TableView(table), item.start, item.num_new_tokens)
    first = first_window_block(item.start, window, block_size)
    return ScheduledSequence(
        TableView(table[first:]), item.start - first * block_size, item.num_new_tokens
    )


def _runs(item: ScheduledSequence, shift: int) -> list[tuple[int, int]]:
    """The bidirectional runs of ``item``'s sequence that its chunk holds rows of, ``shift``
    positions earlier (a sliding group's view)."""
    end = item.start + item.num_new_tokens
    return [
        (first - shift, last - shift)
        for first, last in item.seq.bidirectional
        if first < end and last > item.start
    ]


def _same_run(
    runs: list[tuple[int, int]], start: int, ctx_len: int, device: torch.device
) -> torch.Tensor:
    """[queries from ``start``, keys] True where query and key lie in the same run."""
    run = torch.full((ctx_len,), -1, dtype=torch.long, device=device)
    for i, (first, last) in enumerate(runs):
        run[max(first, 0) : last] = i
    query = run[start:, None]
    return (query == run[None, :]) & (query >= 0)


def _additive(hidden: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An additive mask: -inf where ``hidden``, 0 elsewhere."""
    mask = torch.zeros(hidden.shape, dtype=dtype, device=hidden.device)
    return mask.masked_fill_(hidden, float("-inf"))
