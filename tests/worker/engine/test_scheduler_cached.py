"""Scheduler and prefix cache: what a prompt found in the cache costs a step. Pure, no torch."""

from __future__ import annotations

import pytest

from llmq.worker.engine.block_manager import BlockManager
from llmq.worker.engine.scheduler import Scheduler, SchedulerOutput
from llmq.worker.engine.sequence import Sequence
from tests.engine_sequences import BS, make_seq, prefix

pytestmark = pytest.mark.unit

REPEATED = prefix(2 * BS, 500)  # two full blocks: cached whole once computed


def make_sched(max_batch_size=64, max_batch_tokens=256, prefill_cap=2 * BS) -> Scheduler:
    bm = BlockManager(256, BS)
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
