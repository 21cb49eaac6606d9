"""The block manager of KV groups (sliding windows) under the scheduler: pure, no torch. A
hypothesis state machine and seeded random workloads drive them with random arrivals, aborts,
pools, budgets and windows while simulating the runner per group: each step writes every
computed token into a model of the pool and reads back, per group, every key its first new
token's window needs. Checked after every step: no block both free and held, reference counts,
no sliding group holding a block out of its window or more than its bound, hits exact. With
speculation, drafts (partly right) are checked in the step and a rejected draft's blocks go back
in every group.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from llmq.common.sampling_params import SamplingParams
from llmq.worker.engine.kv_groups import NULL_BLOCK, sequence_blocks
from llmq.worker.engine.scheduler import Scheduler
from llmq.worker.engine.sequence import FinishReason, Sequence, SequenceStatus
from llmq.worker.engine.windowed_blocks import WindowedBlockManager
from llmq.worker.spec.speculator import Speculator
from tests.worker.engine.test_scheduler_workloads import (
    GuessingProposer,
    checked_run,
)

pytestmark = pytest.mark.unit

DOCS = [[(i * 7 + d * 3) % 5 + 1 for i in range(120)] for d in range(3)]
EOS = 0
# Per KV group its window (None: full attention): Gemma 3's local and global, Mistral's all local
GROUPINGS = [(3, None), (5, 5, None), (4,), (2, 9)]


def longest_fitting(windows, num_blocks: int, bs: int, cap: int, chunk: int) -> int:
    """As the engine's sizing: the longest sequence whose blocks the pool holds alone."""
    fits = [
        n for n in range(1, cap + 1) if sequence_blocks(windows, n, bs, min(chunk, n)) <= num_blocks
    ]
    return max(fits, default=1)


