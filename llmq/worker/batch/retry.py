"""Which answers of a batch line are final, and how long a line waits before it runs again.

A client error (4xx) is the line's answer: the same request would get it again. A server error
(5xx: no worker serves the model while workers restart, Redis away, a deadline passed while the
line waited at batch priority, an engine failure) and a 429 say nothing about the request: the
line runs again after an exponential backoff, while the batch's completion window lasts."""

from __future__ import annotations

import random
from dataclasses import dataclass


def is_temporary(status: int) -> bool:
    """Whether an answer with this status is worth running the line again for."""
    return status >= 500 or status == 429


@dataclass(frozen=True, slots=True)
class Backoff:
    initial: float
    cap: float

    def delay(self, retry: int, rand: random.Random | None = None) -> float:
        """Seconds before retry number ``retry`` (0-based): doubling from ``initial`` up to
        ``cap``, with a random part so that lines that failed together do not all come back
        in the same instant (between half and all of the step)."""
        step = min(self.cap, self.initial * 2 ** min(retry, 62))
        return step * (0.5 + 0.5 * (rand or random).random())
