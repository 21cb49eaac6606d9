"""The engine's grammar-constrained sequences: those whose matcher is still being built (they
enter the scheduler once it is ready, so a build never stalls the others' steps) and the
matcher of each one that runs.

A matcher follows its sequence's tokens and nothing else: preemption and recompute, chunked
prefill and the prefix cache change none of them, so it keeps its state through all three. A
sequence resumed with tokens generated elsewhere replays them into a fresh matcher first.
"""

from __future__ import annotations

import logging
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field

import llguidance
import numpy as np

from llmq.worker.engine.sequence import Sequence
from llmq.worker.grammar_compiler import GrammarCompiler, GrammarError, first_line
from llmq.worker.runner.token_mask import TokenMask

log = logging.getLogger(__name__)

# Constrained rows from which the mask is filled by llguidance's thread pool rather than one
# matcher after another: below it the pool's overhead outweighs its gain (docs/performance.md,
# "Choices: serving").
PARALLEL_FILL_ROWS = 8


@dataclass(slots=True)
class StepConstraints:
    """What the matchers made of one step's tokens."""

    complete: set[Sequence] = field(default_factory=set)  # grammar done: finish with "stop"
    failed: dict[Sequence, str] = field(default_factory=dict)  # the error that ends each


class ConstrainedSequences:
    def __init__(self, compiler: GrammarCompiler, max_rows: int):
        self.compiler = compiler
        self.pending: dict[str, tuple[Sequence, Future[llguidance.LLMatcher]]] = {}
        self.matchers: dict[str, llguidance.LLMatcher] = {}
        self._executor: llguidance.LLExecutor | None = None
        words = -(-compiler.vocab_size // 32)
        self._bitmask = np.full((max_rows, words), -1, dtype=np.int32)

    # ---- sequences -----------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Start building ``seq``'s matcher; :meth:`ready` hands the sequence back."""
        self.pending[seq.request_id] = (seq, self.compiler.template(seq.params.grammar))

    def discard(self, request_id: str) -> bool:
        """Forget a request (finished or aborted); whether it was still waiting for its
        matcher."""
        self.matchers.pop(request_id, None)
        return self.pending.pop(request_id, None) is not None

    def ready(self) -> tuple[list[Sequence], list[tuple[Sequence, str]]]:
        """The pending sequences whose matcher is built (it now follows their tokens so far),
        and those whose grammar failed, with the error."""
        ready: list[Sequence] = []
        failed: list[tuple[Sequence, str]] = []
        for rid, (seq, future) in list(self.pending.items()):
            if not future.done():
                continue
            del self.pending[rid]
            try:
                self.matchers[rid] = self._matcher(seq, future)
                ready.append(seq)
            except GrammarError as exc:
                failed.append((seq, str(exc)))
            except Exception as exc:  # llguidance misuse or a bug: this request only
                log.exception("grammar build failed for %s", rid)
                failed.append((seq, f"grammar build failed: {exc}"))
        return ready, failed

    @staticmethod
    def _matcher(seq: Sequence, future: Future[llguidance.LLMatcher]) -> llguidance.LLMatcher:
        matcher = future.result().deep_copy()
        if seq.output_token_ids and not matcher.consume_tokens(seq.output_token_ids):
            raise GrammarError(
                "the tokens generated before this request was resumed do not match its "
                f"grammar: {first_line(matcher.get_error())}"
            )
        return matcher

    def wait(self, timeout: float) -> None:
        """Block until a pending matcher is built or ``timeout`` seconds pass."""
        wait([f for _, f in self.pending.values()], timeout, FIRST_COMPLETED)

    # ---- one step ------------------------------------------------------------------------
    def mask(self, seqs: list[Sequence]) -> TokenMask | None:
        """The allowed tokens of the constrained rows among ``seqs`` (one row per sequence, in
        order); None when none is constrained."""
        rows: list[int] = []
        matchers: list[llguidance.LLMatcher] = []
        for i, seq in enumerate(seqs):
            m = self.matchers.get(seq.request_id)
            if m is not None:
                rows.append(i)
                matchers.append(m)
        if not rows:
            return None
        n = len(rows)
        if n > self._bitmask.shape[0]:
            self._bitmask = np.full((n, self._bitmask.shape[1]), -1, dtype=np.int32)
        bitmask = self._bitmask[:n]
        if n >= PARALLEL_FILL_ROWS:
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            self._executor.unsafe_compute_mask_ptr(
                [(m, k) for k, m in enumerate(matchers)],
                bitmask.ctypes.data,
                bitmask.shape[1] * 4,
                n,
            )
        else:
            row_bytes = bitmask.shape[1] * 4
            for k, m in enumerate(matchers):
                m.unsafe_compute_mask_ptr(bitmask[k].ctypes.data, row_bytes)
        return TokenMask(rows, bitmask)

    def advance(self, seqs: list[Sequence], tokens: list[int], rows: list[int]) -> StepConstraints:
        """Feed each constrained row (``rows``, indices into ``seqs``) its sampled token."""
        result = StepConstraints()
        for i in rows:
            seq = seqs[i]
            m = self.matchers[seq.request_id]
            # An errored matcher allows and accepts the end of sequence: check its state too.
            if not m.consume_token(tokens[i]) or m.is_error():
                result.failed[seq] = f"grammar error: {first_line(m.get_error())}"
            elif m.is_stopped():
                result.complete.add(seq)
        return result
