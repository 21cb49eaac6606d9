"""The threads that tokenize and render chat templates, with a bound on the bytes in flight.

Two lanes: inputs up to ``small_bytes`` run on threads of their own and never wait behind the bytes
of larger ones; larger inputs share a budget of ``bytes_in_flight`` (tokenizing takes a few hundred
bytes of memory per byte of text: docs/performance.md, "Choices: memory") and wait for room at most
``wait`` seconds before a 429 with Retry-After. An input larger than the whole budget runs when it
is alone. The tokenizers release the GIL, so neither lane holds up the event loop."""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TypeVar

from llmq.common.errors import QueueFull
from llmq.common.settings import get_settings

T = TypeVar("T")


class TokenizerBusy(QueueFull):
    code = "tokenizer_busy"
    retry_after = 1


@dataclass(eq=False, slots=True)
class _Waiter:
    size: int
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future = field(repr=False)
    granted: bool = False


def utf8_size(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


class TokenizePool:
    def __init__(self, small_bytes: int, bytes_in_flight: int, wait: float, threads: int = 2):
        self.small_bytes = small_bytes
        self.budget = bytes_in_flight
        self.wait = wait
        self._small = ThreadPoolExecutor(threads, thread_name_prefix="llmq-tokenize")
        self._large = ThreadPoolExecutor(threads, thread_name_prefix="llmq-tokenize-large")
        self._lock = threading.Lock()
        self._in_flight = 0
        self._waiters: deque[_Waiter] = deque()

    @property
    def in_flight(self) -> int:
        """Bytes of large inputs being worked on now."""
        return self._in_flight

    async def run(self, size: int, work: Callable[[], T]) -> T:
        """``work()`` on a thread of the lane for ``size`` bytes of input."""
        loop = asyncio.get_running_loop()
        if size <= self.small_bytes:
            return await loop.run_in_executor(self._small, work)
        await self._acquire(size, loop)

        def job() -> T:
            try:
                return work()
            finally:  # given back when the work ends, even if its caller went away
                self._release(size)

        try:
            future = loop.run_in_executor(self._large, job)
        except BaseException:
            self._release(size)
            raise
        return await future

    def _fits(self, size: int) -> bool:
        return self._in_flight == 0 or self._in_flight + size <= self.budget

    async def _acquire(self, size: int, loop: asyncio.AbstractEventLoop) -> None:
        with self._lock:
            if not self._waiters and self._fits(size):
                self._in_flight += size
                return
            waiter = _Waiter(size, loop, loop.create_future())
            self._waiters.append(waiter)
        try:
            await asyncio.wait_for(waiter.future, self.wait)
        except (TimeoutError, asyncio.CancelledError) as exc:
            with self._lock:
                if not waiter.granted:
                    self._waiters.remove(waiter)
            if waiter.granted:  # room came as the wait ended: keep it, or give it back
                if isinstance(exc, TimeoutError):
                    return
                self._release(size)
                raise
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise TokenizerBusy(
                "the server is tokenizing other large inputs; retry shortly"
            ) from None

    def _release(self, size: int) -> None:
        woken: list[_Waiter] = []
        with self._lock:
            self._in_flight -= size
            while self._waiters and self._fits(self._waiters[0].size):
                waiter = self._waiters.popleft()
                waiter.granted = True
                self._in_flight += waiter.size
                woken.append(waiter)
        for waiter in woken:
            waiter.loop.call_soon_threadsafe(_wake, waiter.future)


def _wake(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


@lru_cache(maxsize=1)
def shared_pool() -> TokenizePool:
    """The process's pool (every model's tokenizer shares its budget)."""
    s = get_settings()
    return TokenizePool(s.tokenize_small_bytes, s.tokenize_bytes_in_flight, s.tokenize_wait)