class WindowedWorkload:
    def __init__(
        self, windows, block_size, num_blocks, max_batch_size, max_batch_tokens, cap, caching,
        spec=0,
    ):  # fmt: skip
        """``spec``: most draft tokens per sequence and step (0: no speculation)."""
        self.windows = windows
        self.bm = WindowedBlockManager(num_blocks, block_size, windows, caching, cache_share=0.5)
        self.max_batch_tokens = max(max_batch_tokens, max_batch_size)
        self.max_model_len = max(
            2, longest_fitting(windows, num_blocks, block_size, cap, self.max_batch_tokens)
        )
        self.sched = Scheduler(
            self.bm,
            max_batch_size=max_batch_size,
            max_batch_tokens=self.max_batch_tokens,
            max_model_len=self.max_model_len,
            eos_token_ids={EOS},
        )
        self.seqs: list[Sequence] = []
        self.kv: dict[tuple[int, int], int] = {}  # (block, offset) -> token held there
        self.stats = {"preemption": 0, "prefix cache hit": 0, "block given back": 0}
        self.speculator = None
        if spec:
            self.stats |= {"draft accepted": 0, "draft rejected": 0}
            proposer = GuessingProposer(num_blocks * 1000 + max_batch_tokens)
            self.speculator = Speculator(proposer, spec, max_batch_size, self.max_model_len)

    def live(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.is_finished]

    def add(self, doc, shared, suffix, max_tokens) -> None:
        prompt = (DOCS[doc][:shared] + suffix)[: self.max_model_len - 1] or [1]
        n = len(self.seqs)
        seq = Sequence(f"r{n}", prompt, SamplingParams(max_tokens=max_tokens), arrival=n)
        self.seqs.append(seq)
        self.sched.add(seq)

    def abort(self, index: int) -> None:
        live = self.live()
        if live:
            seq = live[index % len(live)]
            self.sched.abort(seq)
            assert seq.finish_reason is FinishReason.ABORT
            assert not any(self.bm.tables(seq))

    def step(self) -> None:
        sched, bm, bs = self.sched, self.bm, self.bm.block_size
        had_work = sched.has_unfinished()
        if self.speculator is not None:
            self.speculator.prepare(sched.running)
        out = sched.schedule()
        assert out or not had_work, "unfinished work but an empty step: the scheduler is stuck"
        for victim in out.preempted:
            assert victim.status is SequenceStatus.WAITING and not any(bm.tables(victim))
        for item in out.scheduled:
            seq, end = item.seq, item.start + item.num_new_tokens
            context = seq.token_ids + item.draft
            if item.start and item.start == seq.num_cached_tokens:
                self.stats["prefix cache hit"] += 1
            for g, table in enumerate(bm.tables(seq)):
                assert len(table) == bm.blocks_needed(end)
                for p in range(item.start, end):
                    block = table[p // bs]
                    assert block != NULL_BLOCK, "a new token without its block"
                    if p // bs < seq.num_registered_blocks:  # a whole cached sequence's last
                        assert self.kv.get((block, p % bs)) == (g, seq.token_ids[p])
                        continue
                    assert bm.blocks[block].ref_count == 1, "writing into a shared block"
                    self.kv[(block, p % bs)] = (g, context[p])
        for item in out.scheduled:  # every layer reads the keys its first new token sees
            seq, end = item.seq, item.start + item.num_new_tokens
            context = seq.token_ids + item.draft
            for g, (window, table) in enumerate(zip(self.windows, bm.tables(seq), strict=True)):
                first = 0 if window is None else max(0, item.start - window + 1)
                held = [self.kv.get((table[p // bs], p % bs)) for p in range(first, end)]
                assert held == [(g, t) for t in context[first:end]], "stale KV read"
        self.stats["preemption"] += bool(out.preempted)
        held_before = sum(sum(bm.held_blocks(i.seq)) for i in out.scheduled)
        if self.speculator is None:
            sampled = [(len(i.seq.token_ids) * 3) % 6 if i.samples else None for i in out.scheduled]
            sched.update(out, sampled)
        else:
            sched.update_runs(
                out, [checked_run(self.speculator, i, self.stats) for i in out.scheduled]
            )
        live = [i.seq for i in out.scheduled if not i.seq.is_finished]
        if sum(sum(bm.held_blocks(s)) for s in live) < held_before and len(live) == len(
            out.scheduled
        ):
            self.stats["block given back"] += 1

    def check(self) -> None:
        live = self.live()
        self.bm.check_invariants(live, max_chunk_tokens=self.max_batch_tokens)
        for s in live:  # no block past what its tokens need (a rejected draft's given back)
            assert all(len(t) <= self.bm.blocks_needed(s.num_tokens) for t in self.bm.tables(s))
        for s in live:
            assert (s in self.sched.running) != (s in self.sched.waiting)
            if s.status is SequenceStatus.WAITING:
                assert not any(self.bm.tables(s)) and s.num_computed_tokens == 0
        for s in self.seqs:
            assert s.num_tokens <= self.max_model_len

    def drain(self) -> None:
        bound = 50 + 20 * sum(s.num_tokens + s.params.max_tokens for s in self.seqs)
        for _ in range(bound):
            if not self.sched.has_unfinished():
                break
            self.step()
            self.check()
        assert not self.sched.has_unfinished(), "sequences never finish"
        assert self.bm.num_free_blocks == self.bm.num_blocks
        self.bm.check_invariants([])


class WindowedMachine(RuleBasedStateMachine):
    @initialize(
        windows=st.sampled_from(GROUPINGS),
        block_size=st.sampled_from([1, 2, 4]),
        num_blocks=st.integers(6, 40),
        max_batch_size=st.integers(1, 6),
        max_batch_tokens=st.integers(1, 24),
        cap=st.integers(2, 100),
        caching=st.booleans(),
        spec=st.sampled_from([0, 0, 3]),
    )
    def setup(self, **kw):
        self.w = WindowedWorkload(**kw)

    @rule(
        doc=st.integers(0, len(DOCS) - 1),
        shared=st.integers(0, 120),
        suffix=st.lists(st.integers(1, 5), max_size=8),
        max_tokens=st.integers(1, 30),
    )
    def add(self, **kw):
        self.w.add(**kw)

    @rule(index=st.integers(0, 1000))
    def abort(self, index):
        self.w.abort(index)

    @rule()
    def step(self):
        seen = dict(self.w.stats)
        self.w.step()
        for name, count in self.w.stats.items():
            if count > seen[name]:
                event(name)

    @invariant()
    def consistent(self):
        if hasattr(self, "w"):
            self.w.check()

    def teardown(self):
        if hasattr(self, "w"):
            self.w.drain()


WindowedMachine.TestCase.settings = settings(
    max_examples=80,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestWindowedMachine = WindowedMachine.TestCase


def test_random_windowed_workloads_seeded():
    """The same checks over 120 seeded workloads, which preempt, give blocks back and hit the
    prefix cache many times (hypothesis's small examples rarely fill the pool)."""
    totals = dict.fromkeys(WindowedWorkload((3, None), 1, 6, 1, 1, 2, True, spec=1).stats, 0)
    for trial in range(120):
        r = random.Random(trial)
        w = WindowedWorkload(
            GROUPINGS[trial % len(GROUPINGS)],
            r.choice([1, 2, 4]),
            r.randint(8, 30),
            r.randint(2, 8),
            r.randint(1, 24),
            r.randint(20, 100),
            r.random() < 0.8,
            spec=(0, 4)[trial % 2],
        )
        for _ in range(40):
            x = r.random()
            if x < 0.5:
                suffix = [r.randint(1, 5) for _ in range(r.randint(0, 8))]
                w.add(r.randrange(len(DOCS)), r.randint(0, 120), suffix, r.randint(1, 60))
            elif x < 0.45:
                w.abort(r.randint(0, 1000))
            else:
                w.step()
            w.check()
        w.drain()
        for name, count in w.stats.items():
            totals[name] += count
    assert all(count > 20 for count in totals.values()), totals
