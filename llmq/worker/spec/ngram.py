"""Prompt lookup: the tokens that followed the latest earlier occurrence of a sequence's last n
tokens, in its own prompt and output, are proposed as its next ones.

Pure: no torch. Each sequence keeps an index per n-gram size (n-gram -> the position after its
latest occurrence), grown by the tokens appended since the last call: a lookup costs a few dict
probes whatever the context's length (a scan of a 2,000-token context per step and sequence
would cost more than a step of the tiny models).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmq.worker.engine.sequence import Sequence


@dataclass(slots=True)
class _Index:
    """One sequence's n-gram positions: ``by_n[j]`` maps n-grams of size ``min_n + j`` to the
    position after their latest occurrence that has a token after it."""

    by_n: list[dict[tuple[int, ...], int]] = field(default_factory=list)
    indexed: int = 0  # n-grams ending before this position are indexed


class NgramProposer:
    def __init__(self, min_n: int = 1, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError("n-gram sizes need 1 <= min_n <= max_n")
        self.min_n = min_n
        self.max_n = max_n
        self._index: dict[str, tuple[Sequence, _Index]] = {}  # request id -> its index

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        return [self._propose_one(s, k) if k > 0 else [] for s, k in zip(seqs, limits, strict=True)]

    def forget(self, seq: Sequence) -> None:
        self._index.pop(seq.request_id, None)

    def _propose_one(self, seq: Sequence, k: int) -> list[int]:
        tokens = seq.token_ids
        held, index = self._index.get(seq.request_id, (None, None))
        if held is not seq or index.indexed > len(tokens):  # new, or its tokens were replaced
            index = _Index([{} for _ in range(self.max_n - self.min_n + 1)])
            self._index[seq.request_id] = (seq, index)
        self._grow(index, tokens)
        end = len(tokens)
        for n in range(min(self.max_n, end - 1), self.min_n - 1, -1):
            after = index.by_n[n - self.min_n].get(tuple(tokens[end - n :]))
            if after is not None:
                return tokens[after : after + k]
        return []

    def _grow(self, index: _Index, tokens: list[int]) -> None:
        """Index the n-grams that end at positions ``index.indexed .. len - 1`` (each has a
        token after it); later occurrences overwrite earlier ones."""
        last = len(tokens) - 1
        for end in range(max(index.indexed, 1), last + 1):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                index.by_n[n - self.min_n][tuple(tokens[end - n : end])] = end
        index.indexed = max(index.indexed, last + 1)
