"""A step's packing (``runner/packed_batch.py``): where the decode kernel attends the decodes, a
drafted entry's positions become decode rows of their own, each over its own context; else the
entry is a prompt chunk. Either way every position's logits are kept, in order."""

from __future__ import annotations

import pytest

from llmq.worker.engine.scheduler import ScheduledSequence
from llmq.worker.engine.sequence import Sequence
from llmq.worker.runner.packed_batch import pack_step

pytestmark = pytest.mark.unit
BS = 4


def _seq(request_id: str, tokens: list[int]) -> Sequence:
    seq = Sequence(request_id, tokens)
    seq.block_table = [7, 3, 5, 9]
    return seq


def _step() -> list[ScheduledSequence]:
    drafted = _seq("d", [11, 12, 13, 14, 15, 16])  # its last token at position 5, then 3 drafts
    plain = _seq("p", [21, 22, 23])
    return [ScheduledSequence(drafted, 5, 4, [91, 92, 93]), ScheduledSequence(plain, 2, 1)]


def test_a_draft_is_packed_as_decode_rows_for_the_decode_kernel():
    batch = pack_step(_step(), BS, scratch_slot=99, decode_kernel=True)
    assert batch.input_ids == [23, 16, 91, 92, 93]  # by context: the plain decode first
    assert batch.positions == [2, 5, 6, 7, 8]
    # Position p lies in block p // 4 of its table, at p % 4.
    assert batch.slots == [7 * BS + 2, 3 * BS + 1, 3 * BS + 2, 3 * BS + 3, 5 * BS + 0]
    assert [(d.seq.request_id, d.start, d.num_new_tokens) for d in batch.decodes] == [
        ("p", 2, 1),
        ("d", 5, 1),
        ("d", 6, 1),
        ("d", 7, 1),
        ("d", 8, 1),
    ]
    assert not batch.prefills
    assert batch.keep == [0, 1, 2, 3, 4] and batch.sampled_entries == [1, 0]


def test_without_the_kernel_a_draft_is_a_prompt_chunk():
    batch = pack_step(_step(), BS, scratch_slot=99, decode_kernel=False)
    assert batch.input_ids == [23, 16, 91, 92, 93]
    assert [d.seq.request_id for d in batch.decodes] == ["p"]
    assert [(item.seq.request_id, row) for item, row in batch.prefills] == [("d", 1)]
    assert batch.keep == [0, 1, 2, 3, 4] and batch.sampled_entries == [1, 0]
