"""Scheduler: pure, no torch.

Unit tests of chunked prefill, budgets, priorities, preemption, stop reasons and batch against
interactive admission (the random workloads: test_scheduler_workloads.py).
"""

from __future__ import annotations

import pytest

from llmq.common.sampling_params import SamplingParams
from llmq.worker.engine.block_manager import BlockManager
from llmq.worker.engine.scheduler import Scheduler, SchedulerOutput
from llmq.worker.engine.sequence import FinishReason, Sequence, SequenceStatus
from tests.engine_sequences import BS, make_seq, prefix

pytestmark = pytest.mark.unit


def run_step(sched: Scheduler, token: int = 7) -> tuple[SchedulerOutput, list]:
    out = sched.schedule()
    sampled = [token if item.samples else None for item in out.scheduled]
    return out, sched.update(out, sampled)


def make_sched(num_blocks=64, block_size=BS, max_batch_size=8, max_batch_tokens=64, **kw):
    bm = BlockManager(num_blocks, block_size, kw.pop("enable_prefix_caching", True))
    max_model_len = kw.pop("max_model_len", num_blocks * block_size)
    return Scheduler(bm, max_batch_size, max_batch_tokens, max_model_len, **kw)


def test_chunked_prefill_then_decode():
    sched = make_sched(max_batch_tokens=32)
    seq = make_seq("a", prefix(80), max_tokens=3)
    sched.add(seq)
    chunks = []
    for _ in range(3):
        out = sched.schedule()
        (item,) = out.scheduled
        samples = item.samples  # read before update: it compares with the sequence's length
        chunks.append((item.start, item.num_new_tokens, samples))
        updates = sched.update(out, [7 if samples else None])
        assert len(updates) == int(samples)
    assert chunks == [(0, 32, False), (32, 32, False), (64, 16, True)]
    assert seq.output_token_ids == [7]
    out = sched.schedule()
    assert [(i.start, i.num_new_tokens, i.samples) for i in out.scheduled] == [(80, 1, True)]
    sched.update(out, [7])
    out, updates = run_step(sched)
    assert updates[0].finish_reason is FinishReason.LENGTH
    assert seq.output_token_ids == [7, 7, 7]
    assert not sched.has_unfinished()
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_decodes_first_and_token_budget():
    sched = make_sched(max_batch_tokens=20)
    a = make_seq("a", prefix(10), arrival=0, max_tokens=50)
    sched.add(a)
    run_step(sched)  # a prefilled
    b = make_seq("b", prefix(30, 300), arrival=1, max_tokens=5)
    sched.add(b)
    out, _ = run_step(sched)
    assert [(i.seq.request_id, i.start, i.num_new_tokens) for i in out.scheduled] == [
        ("a", 10, 1),
        ("b", 0, 19),
    ]
    assert out.num_tokens == 20
    out = sched.schedule()
    assert [(i.seq.request_id, i.start, i.num_new_tokens) for i in out.scheduled] == [
        ("a", 11, 1),
        ("b", 19, 11),
    ]
    assert out.scheduled[1].samples


def test_prompt_tokens_beside_decodes_are_capped():
    """A step with decodes takes at most max_prefill_tokens_with_decodes prompt tokens, over
    running chunks and new admissions together; without decodes prompts get the whole budget."""
    sched = make_sched(max_batch_tokens=64, max_prefill_tokens_with_decodes=12)
    a = make_seq("a", prefix(10), arrival=0, max_tokens=50)
    b = make_seq("b", prefix(30, 300), arrival=1, max_tokens=5)
    sched.add(a)
    sched.add(b)
    out, _ = run_step(sched)  # nothing decodes yet: both prompts in one step
    assert [(i.seq.request_id, i.num_new_tokens) for i in out.scheduled] == [("a", 10), ("b", 30)]
    c = make_seq("c", prefix(40, 600), arrival=2, max_tokens=5)
    d = make_seq("d", prefix(8, 900), arrival=3, max_tokens=5)
    sched.add(c)
    sched.add(d)
    steps = []
    for _ in range(4):
        out, _ = run_step(sched)
        steps.append([(i.seq.request_id, i.num_new_tokens) for i in out.scheduled])
    assert steps == [
        [("a", 1), ("b", 1), ("c", 12)],  # c chunked to the cap; d waits (no budget left)
        [("a", 1), ("b", 1), ("c", 12)],  # c, running, takes the whole cap again
        [("a", 1), ("b", 1), ("c", 12)],
        [("a", 1), ("b", 1), ("c", 4), ("d", 8)],  # c's last 4, then d in what is left
    ]
    # Unset: the whole token budget, as before.
    plain = make_sched(max_batch_tokens=64)
    plain.add(make_seq("a", prefix(10), arrival=0, max_tokens=50))
    run_step(plain)
    plain.add(make_seq("c", prefix(40, 600), arrival=2, max_tokens=5))
    out, _ = run_step(plain)
    assert [(i.seq.request_id, i.num_new_tokens) for i in out.scheduled] == [("a", 1), ("c", 40)]


