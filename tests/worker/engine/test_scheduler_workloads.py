"""Scheduler: pure, no torch. A hypothesis state machine and 200 seeded random workloads that
drive the scheduler with random arrivals, aborts, pools and budgets while simulating the runner,
including what each KV slot holds; with speculation, drafts (partly right) checked in the step
and the rejected ones' KV left behind.
"""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)

from llmq.common.sampling_params import SamplingParams
from llmq.worker.engine.block_manager import BlockManager
from llmq.worker.engine.scheduler import Scheduler
from llmq.worker.engine.sequence import FinishReason, Sequence, SequenceStatus
from llmq.worker.spec.speculator import Speculator

pytestmark = pytest.mark.unit


DOCS = [[(i * 7 + d * 3) % 5 + 1 for i in range(120)] for d in range(3)]
EOS = 0


def model_token(seq: Sequence, context_len: int) -> int:
    """The simulated model's token after ``context_len`` tokens of ``seq``."""
    return (context_len * 3 + len(seq.request_id)) % 6


def checked_run(speculator, item, stats: dict[str, int]) -> list[int] | None:
    """The tokens a scheduled entry yields: the simulated model's draws at each position,
    checked against its draft (``stats`` counts the drafts' tokens kept and drafts rejected)."""
    if not item.samples:
        return None
    n = item.seq.num_tokens
    draws = [model_token(item.seq, n + j) for j in range(len(item.draft) + 1)]
    if not item.draft:
        return draws
    run = speculator.verify(item, draws)
    stats["draft accepted"] += len(run) - 1
    stats["draft rejected"] += len(run) <= len(item.draft)
    return run


