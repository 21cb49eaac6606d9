"""Scheduler and prefix cache: what a prompt found in the cache costs a step, and where it is
admitted among the waiting requests. Pure, no torch."""

from __future__ import annotations

import pytest

from llmq.worker.engine.block_manager import BlockManager
from llmq.worker.engine.scheduler import Scheduler, SchedulerOutput
from llmq.worker.engine.sequence import Sequence, SequenceStatus
from tests.engine_sequences import BS, make_seq, prefix

pytestmark = pytest.mark.unit

REPEATED = prefix(2 * BS, 500)  # two full blocks: cached whole once computed


def make_sched(
    max_batch_size=64, max_batch_tokens=256, prefill_cap=2 * BS, num_blocks=256
) -> Scheduler:
    bm = BlockManager(num_blocks, BS)
    return Scheduler(bm, max_batch_size, max_batch_tokens, 256 * BS, set(), prefill_cap)


def step(sched: Scheduler) -> SchedulerOutput:
    out = sched.schedule()
    sched.update(out, [7 if item.samples else None for item in out.scheduled])
    return out


def shape(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    return [(i.seq.request_id, i.start, i.num_new_tokens) for i in out.scheduled]


def decoding(sched: Scheduler) -> Sequence:
    """A running sequence that has computed REPEATED (its blocks now cached) and decodes."""
    first = make_seq("first", REPEATED, arrival=0, max_tokens=100)
    sched.add(first)
    step(sched)
    return first


def test_a_prompt_cached_whole_costs_one_token():
    sched = make_sched()
    first = decoding(sched)
    again = make_seq("again", REPEATED, arrival=1, max_tokens=5)
    sched.add(again)
    out = step(sched)
    assert shape(out) == [("first", 2 * BS, 1), ("again", 2 * BS - 1, 1)]
    assert again.block_table[:2] == first.block_table[:2]
    assert again.num_cached_tokens == 2 * BS - 1
    assert len(again.output_token_ids) == 1
    # Its first output token goes to a block of its own.
    out = step(sched)
    assert len(again.block_table) == 3 and again.block_table[2] != first.block_table[2]
    sched.block_manager.check_invariants([first, again])


def test_cached_prompts_go_ahead_of_uncached_ones():
    """Beside decodes, prompts the cache holds are admitted ahead of the uncached prompts
    queued before them, which keep the rest of the step's prompt tokens: before, each hit
    waited a step behind every miss ahead of it."""
    sched = make_sched()
    decoding(sched)
    misses = [make_seq(f"u{i}", prefix(2 * BS, 1000 + 100 * i), 1 + 2 * i) for i in range(3)]
    hits = [make_seq(f"h{i}", REPEATED, 2 + 2 * i, max_tokens=5) for i in range(3)]
    for seq in misses + hits:
        sched.add(seq)
    out = step(sched)
    assert shape(out) == [
        ("first", 2 * BS, 1),
        ("h0", 2 * BS - 1, 1),
        ("h1", 2 * BS - 1, 1),
        ("h2", 2 * BS - 1, 1),
        ("u0", 0, 2 * BS - 3),  # the head: the prompt tokens the hits left
    ]
    assert [s.request_id for s in sched.waiting] == ["u1", "u2"]
    assert all(len(h.output_token_ids) == 1 for h in hits)


def test_the_head_of_the_queue_keeps_half_the_prompt_tokens():
    """Short prefills take at most half of a step's prompt tokens: a long prompt at the head
    of the queue is slowed, never starved, however many short ones queue behind it."""
    sched = make_sched()
    decoding(sched)
    head = make_seq("head", prefix(4 * BS, 2000), arrival=1, max_tokens=5)
    sched.add(head)
    hits = [make_seq(f"h{i}", REPEATED, 2 + i, max_tokens=50) for i in range(40)]
    for seq in hits:
        sched.add(seq)
    out = step(sched)
    admitted = [i.seq for i in out.scheduled if i.seq in hits]
    assert len(admitted) == BS  # half of the 2 * BS prompt tokens, one token each
    assert (head.num_computed_tokens, out.num_tokens) == (BS, 1 + 2 * BS)
    # Short uncached prompts count their whole length against the same half.
    sched2 = make_sched()
    decoding(sched2)
    long = make_seq("long", prefix(4 * BS, 3000), arrival=1)
    short = [make_seq(f"s{i}", prefix(BS // 2 + 1, 4000 + 50 * i), 2 + i) for i in range(3)]
    for seq in [long, *short]:
        sched2.add(seq)
    out = step(sched2)
    assert shape(out) == [
        ("first", 2 * BS, 1),
        ("s0", 0, BS // 2 + 1),
        ("long", 0, 3 * BS // 2 - 1),
    ]


def test_a_passed_over_head_keeps_a_batch_slot():
    """Short requests that keep coming (each done in the step that admits it) do not take
    every batch slot that frees from the long prompt at the head of the queue."""
    sched = make_sched(max_batch_size=3)
    decoding(sched)
    other = make_seq("other", prefix(BS, 900), arrival=1, max_tokens=100)
    sched.add(other)
    step(sched)  # two of the three slots taken by decoding streams
    head = make_seq("head", prefix(4 * BS, 2000), arrival=2, max_tokens=5)
    sched.add(head)
    sched.add(make_seq("h0", REPEATED, arrival=3, max_tokens=1))
    out = step(sched)
    assert [i.seq.request_id for i in out.scheduled] == ["first", "other", "head"]
    assert [s.request_id for s in sched.waiting] == ["h0"]


def test_a_passed_over_head_keeps_the_blocks_of_its_chunk():
    """Short requests that keep coming do not take the free blocks the head of the queue
    needs for its chunk, one freed block after another."""
    sched = make_sched(num_blocks=7)
    bm = sched.block_manager
    decoding(sched)  # 3 blocks: REPEATED and its first output
    big = make_seq("big", prefix(30, 900), arrival=1, max_tokens=100)
    sched.add(big)
    step(sched)  # big: 2 blocks; 2 left
    assert bm.num_free_blocks == 2
    head = make_seq("head", prefix(4 * BS, 2000), arrival=2, max_tokens=5)
    sched.add(head)
    # One cached block and 3 tokens more: a new block for those, freed when it ends.
    sched.add(make_seq("s0", REPEATED[:BS] + [1, 2, 3], arrival=3, max_tokens=1))
    out = step(sched)  # the head's chunk, the step's 2 * BS prompt tokens, takes both blocks
    assert shape(out) == [("first", 2 * BS + 1, 1), ("big", 30, 1), ("head", 0, 2 * BS)]
    assert [s.request_id for s in sched.waiting] == ["s0"]


def test_short_prefills_do_not_pass_better_priorities():
    """Only requests of the best waiting priority go ahead: a cached batch-job prompt waits
    behind an interactive miss (and, being of lower priority, is not admitted beside it)."""
    sched = make_sched()
    decoding(sched)
    interactive = make_seq("chat", prefix(2 * BS, 5000), arrival=1, priority=0)
    batch_hit = make_seq("batch", REPEATED, arrival=2, priority=10, max_tokens=5)
    sched.add(interactive)
    sched.add(batch_hit)
    out = step(sched)
    assert shape(out) == [("first", 2 * BS, 1), ("chat", 0, 2 * BS)]
    assert sched.waiting == [batch_hit]


def test_no_short_admission_in_a_step_that_preempted():
    """A step that preempted admits nothing, short or not: the pool is already short."""
    bm = BlockManager(4, BS)
    sched = Scheduler(bm, 8, 256, 4 * BS, set(), 2 * BS)
    a = make_seq("a", prefix(2 * BS - 1, 600), arrival=0, max_tokens=100)
    b = make_seq("b", prefix(BS, 700), arrival=1, max_tokens=100)
    sched.add(a)
    sched.add(b)
    step(sched)  # both prefilled: a holds 2 blocks, b 1
    step(sched)  # b's first output takes the last free block
    assert bm.num_free_blocks == 0
    again = make_seq("again", prefix(BS, 700), arrival=2, max_tokens=5)  # b's block, cached
    sched.add(again)
    out = sched.schedule()  # a's next token needs a block: b, the newest, is preempted
    assert [v.request_id for v in out.preempted] == ["b"]
    assert [i.seq.request_id for i in out.scheduled] == ["a"]
    assert again.status is SequenceStatus.WAITING
