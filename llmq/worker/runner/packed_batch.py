"""One engine step laid out as the model runs it: all new tokens of all scheduled sequences in
one packed row, with their positions and KV cache slots. Pure: no torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from llmq.worker.engine.scheduler import ScheduledSequence
from llmq.worker.engine.sequence import Sequence


@dataclass(slots=True)
class PackedBatch:
    """One step's new tokens packed into one row, and where each scheduled entry sits in it. An
    entry with a draft keeps all its rows (one per position), in order, where others keep one."""

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)  # cache slot of every packed token
    keep: list[int] = field(default_factory=list)  # rows whose logits are kept: sampled first
    sampled_entries: list[int] = field(default_factory=list)  # their indices in ``scheduled``
    decodes: list[ScheduledSequence] = field(default_factory=list)  # in row order
    prefills: list[tuple[ScheduledSequence, int]] = field(default_factory=list)  # (chunk, row)
    # Prompt rows kept for prompt logprobs, after the sampled rows in ``keep``.
    prompt_rows: list[PromptRows] = field(default_factory=list)
    _prompt_keep: list[int] = field(default_factory=list)


@dataclass(slots=True)
class PromptRows:
    """``count`` consecutive kept rows of one sequence's prompt: row j scores prompt token
    ``first + j`` (the logits at position ``first + j - 1`` predict it)."""

    seq: Sequence
    first: int
    count: int


def pack_step(
    scheduled: list[ScheduledSequence],
    block_size: int,
    scratch_slot: int,
    decode_kernel: bool = False,
) -> PackedBatch:
    """All new tokens of the step in one row: the decodes first, by context length (so that
    chunks of similar length are contiguous rows), then the prefill chunks in order.
    ``decode_kernel`` (the decode kernel attends the decodes, in any order, each row over its
    own context): the decodes of one LoRA adapter contiguous, so that its rows are one slice of
    every projection; and a drafted entry's positions packed as decode rows, one each, so that
    each is attended as a plain decode at its position would be (no prompt chunk's gathered
    context and mask).

    A token whose block is registered in the prefix cache (the last token of a sequence found
    in the cache whole, run again for its logits) has its KV there already: it is written to
    ``scratch_slot``, which no sequence reads, so no shared block is ever written."""
    decodes: list[int] = []
    prefills: list[int] = []
    for i, item in enumerate(scheduled):
        as_decode = item.num_new_tokens == 1 or (decode_kernel and bool(item.draft))
        (decodes if as_decode else prefills).append(i)
    if decode_kernel and any(scheduled[i].seq.lora is not None for i in decodes):
        decodes.sort(key=lambda i: (_adapter_key(scheduled[i].seq), scheduled[i].start))
    else:
        decodes.sort(key=lambda i: scheduled[i].start)
    batch = PackedBatch()
    for i in decodes:
        item = scheduled[i]
        row = len(batch.input_ids)
        _pack_decode_rows(batch, item, block_size, scratch_slot)
        _keep_prompt_rows(batch, item, row)
        if item.draft:  # every position's logits: the target's token after each draft token
            batch.keep.extend(range(row, len(batch.input_ids)))
            batch.sampled_entries.append(i)
        elif item.samples:
            batch.keep.append(row)
            batch.sampled_entries.append(i)
    for i in prefills:
        item = scheduled[i]
        batch.prefills.append((item, len(batch.input_ids)))
        _keep_prompt_rows(batch, item, len(batch.input_ids))
        _pack_prefill(batch, item, block_size)
        if item.draft:  # every position's logits: the target's token after each draft token
            end = len(batch.input_ids)
            batch.keep.extend(range(end - item.num_new_tokens, end))
            batch.sampled_entries.append(i)
        elif item.samples:
            batch.keep.append(len(batch.input_ids) - 1)
            batch.sampled_entries.append(i)
    batch.keep.extend(batch._prompt_keep)
    return batch


def _pack_decode_rows(
    batch: PackedBatch, item: ScheduledSequence, block_size: int, scratch_slot: int
) -> None:
    """Append a decode's row, or a drafted entry's rows (its last token, then each draft
    token), each a decode of its own position."""
    seq, bs = item.seq, block_size
    tokens = [seq.token_ids[item.start], *item.draft]
    for j, token in enumerate(tokens):
        p = item.start + j
        block = p // bs
        registered = block < seq.num_registered_blocks
        batch.input_ids.append(token)
        batch.positions.append(p)
        batch.slots.append(scratch_slot if registered else seq.block_table[block] * bs + p % bs)
        batch.decodes.append(item if j == 0 and not item.draft else ScheduledSequence(seq, p, 1))


def _adapter_key(seq: Sequence) -> tuple[str, str]:
    lora = seq.lora
    return ("", "") if lora is None else (lora.name, lora.path)


def _keep_prompt_rows(batch: PackedBatch, item: ScheduledSequence, row: int) -> None:
    """Keep the rows of a chunk that predict prompt tokens, for a sequence that wants prompt
    logprobs (the chunk's first row at packed ``row``)."""
    seq = item.seq
    if not seq.prompt_logprobs_pending:
        return
    count = min(item.num_new_tokens, seq.num_prompt_tokens - 1 - item.start)
    if count > 0:
        batch.prompt_rows.append(PromptRows(seq, item.start + 1, count))
        batch._prompt_keep.extend(range(row, row + count))


def _pack_prefill(batch: PackedBatch, item: ScheduledSequence, block_size: int) -> None:
    """Append one prefill chunk's tokens, positions and cache slots (block by block)."""
    bs = block_size
    seq, start, n = item.seq, item.start, item.num_new_tokens
    table = seq.block_table
    batch.input_ids.extend(seq.token_ids[start : start + n])
    batch.input_ids.extend(item.draft)  # a decode's draft, after its last token
    batch.positions.extend(range(start, start + n))
    first, last = start // bs, (start + n - 1) // bs
    for b in range(first, last + 1):
        base = table[b] * bs
        lo = start - b * bs if b == first else 0
        hi = start + n - b * bs if b == last else bs
        batch.slots.extend(range(base + lo, base + hi))