def test_max_batch_size_limits_admission():
    sched = make_sched(max_batch_size=2, max_batch_tokens=256)
    seqs = [make_seq(str(i), prefix(5, 10 * i), arrival=i, max_tokens=3) for i in range(4)]
    for s in seqs:
        sched.add(s)
    out, _ = run_step(sched)
    assert [i.seq.request_id for i in out.scheduled] == ["0", "1"]
    assert sched.num_running == 2 and sched.num_waiting == 2
    steps = 1
    while sched.has_unfinished():
        out, _ = run_step(sched)
        assert len(out.scheduled) <= 2
        steps += 1
        assert steps < 50
    assert all(s.finish_reason is FinishReason.LENGTH for s in seqs)


def test_priority_orders_admission():
    sched = make_sched(max_batch_size=1)
    low = make_seq("low", prefix(5), arrival=0, priority=5, max_tokens=1)
    high = make_seq("high", prefix(5, 50), arrival=1, priority=0, max_tokens=1)
    sched.add(low)
    sched.add(high)
    out, _ = run_step(sched)
    assert [i.seq.request_id for i in out.scheduled] == ["high"]
    out, _ = run_step(sched)
    assert [i.seq.request_id for i in out.scheduled] == ["low"]


def test_preempts_newest_and_recomputes():
    # 4 blocks of 4 tokens; two sequences of 6 tokens take 2 blocks each, then need more.
    sched = make_sched(num_blocks=4, block_size=4, max_batch_tokens=64)
    a = make_seq("a", prefix(6), arrival=0, max_tokens=6)
    b = make_seq("b", prefix(6, 50), arrival=1, max_tokens=6)
    sched.add(a)
    sched.add(b)
    out, _ = run_step(sched)
    assert len(out.scheduled) == 2
    run_step(sched)  # 8 tokens each, still 2 blocks
    run_step(sched)
    out, _ = run_step(sched)  # a needs a third block: b is preempted
    assert out.preempted == [b]
    assert [i.seq.request_id for i in out.scheduled] == ["a"]
    assert b.status is SequenceStatus.WAITING and b.block_table == []
    assert b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert sched.num_preemptions == 1
    assert b.output_token_ids == [7, 7, 7]  # kept: recomputed as prompt later
    sched.block_manager.check_invariants([a, b])
    steps = 0
    while sched.has_unfinished():
        out, _ = run_step(sched)
        for item in out.scheduled:
            if item.seq is b and item.start == 0:
                # recompute covers prompt and the tokens it had generated
                assert item.num_new_tokens == b.num_tokens
        sched.block_manager.check_invariants([s for s in (a, b) if not s.is_finished])
        steps += 1
        assert steps < 50
    assert a.output_token_ids == [7] * 6 and b.output_token_ids == [7] * 6
    assert sched.block_manager.num_free_blocks == 4


def test_preemption_victim_is_lowest_priority():
    sched = make_sched(num_blocks=4, block_size=4, max_batch_tokens=64)
    a = make_seq("a", prefix(6), arrival=0, priority=1, max_tokens=6)
    b = make_seq("b", prefix(6, 50), arrival=1, priority=0, max_tokens=6)
    sched.add(a)
    sched.add(b)
    for _ in range(3):
        run_step(sched)
    out, _ = run_step(sched)
    assert out.preempted == [a]
    assert [i.seq.request_id for i in out.scheduled] == ["b"]


