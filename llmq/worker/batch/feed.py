"""Feeding a batch's lines to a fixed number of runners through a bounded queue: the lines are
read from the input file as the runners take them, so a batch of any size holds about
2 x concurrency lines in memory, never one task per line."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Container

from llmq.common.storage.jsonl_lines import InputLine


async def run_lines(
    lines: AsyncIterator[InputLine],
    skip: Container[int],
    run_line: Callable[[InputLine], Awaitable[None]],
    concurrency: int,
    stop: asyncio.Event,
) -> int:
    """Run every line whose number is not in ``skip``, at most ``concurrency`` at once, until
    all have run or ``stop`` is set (the lines in flight are then cancelled, those not taken
    stay unrun). Returns the number of lines taken. An error reading ``lines`` is raised once
    the lines in flight are over."""
    queue: asyncio.Queue[InputLine | None] = asyncio.Queue(maxsize=concurrency)
    taken = 0

    async def produce() -> None:
        failure: Exception | None = None
        try:
            async for line in lines:
                if line.number not in skip:
                    await queue.put(line)
        except Exception as exc:  # the lines taken still run; raised after them
            failure = exc
        for _ in range(concurrency):  # one end marker per runner (not when cancelled)
            await queue.put(None)
        if failure is not None:
            raise failure

    async def consume() -> None:
        nonlocal taken
        while (line := await queue.get()) is not None:
            taken += 1
            await run_line(line)

    producer = asyncio.ensure_future(produce())
    runners = asyncio.ensure_future(asyncio.gather(*(consume() for _ in range(concurrency))))
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait([runners, stopped], return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (producer, runners, stopped):
            task.cancel()
        results = await asyncio.gather(producer, runners, stopped, return_exceptions=True)
    if not stop.is_set():
        for result in results[:2]:
            if isinstance(result, BaseException) and not isinstance(result, asyncio.CancelledError):
                raise result
    with contextlib.suppress(Exception):
        await lines.aclose()  # type: ignore[attr-defined]
    return taken
