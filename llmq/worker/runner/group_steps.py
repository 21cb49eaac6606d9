"""A step's attention metadata per KV group, for a model with sliding windows
(``engine/kv_groups.py``): each group's own cache slots, decode chunks and prefill chunks,
built from its own block tables; each layer reads its group's (``StepMetadata.layer_steps``).

A sliding group's chunks reach back only to the first block its window needs: the sequence's
table from that block on, with the contexts shifted by the blocks left out. Masks depend only
on positions relative to the query (causal, and ``k < q - W + 1`` for the window), so the
runner's own mask builders serve on shifted positions, and the keys a window hides were given
back (``NULL_BLOCK``) and are never read. A full-attention group reads its whole table, as a
model without windows does.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from llmq.worker.engine.kv_groups import blocks_for, first_window_block
from llmq.worker.engine.scheduler import ScheduledSequence
from llmq.worker.runner.attention import DecodeChunk, StepMetadata
from llmq.worker.runner.packed_batch import PackedBatch

if TYPE_CHECKING:
    from llmq.worker.runner.model_runner import ModelRunner


@dataclass(slots=True)
class TableView:
    """The part of one sequence's block table a group's chunks read (as ``Sequence`` for the
    runner's chunk builders)."""

    block_table: list[int]


def step_metadata(runner: ModelRunner, batch: PackedBatch, kernel: bool) -> StepMetadata:
    """The step's metadata, with every layer's group's in ``layer_steps``: at the top a
    full-attention group's (its contexts the sequences' own), else the first group's."""
    layout = runner.layout
    groups = [
        _group_step(runner, batch, g, group.window, kernel) for g, group in enumerate(layout.groups)
    ]
    layer_steps = [groups[layout.layer_group(layer)] for layer in range(layout.num_layers)]
    full = [step for step, group in zip(groups, layout.groups, strict=True) if group.window is None]
    return replace((full or groups)[0], layer_steps=layer_steps)


def _group_step(
    runner: ModelRunner, batch: PackedBatch, group: int, window: int | None, kernel: bool
) -> StepMetadata:
    decodes = [_view(item, group, window, runner.block_size) for item in batch.decodes]
    prefills = [(_view(item, group, window, runner.block_size), q) for item, q in batch.prefills]
    # Where every query sees at most the window's keys in its group's part of the table, the
    # window hides nothing there (a layer may drop it); else the layer must ask it.
    longest = max([v.start + v.num_new_tokens for v in decodes + [v for v, _ in prefills]])
    if not decodes or kernel:
        chunks = []
    elif window is None:
        chunks = runner._decode_chunks(decodes)
    else:  # shifted contexts are not sorted: one chunk, padded to the widest window
        chunks = [_window_decode_chunk(runner, decodes)]
    return StepMetadata(
        pool=runner.pool,
        slot_mapping=torch.tensor(_slots(batch, group, runner), device=runner.device),
        num_decodes=len(decodes),
        decode_chunks=chunks,
        prefills=[runner._prefill_chunk(view, q_start) for view, q_start in prefills],
        decode_tables=runner._decode_tables(decodes) if decodes and kernel else None,
        windows=runner.windows,
        max_model_len=runner.max_model_len,
        group_window=window if window is not None and longest > window else None,
    )


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


def _window_decode_chunk(runner: ModelRunner, decodes: list[ScheduledSequence]) -> DecodeChunk:
    bs = runner.block_size
    contexts = [item.start + 1 for item in decodes]
    counts = [blocks_for(c, bs) for c in contexts]
    widest = max(counts)
    flat: list[int] = []
    for item, n in zip(decodes, counts, strict=True):
        flat += item.seq.block_table[:n] + [0] * (widest - n)
    ctx = torch.tensor(contexts, device=runner.device)
    hidden = runner._positions(widest * bs)[None, :] >= ctx[:, None]
    return DecodeChunk(
        start=0,
        end=len(decodes),
        num_blocks=widest,
        block_ids=torch.tensor(flat, dtype=torch.long, device=runner.device),
        mask=runner._decode_mask(hidden),
        window_masks=runner._decode_window_masks(contexts, widest * bs),
    )


def _slots(batch: PackedBatch, group: int, runner: ModelRunner) -> list[int]:
    """The group's cache slot of every packed token, in the packed order (as ``pack_step``'s:
    a decode whose block is registered writes to the scratch slot)."""
    bs, slots = runner.block_size, []
    for item in batch.decodes:
        seq, p = item.seq, item.start
        block = p // bs
        if block < seq.num_registered_blocks:
            slots.append(runner.scratch_slot)
        else:
            slots.append(seq.block_tables[group][block] * bs + p % bs)
    for item, _ in batch.prefills:
        table = item.seq.block_tables[group]
        slots += [
            table[p // bs] * bs + p % bs
            for p in range(item.start, item.start + item.num_new_tokens)
        ]
    return slots
