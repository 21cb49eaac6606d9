"""Batch lines without processes: which answers are retried, the backoff, a line retried until
it is answered or the window ends, and the bounded feed of lines to the runners."""

from __future__ import annotations

import asyncio
import json
import random
import time

import pytest

from llmq.common.storage.jsonl_lines import InputLine
from llmq.worker.batch.feed import run_lines
from llmq.worker.batch.lines import LineRunner, RetryPolicy
from llmq.worker.batch.retry import Backoff, is_temporary

pytestmark = pytest.mark.unit

CHAT = "/v1/chat/completions"


def test_only_server_errors_and_429_are_retried():
    for status in (500, 502, 503, 504, 599, 429):
        assert is_temporary(status), status
    for status in (200, 400, 401, 404, 413, 422):
        assert not is_temporary(status), status


def test_backoff_doubles_up_to_its_cap_with_jitter():
    backoff = Backoff(1.0, 60.0)
    rng = random.Random(1)
    for retry, step in enumerate([1, 2, 4, 8, 16, 32, 60, 60, 60]):
        delay = backoff.delay(retry, rng)
        assert step / 2 <= delay <= step, (retry, delay)
    assert backoff.delay(10_000, rng) <= 60.0  # no overflow however long a line fails


class Answers:
    """An executor whose answers are given in advance (then 200), recording the ids asked."""

    def __init__(self, *statuses: int) -> None:
        self.statuses = list(statuses)
        self.ids: list[str] = []

    async def answer(self, endpoint: str, body: dict, request_id_prefix: str):
        self.ids.append(request_id_prefix)
        status = self.statuses.pop(0) if self.statuses else 200
        code = {503: "no_worker", 504: "deadline_exceeded"}.get(status, "x")
        return status, (
            {"ok": True} if status == 200 else {"error": {"code": code, "message": code}}
        )

    async def attachable(self, request_id_prefix: str, model: str | None) -> bool:
        return not request_id_prefix.endswith("-2")  # line 2's first request was cancelled


class Checkpoint:
    def __init__(self) -> None:
        self.rows: dict[int, tuple[dict, bool]] = {}
        self.attempts: dict[int, int] = {}

    async def record(self, line: int, row: dict, ok: bool) -> bool:
        self.rows[line] = (row, ok)
        return True

    async def set_attempt(self, line: int, attempt: int) -> None:
        self.attempts[line] = attempt


def line(n: int) -> InputLine:
    return InputLine(n, json.dumps({"custom_id": f"c{n}", "url": CHAT, "body": {"model": "m"}}))


def test_a_line_is_retried_with_fresh_ids_until_it_is_answered():
    answers, checkpoint = Answers(503, 504, 500), Checkpoint()
    retry = RetryPolicy(Backoff(0.001, 0.002), deadline=time.time() + 60)
    runner = LineRunner(checkpoint, "batch_x", CHAT, answers, retry)
    asyncio.run(runner.run(line(1)))
    assert answers.ids == ["batch_x-1", "batch_x-1.1", "batch_x-1.2", "batch_x-1.3"]
    row, ok = checkpoint.rows[1]
    assert ok and row["response"]["status_code"] == 200 and row["custom_id"] == "c1"
    assert row["response"]["request_id"] == "batch_x-1.3"
    assert checkpoint.attempts == {1: 3}  # a re-run goes on from there

    # A client error is final at once.
    answers, checkpoint = Answers(400), Checkpoint()
    asyncio.run(LineRunner(checkpoint, "batch_x", CHAT, answers, retry).run(line(1)))
    assert answers.ids == ["batch_x-1"] and checkpoint.rows[1][0]["response"]["status_code"] == 400


def test_a_line_failing_temporarily_past_the_window_gets_an_expired_row():
    answers, checkpoint = Answers(*[503] * 100), Checkpoint()
    retry = RetryPolicy(Backoff(0.05, 0.05), deadline=time.time() + 0.3)
    asyncio.run(LineRunner(checkpoint, "batch_x", CHAT, answers, retry).run(line(7)))
    row, ok = checkpoint.rows[7]
    assert not ok and row["response"] is None and row["custom_id"] == "c7"
    assert row["error"]["code"] == "batch_expired"
    assert "503 no_worker" in row["error"]["message"]
    assert 2 <= len(answers.ids) < 100


def test_a_rerun_attaches_unless_the_earlier_request_was_cancelled():
    answers, checkpoint = Answers(), Checkpoint()
    retry = RetryPolicy(Backoff(0.001, 0.001), deadline=time.time() + 60)
    runner = LineRunner(checkpoint, "b", CHAT, answers, retry, attempts={3: 2}, rerun=True)

    async def run() -> None:
        for n in (1, 2, 3):
            await runner.run(line(n))

    asyncio.run(run())
    assert answers.ids == ["b-1", "b-2.1", "b-3.2"]
    assert checkpoint.attempts == {2: 1}


def test_lines_are_fed_to_a_bounded_number_of_runners():
    """At most ``concurrency`` lines in flight and only a few read ahead of them (the rest
    stay in the file); recorded lines are skipped; a stop cancels those in flight."""
    read = 0
    in_flight = 0
    peak = 0
    ran: list[int] = []

    async def lines():
        nonlocal read
        for n in range(1, 1001):
            read += 1
            yield line(n)

    async def run_line(item: InputLine) -> None:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        assert read - len(ran) <= 4 + 4 + 1 + len(skip), "lines read far ahead of the runners"
        await asyncio.sleep(0)
        ran.append(item.number)
        in_flight -= 1

    skip = {2, 500}
    taken = asyncio.run(run_lines(lines(), skip, run_line, 4, asyncio.Event()))
    assert sorted(ran) == [n for n in range(1, 1001) if n not in skip] and taken == 998
    assert peak == 4

    async def stopped() -> tuple[int, list[int]]:
        stop = asyncio.Event()
        started: list[int] = []

        async def forever(item: InputLine) -> None:
            started.append(item.number)
            if len(started) == 3:
                stop.set()
            await asyncio.sleep(3600)

        await asyncio.wait_for(run_lines(lines(), set(), forever, 3, stop), 10)
        return len(started), started

    count, started = asyncio.run(stopped())
    assert count == 3 and started == [1, 2, 3]