def test_stop_reasons():
    sched = make_sched(eos_token_ids={2})
    eos = make_seq("eos", prefix(3), ignore_eos=False, max_tokens=10)
    ign = make_seq("ign", prefix(3, 20), ignore_eos=True, max_tokens=3)
    mint = make_seq("min", prefix(3, 40), ignore_eos=False, min_tokens=2, max_tokens=10)
    stop = make_seq("stop", prefix(3, 60), stop_token_ids=[9], max_tokens=10)
    for s in (eos, ign, mint, stop):
        sched.add(s)
    out, updates = run_step(sched, token=2)
    reasons = {u.seq.request_id: u.finish_reason for u in updates}
    assert reasons == {"eos": FinishReason.STOP, "ign": None, "min": None, "stop": None}
    out, updates = run_step(sched, token=2)
    reasons = {u.seq.request_id: u.finish_reason for u in updates}
    assert reasons == {"ign": None, "min": FinishReason.STOP, "stop": None}
    out, updates = run_step(sched, token=9)
    reasons = {u.seq.request_id: u.finish_reason for u in updates}
    assert reasons == {"ign": FinishReason.LENGTH, "stop": FinishReason.STOP}
    assert not sched.has_unfinished()


def test_max_model_len_stops():
    sched = make_sched(max_model_len=10)
    s = make_seq("a", prefix(8), max_tokens=100)
    sched.add(s)
    run_step(sched)
    _, updates = run_step(sched)
    assert updates[0].finish_reason is FinishReason.LENGTH
    assert s.num_tokens == 10


def test_abort_waiting_and_running_frees_blocks():
    sched = make_sched(max_batch_size=1)
    a = make_seq("a", prefix(40), max_tokens=5)
    b = make_seq("b", prefix(40, 300), arrival=1, max_tokens=5)
    sched.add(a)
    sched.add(b)
    run_step(sched)
    bm = sched.block_manager
    assert bm.num_used_blocks == 3
    sched.abort(b)  # waiting
    assert b.finish_reason is FinishReason.ABORT and sched.num_waiting == 0
    sched.abort(a)  # running
    assert a.finish_reason is FinishReason.ABORT and a.block_table == []
    assert bm.num_used_blocks == 0
    sched.abort(a)  # twice: no effect
    assert a.finish_reason is FinishReason.ABORT
    bm.check_invariants([])
    assert not sched.has_unfinished()


def test_abort_while_step_runs_is_skipped():
    sched = make_sched()
    a = make_seq("a", prefix(10), max_tokens=5)
    b = make_seq("b", prefix(10, 300), arrival=1, max_tokens=5)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    sched.abort(a)
    updates = sched.update(out, [7, 7])
    assert [u.seq.request_id for u in updates] == ["b"]
    assert a.output_token_ids == [] and a.block_table == []
    sched.block_manager.check_invariants([b])


def test_scheduler_uses_prefix_cache_for_waiting():
    sched = make_sched(max_batch_tokens=256)
    shared = prefix(3 * BS)
    a = make_seq("a", shared + [1, 2], max_tokens=5)
    sched.add(a)
    run_step(sched)
    b = make_seq("b", shared + [3, 4, 5], arrival=1, max_tokens=2)
    sched.add(b)
    out, _ = run_step(sched)
    item = next(i for i in out.scheduled if i.seq is b)
    assert (item.start, item.num_new_tokens) == (3 * BS, 3)
    assert b.block_table[:3] == a.block_table[:3]
    assert b.num_cached_tokens == 3 * BS
    sched.block_manager.check_invariants([a, b])


# ---- random workloads --------------------------------------------------------------------------


