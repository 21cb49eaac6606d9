"""A request's deadline, fixed when it arrives: ``LLMQ_REQUEST_TIMEOUT`` after it, for all the
request waits for (a worker loading or waking its model, the queue, its generation), and the
one error every wait raises when it passes."""

from __future__ import annotations

import time
from contextvars import ContextVar
from dataclasses import dataclass

from llmq.common.errors import DeadlineExceeded


@dataclass(frozen=True, slots=True)
class Deadline:
    arrived: float  # unix time
    at: float  # unix time

    @property
    def seconds(self) -> float:
        return self.at - self.arrived

    def passed(self) -> bool:
        return time.time() >= self.at

    def exceeded(self, why: str = "") -> DeadlineExceeded:
        """The error of a request past this deadline (what the output reader raises too)."""
        return deadline_exceeded(self.seconds, why)


# Set for each HTTP request by the API (a dependency of its routes); None elsewhere (a batch
# line, a background response: each submit then counts its own LLMQ_REQUEST_TIMEOUT).
request_deadline: ContextVar[Deadline | None] = ContextVar("request_deadline", default=None)


def fix_deadline(timeout: float) -> Deadline:
    """This request's deadline, from now."""
    now = time.time()
    deadline = Deadline(now, now + timeout)
    request_deadline.set(deadline)
    return deadline


def current_deadline(timeout: float) -> Deadline:
    """The request's deadline where one was fixed, else one ``timeout`` from now."""
    found = request_deadline.get()
    if found is not None:
        return found
    now = time.time()
    return Deadline(now, now + timeout)


def deadline_exceeded(seconds: float, why: str = "") -> DeadlineExceeded:
    """1.5 -> "within 1.5s", 600.0 -> "within 600s": the timeout as its setting says it."""
    text = f"the request did not finish within {f'{seconds:.1f}'.removesuffix('.0')}s"
    return DeadlineExceeded(f"{text}: {why}" if why else text)
