"""EmbeddingsScheduler: which waiting inputs go into the next encoder batch. Pure.

Inputs are taken oldest first into a window a few batches wide, then the window is sorted by
length so a batch holds inputs of similar length (less padding); a batch stays within
``max_batch_size`` inputs and ``max_batch_tokens`` padded tokens. With ``min_efficiency`` set, a
batch also stops growing before its real tokens fall below that fraction of its padded tokens:
on a CPU an encoder's step costs about its padded tokens, so a few tight batches beat one wide
one (with only a couple of requests in flight, a full batch spans every length there is)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class EmbeddingItem:
    request_id: str
    index: int  # which input of its request
    length: int


class EmbeddingsScheduler:
    def __init__(
        self,
        max_batch_size: int,
        max_batch_tokens: int,
        window_batches: int = 4,
        min_efficiency: float = 0.0,
    ):
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        self.min_efficiency = min_efficiency
        self.window = max_batch_size * window_batches
        self.waiting: deque[EmbeddingItem] = deque()

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def add(self, request_id: str, index: int, length: int) -> None:
        self.waiting.append(EmbeddingItem(request_id, index, length))

    def remove(self, request_id: str) -> None:
        self.waiting = deque(i for i in self.waiting if i.request_id != request_id)

    def schedule(self) -> list[EmbeddingItem]:
        if not self.waiting:
            return []
        # Take the window off the queue; what the batch leaves goes back in front, in order
        # (so a step costs the window's size, not the backlog's).
        window = [self.waiting.popleft() for _ in range(min(self.window, len(self.waiting)))]
        # The oldest input always goes in, so nothing waits forever behind shorter ones.
        oldest = window[0]
        ordered = sorted(window, key=lambda it: it.length)
        start = ordered.index(oldest)
        batch = [oldest]
        longest = total = oldest.length
        lo, hi = start - 1, start + 1
        # Grow around the oldest input through its neighbours in length.
        while len(batch) < self.max_batch_size and (lo >= 0 or hi < len(ordered)):
            take_hi = hi < len(ordered) and (
                lo < 0 or ordered[hi].length - oldest.length <= oldest.length - ordered[lo].length
            )
            cand = ordered[hi] if take_hi else ordered[lo]
            padded = max(longest, cand.length) * (len(batch) + 1)
            if padded > self.max_batch_tokens:
                break
            if total + cand.length < self.min_efficiency * padded:
                break
            batch.append(cand)
            longest = max(longest, cand.length)
            total += cand.length
            if take_hi:
                hi += 1
            else:
                lo -= 1
        chosen = {id(it) for it in batch}
        self.waiting.extendleft(reversed([it for it in window if id(it) not in chosen]))
        return batch