# Prompts are cut from a few fixed documents over a tiny vocabulary, so prefixes are shared
# often and the prefix cache is exercised; generated tokens come from the same vocabulary.
def test_a_step_admitting_interactive_work_admits_no_batch_prefill_beside_it():
    bm = BlockManager(num_blocks=64, block_size=4)
    sched = Scheduler(bm, max_batch_size=8, max_batch_tokens=256, max_model_len=128)
    batch_line = Sequence(
        "batch", list(range(3, 40)), SamplingParams(max_tokens=4), priority=10, arrival=0
    )
    interactive = Sequence(
        "chat", list(range(3, 20)), SamplingParams(max_tokens=4), priority=0, arrival=1
    )
    sched.add(batch_line)
    sched.add(interactive)
    first = sched.schedule()
    assert [s.seq.request_id for s in first.scheduled] == ["chat"]
    sched.update(first, [5])
    second = sched.schedule()
    assert {s.seq.request_id for s in second.scheduled} == {"chat", "batch"}


def test_a_chunked_batch_prompt_yields_its_prompt_budget_to_an_interactive_arrival():
    """A long batch-job prompt chunked beside decodes does not keep an interactive arrival
    waiting for its remaining chunks: the arrival is admitted next step, the batch chunk waits
    that step out, then resumes."""
    sched = make_sched(max_batch_tokens=64, max_prefill_tokens_with_decodes=16)
    chat = make_seq("chat", prefix(4), arrival=0, max_tokens=50)
    sched.add(chat)
    run_step(sched)  # chat prefilled: it decodes from now on
    batch = make_seq("batch", prefix(100, 300), arrival=1, priority=1, max_tokens=3)
    sched.add(batch)
    out, _ = run_step(sched)
    assert [(i.seq.request_id, i.num_new_tokens) for i in out.scheduled] == [
        ("chat", 1),
        ("batch", 16),
    ]
    late = make_seq("late", prefix(20, 600), arrival=2, max_tokens=3)
    sched.add(late)
    steps = []
    for _ in range(3):
        out, _ = run_step(sched)
        steps.append([(i.seq.request_id, i.start, i.num_new_tokens) for i in out.scheduled])
    assert steps == [
        [("chat", 5, 1), ("late", 0, 16)],  # the batch chunk waits out the admitting step
        [("chat", 6, 1), ("late", 16, 4), ("batch", 16, 12)],  # late's rest, then batch
        [("chat", 7, 1), ("late", 20, 1), ("batch", 28, 16)],
    ]
    sched.block_manager.check_invariants([chat, batch, late])


def test_a_deferred_batch_prompt_gives_its_blocks_back_when_the_pool_is_full():
    """No deadlock: a batch prompt mid-prefill holds blocks an interactive arrival needs, and
    its own next chunk does not fit either: the batch prompt is preempted (recomputed later),
    the arrival runs next step, and everything finishes."""
    sched = make_sched(num_blocks=7, block_size=4, max_batch_tokens=16)
    batch = make_seq("batch", prefix(24), arrival=0, priority=1, max_tokens=2)
    sched.add(batch)
    out, _ = run_step(sched)
    assert [(i.seq.request_id, i.num_new_tokens) for i in out.scheduled] == [("batch", 16)]
    other = make_seq("other", prefix(4, 50), arrival=1, max_tokens=20)
    sched.add(other)
    out, _ = run_step(sched)  # other admitted; the batch chunk waits out that step
    assert [(i.seq.request_id, i.num_new_tokens) for i in out.scheduled] == [("other", 4)]
    chat = make_seq("chat", prefix(16, 80), arrival=2, max_tokens=2)
    sched.add(chat)
    out, _ = run_step(sched)  # chat's 4 blocks do not fit (1 free), nor do batch's next 2
    assert out.preempted == [batch]
    assert [(i.seq.request_id, i.num_new_tokens) for i in out.scheduled] == [("other", 1)]
    out, _ = run_step(sched)
    assert [(i.seq.request_id, i.num_new_tokens) for i in out.scheduled] == [
        ("other", 1),
        ("chat", 15),
    ]
    seqs = (batch, other, chat)
    steps = 0
    while sched.has_unfinished():
        run_step(sched)
        sched.block_manager.check_invariants([s for s in seqs if not s.is_finished])
        steps += 1
        assert steps < 60
    assert [len(s.output_token_ids) for s in seqs] == [2, 20, 2]