class GuessingProposer:
    """Drafts the simulated model's tokens, each wrong with probability 1/4; none at times."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        drafts = []
        for seq, k in zip(seqs, limits, strict=True):
            n = self.rng.randint(0, k)
            draft = [model_token(seq, seq.num_tokens + j) for j in range(n)]
            drafts.append([t if self.rng.random() < 0.75 else (t + 1) % 6 for t in draft])
        return drafts

    def forget(self, seq: Sequence) -> None:
        pass


class Workload:
    """A scheduler and block manager driven like LLMEngine drives them, with a simulated runner
    that writes every computed token into a model of the KV pool and reads each scheduled
    sequence's whole context back from it. Checks everything it can after every step."""

    def __init__(
        self,
        block_size,
        num_blocks,
        max_batch_size,
        max_batch_tokens,
        model_len_cap,
        caching,
        prefill_cap=None,
        cache_share=None,
        cache_floor=0,
        spec=0,
    ):
        """``spec``: most draft tokens per sequence and step (0: no speculation)."""
        self.bm = BlockManager(num_blocks, block_size, caching, cache_share, cache_floor)
        # As LLMEngine does: one sequence alone always fits, every decode fits the budget.
        self.max_model_len = min(model_len_cap, num_blocks * block_size)
        self.sched = Scheduler(
            self.bm,
            max_batch_size=max_batch_size,
            max_batch_tokens=max(max_batch_tokens, max_batch_size),
            max_model_len=self.max_model_len,
            eos_token_ids={EOS},
            max_prefill_tokens_with_decodes=prefill_cap,
        )
        self.seqs: list[Sequence] = []
        self.kv: dict[tuple[int, int], int] = {}  # (block, offset) -> token held there
        self.stats = {
            "preemption": 0,
            "partial prefill chunk": 0,
            "prefix cache hit": 0,
            "whole sequence cached": 0,
            "draft accepted": 0,
            "draft rejected": 0,
        }
        self.speculator = None
        if spec:
            proposer = GuessingProposer(num_blocks * 1000 + max_batch_tokens)
            self.speculator = Speculator(proposer, spec, max_batch_size, self.max_model_len)

    def live(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.is_finished]

    def add(self, doc, shared, suffix, max_tokens, min_tokens, priority, ignore_eos) -> None:
        prompt = (DOCS[doc][:shared] + suffix)[: self.max_model_len - 1] or [1]
        n = len(self.seqs)
        params = SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens, ignore_eos=ignore_eos)
        seq = Sequence(f"r{n}", prompt, params, priority=priority, arrival=n)
        self.seqs.append(seq)
        self.sched.add(seq)

    def abort(self, index: int) -> None:
        live = self.live()
        if not live:
            return
        seq = live[index % len(live)]
        used = self.bm.num_used_blocks
        exclusive = sum(1 for b in seq.block_table if self.bm.blocks[b].ref_count == 1)
        self.sched.abort(seq)
        assert seq.finish_reason is FinishReason.ABORT
        assert seq.block_table == []
        assert self.bm.num_used_blocks == used - exclusive
        assert seq not in self.sched.running and seq not in self.sched.waiting

    def step(self, abort_index: int | None = None) -> None:
        """One engine step; ``abort_index``: abort that scheduled entry while the step runs."""
        sched, bm = self.sched, self.bm
        had_work = sched.has_unfinished()
        before = {id(s): s.num_computed_tokens for s in sched.running}
        if self.speculator is not None:
            self.speculator.prepare(sched.running)
        out = sched.schedule()
        if had_work:
            assert out, "unfinished work but an empty step: the scheduler is stuck"
        assert out.num_tokens <= sched.max_batch_tokens
        assert len(out.scheduled) <= sched.max_batch_size
        assert sched.num_running <= sched.max_batch_size
        assert len({id(i.seq) for i in out.scheduled}) == len(out.scheduled)
        bs = bm.block_size
        for victim in out.preempted:
            assert victim.status is SequenceStatus.WAITING and victim.block_table == []
            assert all(i.seq is not victim for i in out.scheduled)
        for item in out.scheduled:
            seq = item.seq
            assert seq.status is SequenceStatus.RUNNING
            assert item.num_new_tokens >= 1
            assert item.start == seq.num_computed_tokens
            if id(seq) in before:  # was running: resumes where it was
                assert item.start == before[id(seq)]
            else:  # admitted: starts after its prefix-cache hit, if any: whole blocks, or
                # all but the last token of a sequence found in the cache whole
                assert item.start == seq.num_cached_tokens
                assert item.start % bs == 0 or item.start == seq.num_tokens - 1
                if item.start:
                    self.stats["prefix cache hit"] += 1
                if item.start and item.start == seq.num_tokens - 1 and item.start % bs:
                    self.stats["whole sequence cached"] += 1
            end = item.start + item.num_new_tokens
            context = seq.token_ids + item.draft
            assert end <= len(context) <= self.max_model_len
            assert not item.draft or item.start == seq.num_tokens - 1
            assert len(seq.block_table) == bm.blocks_needed(end)
            # The runner writes the new tokens' KV into the sequence's own blocks, except a
            # token whose registered block holds it already (it writes that one nowhere)...
            for p in range(item.start, end):
                block = seq.block_table[p // bs]
                if p // bs < seq.num_registered_blocks:
                    assert item.num_new_tokens == 1 and p == seq.num_tokens - 1
                    assert self.kv.get((block, p % bs)) == seq.token_ids[p]
                    continue
                assert bm.blocks[block].ref_count == 1, "writing into a shared block"
                self.kv[(block, p % bs)] = context[p]
        for item in out.scheduled:
            # ...and reads the whole context back: cached blocks must hold the right tokens.
            seq = item.seq
            end = item.start + item.num_new_tokens
            held = [self.kv.get((seq.block_table[p // bs], p % bs)) for p in range(end)]
            assert held == (seq.token_ids + item.draft)[:end], f"{seq.request_id} reads stale KV"
        self.stats["preemption"] += bool(out.preempted)
        self.stats["partial prefill chunk"] += any(not i.samples for i in out.scheduled)
        if abort_index is not None and out.scheduled:
            sched.abort(out.scheduled[abort_index % len(out.scheduled)].seq)
        if self.speculator is None:
            sampled = [
                model_token(i.seq, i.seq.num_tokens) if i.samples else None for i in out.scheduled
            ]
            updates = sched.update(out, sampled)
        else:
            updates = sched.update_runs(
                out, [checked_run(self.speculator, i, self.stats) for i in out.scheduled]
            )
        for u in updates:
            tokens = u.accepted + [u.token_id]
            assert u.seq.output_token_ids[-len(tokens) :] == tokens
            if u.finish_reason is not None:
                assert u.seq.is_finished and u.seq.block_table == []
            elif u.accepted or any(i.draft for i in out.scheduled if i.seq is u.seq):
                # a rejected draft's blocks went back; only computed tokens are registered
                held = len(u.seq.block_table)
                assert held <= bm.blocks_needed(u.seq.num_tokens)
                assert held >= bm.blocks_needed(u.seq.num_computed_tokens)
                assert u.seq.num_computed_tokens == u.seq.num_tokens - 1
                assert u.seq.num_registered_blocks * bs <= u.seq.num_computed_tokens

    def check(self) -> None:
        live = self.live()
        self.bm.check_invariants(live)
        if self.bm.cache_share is not None:  # the cache grows past its share into no new block
            bound = math.ceil(self.bm.most_used * (1 + self.bm.cache_share))
            assert self.bm.num_written_blocks <= max(bound, 1, self.bm.cache_floor)
        for s in live:
            assert (s in self.sched.running) != (s in self.sched.waiting)
            if s.status is SequenceStatus.WAITING:
                assert s.block_table == [] and s.num_computed_tokens == 0
        assert len(self.sched.running) + len(self.sched.waiting) == len(live)
        for s in self.seqs:
            assert s.num_output_tokens <= s.params.max_tokens
            assert s.num_tokens <= self.max_model_len

    def drain(self) -> None:
        """Step until everything finishes (within a generous bound); then every block is free."""
        bound = 50 + 20 * sum(s.num_tokens + s.params.max_tokens for s in self.seqs)
        n = 0
        while self.sched.has_unfinished():
            self.step()
            self.check()
            n += 1
            assert n <= bound, "sequences never finish"
        for s in self.seqs:
            assert s.is_finished
            if s.finish_reason is FinishReason.LENGTH:
                assert (
                    s.num_output_tokens == s.params.max_tokens or s.num_tokens == self.max_model_len
                )
            elif s.finish_reason is FinishReason.STOP:
                assert s.output_token_ids[-1] == EOS and not s.params.ignore_eos
                assert s.num_output_tokens >= s.params.min_tokens
        assert self.bm.num_free_blocks == self.bm.num_blocks
        self.bm.check_invariants([])


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        block_size=st.sampled_from([1, 2, 4, 8]),
        num_blocks=st.integers(2, 12),
        max_batch_size=st.integers(1, 8),
        max_batch_tokens=st.integers(1, 48),
        model_len_cap=st.integers(2, 120),
        caching=st.booleans(),
        cache_share=st.none() | st.sampled_from([0.0, 0.5, 1.0]),
        cache_floor=st.sampled_from([0, 3, 8]),
        spec=st.sampled_from([0, 0, 3]),
    )
    def setup(self, **kw):
        self.w = Workload(**kw)

    @rule(
        doc=st.integers(0, len(DOCS) - 1),
        shared=st.integers(0, 120),
        suffix=st.lists(st.integers(1, 5), max_size=12),
        max_tokens=st.integers(1, 40),
        min_tokens=st.integers(0, 3),
        priority=st.integers(0, 2),
        ignore_eos=st.booleans(),
    )
    def add(self, **kw):
        self.w.add(**kw)

    @rule(index=st.integers(0, 1000))
    def abort(self, index):
        self.w.abort(index)

    @rule(abort_index=st.none() | st.integers(0, 1000))
    def step(self, abort_index):
        seen = dict(self.w.stats)
        self.w.step(abort_index)
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


SchedulerMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestSchedulerMachine = SchedulerMachine.TestCase


def test_random_workloads_seeded():
    """The same checks over 200 seeded random workloads, which hit preemption, chunking and
    prefix-cache hits many times (hypothesis's small examples rarely fill the pool)."""
    totals = dict.fromkeys(Workload(1, 2, 1, 1, 2, True).stats, 0)
    for trial in range(200):
        r = random.Random(trial)
        w = Workload(
            r.choice([1, 2, 4, 8]),
            r.randint(2, 12),
            r.randint(1, 8),
            r.randint(1, 48),
            r.randint(2, 120),
            r.random() < 0.7,
            prefill_cap=[None, 1, 3, 16][trial % 4],
            cache_share=[None, 0.0, 1.0][trial % 3],
            cache_floor=[0, 5][trial % 2],
            spec=[0, 0, 4][trial % 3] if trial % 5 else 1,
        )
        for _ in range(40):
            x = r.random()
            if x < 0.4:
                suffix = [r.randint(1, 5) for _ in range(r.randint(0, 12))]
                w.add(
                    r.randrange(len(DOCS)),
                    r.randint(0, 120),
                    suffix,
                    r.randint(1, 40),
                    r.randint(0, 3),
                    r.randint(0, 2),
                    r.random() < 0.5,
                )
            elif x < 0.5:
                w.abort(r.randint(0, 1000))
            else:
                w.step(r.randint(0, 1000) if r.random() < 0.1 else None)
            w.check()
        w.drain()
        for name, count in w.stats.items():
            totals[name] += count
    assert all(count > 20 for count in totals.values()), totals
