"""One engine step laid out as the model runs it: all new tokens of all scheduled sequences in
one packed row, with their positions and KV cache slots. Pure: no torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from llmq.worker.engine.scheduler import ScheduledSequence


@dataclass(slots=True)
class PackedBatch:
    """One step's new tokens packed into one row, and where each scheduled entry sits in it."""

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)  # cache slot of every packed token
    keep: list[int] = field(default_factory=list)  # rows whose logits are sampled
    sampled_entries: list[int] = field(default_factory=list)  # their indices in ``scheduled``
    decodes: list[ScheduledSequence] = field(default_factory=list)  # in row order
    prefills: list[tuple[ScheduledSequence, int]] = field(default_factory=list)  # (chunk, row)


def pack_step(scheduled: list[ScheduledSequence], block_size: int) -> PackedBatch:
    """All new tokens of the step in one row: the decodes first, by context length (so that
    chunks of similar length are contiguous rows), then the prefill chunks in order."""
    decodes: list[int] = []
    prefills: list[int] = []
    for i, item in enumerate(scheduled):
        (decodes if item.num_new_tokens == 1 else prefills).append(i)
    decodes.sort(key=lambda i: scheduled[i].start)
    batch = PackedBatch()
    bs = block_size
    for row, i in enumerate(decodes):
        item = scheduled[i]
        seq, p = item.seq, item.start
        batch.input_ids.append(seq.token_ids[p])
        batch.positions.append(p)
        batch.slots.append(seq.block_table[p // bs] * bs + p % bs)
        batch.decodes.append(item)
        if item.samples:
            batch.keep.append(row)
            batch.sampled_entries.append(i)
    for i in prefills:
        item = scheduled[i]
        batch.prefills.append((item, len(batch.input_ids)))
        _pack_prefill(batch, item, block_size)
        if item.samples:
            batch.keep.append(len(batch.input_ids) - 1)
            batch.sampled_entries.append(i)
    return batch


def _pack_prefill(batch: PackedBatch, item: ScheduledSequence, block_size: int) -> None:
    """Append one prefill chunk's tokens, positions and cache slots (block by block)."""
    bs = block_size
    seq, start, n = item.seq, item.start, item.num_new_tokens
    table = seq.block_table
    batch.input_ids.extend(seq.token_ids[start : start + n])
    batch.positions.extend(range(start, start + n))
    first, last = start // bs, (start + n - 1) // bs
    for b in range(first, last + 1):
        base = table[b] * bs
        lo = start - b * bs if b == first else 0
        hi = start + n - b * bs if b == last else bs
        batch.slots.extend(range(base + lo, base + hi))
