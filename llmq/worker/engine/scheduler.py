"""Continuous batching: which sequences run in the next step and how many tokens each.

Pure: no torch, no Redis, no clock. Each step is built under three budgets: sequences per
step (``max_batch_size``), tokens per step (``max_batch_tokens``, which chunks long prefills)
and free KV blocks. A step that carries decodes takes at most
``max_prefill_tokens_with_decodes`` prompt tokens: every running stream waits for the whole
step, so a big prefill beside decodes is a long gap between tokens for all of them; alone,
prompts get the whole token budget. Running sequences come first (decodes and unfinished
prefill chunks, by priority then arrival), except prefill chunks of lower priority than the
best waiting request, which go last; waiting ones fill what is left. When blocks run
out the scheduler preempts the running sequence that would run last, frees its blocks and
recomputes it later: nothing is dropped.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field

from llmq.worker.engine.block_manager import BlockManager
from llmq.worker.engine.sequence import FinishReason, Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledSequence:
    seq: Sequence
    start: int  # tokens already in the KV cache before this step
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the sequence's tokens and so yields a token."""
        return self.start + self.num_new_tokens == self.seq.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


@dataclass(slots=True)
class SequenceUpdate:
    """What one step did for one sequence that produced a token."""

    seq: Sequence
    token_id: int
    finish_reason: FinishReason | None


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_batch_size: int,
        max_batch_tokens: int,
        max_model_len: int,
        eos_token_ids: set[int] | frozenset[int] = frozenset(),
        max_prefill_tokens_with_decodes: int | None = None,
    ):
        self.block_manager = block_manager
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        # None: no cap beyond max_batch_tokens
        self.max_prefill_tokens_with_decodes = max_prefill_tokens_with_decodes or max_batch_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: list[Sequence] = []  # sorted by (priority, arrival)
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # ---- requests ------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=Sequence.sort_key)

    def abort(self, seq: Sequence) -> None:
        if seq.is_finished:
            return
        self._finish(seq, FinishReason.ABORT)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_batch_tokens
        bm = self.block_manager
        self.running.sort(key=Sequence.sort_key)
        # A sequence with one token left to compute decodes; any other is (still) prefilling.
        decoding = any(s.num_tokens - s.num_computed_tokens == 1 for s in self.running)
        prefill_budget = self.max_prefill_tokens_with_decodes if decoding else budget

        # A running prompt of lower priority than the best waiting request yields the prompt
        # budget to it: otherwise a long batch-job prompt, chunked beside decodes, would keep
        # an interactive arrival waiting for every one of its chunks.
        best_waiting = self.waiting[0].priority if self.waiting else None
        deferred: list[Sequence] = []

        def last_running() -> Sequence:
            victim = self.running.pop()
            if victim in deferred:
                deferred.remove(victim)
            return victim

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = seq.num_tokens - seq.num_computed_tokens
            if num_new > 1:
                if best_waiting is not None and best_waiting < seq.priority:
                    deferred.append(seq)
                    i += 1
                    continue
                num_new = min(num_new, prefill_budget)
                if num_new < 1:  # this step's prompt tokens are spent: decodes only
                    i += 1
                    continue
            num_new = min(num_new, budget)
            if self._allocate_or_preempt(seq, num_new, last_running, out):
                out.scheduled.append(ScheduledSequence(seq, seq.num_computed_tokens, num_new))
                budget -= num_new
                if num_new > 1:
                    prefill_budget -= num_new
                i += 1

        # A step that had to preempt admits nothing new: the pool is already short. A step
        # that admits a request admits none of lower priority beside it: batch-job prefills
        # would lengthen the step that gives an interactive request its first token.
        first_priority: int | None = None
        while (
            not out.preempted
            and self.waiting
            and min(budget, prefill_budget) > 0
            and len(self.running) < self.max_batch_size
        ):
            seq = self.waiting[0]
            if first_priority is not None and seq.priority > first_priority:
                break
            cached = bm.find_cached_prefix(seq)
            num_new = min(seq.num_tokens - len(cached) * bm.block_size, budget, prefill_budget)
            if not bm.allocate(seq, num_new, cached):
                break
            self.waiting.pop(0)
            first_priority = seq.priority if first_priority is None else first_priority
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSequence(seq, seq.num_computed_tokens, num_new))
            budget -= num_new
            prefill_budget -= num_new

        # The deferred prompts take what is left, unless higher-priority work was admitted
        # beside them. Short of blocks, the last of them give theirs back (none is scheduled
        # yet), so a waiting request that found the pool full gets in next step.
        while deferred and (first_priority is None or deferred[0].priority <= first_priority):
            seq = deferred.pop(0)
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget, prefill_budget)
            if num_new < 1:
                break

            def last_deferred(seq: Sequence = seq) -> Sequence:
                victim = deferred.pop() if deferred else seq
                self.running.remove(victim)
                return victim

            if self._allocate_or_preempt(seq, num_new, last_deferred, out):
                out.scheduled.append(ScheduledSequence(seq, seq.num_computed_tokens, num_new))
                budget -= num_new
                prefill_budget -= num_new
        return out

    def _allocate_or_preempt(
        self,
        seq: Sequence,
        num_new: int,
        next_victim: Callable[[], Sequence],
        out: SchedulerOutput,
    ) -> bool:
        """Blocks for ``num_new`` more tokens of ``seq``, preempting ``next_victim()`` (taken
        out of ``running``) until they fit; False if ``seq`` itself had to go."""
        while not self.block_manager.allocate(seq, num_new):
            victim = next_victim()
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def update(self, out: SchedulerOutput, sampled: list[int | None]) -> list[SequenceUpdate]:
        """Apply one step's results: ``sampled[i]`` is the token drawn for ``out.scheduled[i]``
        (None where that entry was a prefill chunk that does not sample)."""
        updates: list[SequenceUpdate] = []
        bm = self.block_manager
        for item, token in zip(out.scheduled, sampled, strict=True):
            seq = item.seq
            if seq.is_finished:  # aborted while the step ran
                continue
            seq.num_computed_tokens = item.start + item.num_new_tokens
            bm.cache_full_blocks(seq)
            if not item.samples:
                continue
            assert token is not None
            seq.append_token(token)
            reason = self._stop_reason(seq, token)
            if reason is not None:
                self._finish(seq, reason)
            updates.append(SequenceUpdate(seq, token, reason))
        return updates

    # ---- internals -----------------------------------------------------------------------
    def _stop_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        params = seq.params
        if seq.num_output_tokens >= params.min_tokens and (
            (token in self.eos_token_ids and not params.ignore_eos)
            or token in params.stop_token_ids
        ):
            return FinishReason.STOP
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.add(seq)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
