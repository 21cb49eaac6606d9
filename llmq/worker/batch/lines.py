"""Running one line of a batch: its request answered as the API would answer it, run again
after a temporary error while the batch's window lasts, and its result checkpointed in Redis
(a record that fails is written again: a line never leaves its run without a row, unless the
run itself is stopped)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Protocol

import redis

from llmq.common.errors import InvalidRequest, LLMQError
from llmq.common.storage.jsonl_lines import InputLine
from llmq.worker.batch.executor import LineExecutor
from llmq.worker.batch.input_lines import LineRefused, LineRequest, parse_line
from llmq.worker.batch.results import LineResponse, ResultRow, RowError
from llmq.worker.batch.retry import Backoff, is_temporary

log = logging.getLogger("llmq.batch")

RECORD_BACKOFF = Backoff(0.05, 2.0)


class Checkpoint(Protocol):
    async def record(self, line: int, row: dict, ok: bool) -> bool: ...

    async def set_attempt(self, line: int, attempt: int) -> None: ...


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    backoff: Backoff
    deadline: float  # the batch's expires_at (epoch seconds): no retry starts after it


class LineRunner:
    """Runs lines of one batch; every line it runs ends in the output file or the error file.
    ``attempts``: lines retried by an earlier run, with their attempt (fresh request ids)."""

    def __init__(
        self,
        checkpoint: Checkpoint,
        batch_id: str,
        endpoint: str,
        executor: LineExecutor,
        retry: RetryPolicy,
        attempts: dict[int, int] | None = None,
        rerun: bool = False,
    ):
        self.checkpoint = checkpoint
        self.batch_id = batch_id
        self.endpoint = endpoint
        self.executor = executor
        self.retry = retry
        self.attempts = attempts or {}
        self.rerun = rerun  # a run after another: its lines' requests may exist already

    def request_id(self, n: int, attempt: int = 0) -> str:
        """Line n's id: a re-run attaches to the requests its first run started; each retry
        after a temporary error gets ids of its own (its first try's may hold tokens)."""
        return f"{self.batch_id}-{n}" if attempt == 0 else f"{self.batch_id}-{n}.{attempt}"

    async def run(self, line: InputLine) -> None:
        try:
            request = parse_line(line, self.endpoint)
        except LineRefused as refused:
            await self._record(
                line.number,
                refused.custom_id,
                refused.error.status,
                refused.error.to_dict(),
                self.request_id(line.number),
            )
            return
        n = line.number
        attempt = await self._first_attempt(n, request.body.get("model"))
        while True:
            rid = self.request_id(n, attempt)
            status, body = await self._answer(n, request, rid)
            if not is_temporary(status):
                await self._record(n, request.custom_id, status, body, rid)
                return
            delay = self.retry.backoff.delay(attempt)
            if time.time() + delay >= self.retry.deadline:
                await self._record_expired(n, request.custom_id, status, body)
                return
            code = body.get("error", {}).get("code") if isinstance(body, dict) else None
            log.info(
                "batch %s: line %d answered %d %s; retrying in %.1fs",
                self.batch_id,
                n,
                status,
                code,
                delay,
            )
            await asyncio.sleep(delay)
            attempt += 1
            await self._with_retries(lambda a=attempt: self.checkpoint.set_attempt(n, a), n)

    async def _first_attempt(self, n: int, model: str | None) -> int:
        """The attempt to run (or attach to): an earlier run's, unless its request was
        cancelled or failed (a run that lost its lease cancels its lines), which gets the
        next attempt and fresh ids."""
        attempt = self.attempts.get(n, 0)
        rid = self.request_id(n, attempt)
        if self.rerun and not await self.executor.attachable(rid, model):
            attempt += 1
            await self._with_retries(lambda: self.checkpoint.set_attempt(n, attempt), n)
        return attempt

    async def _answer(self, n: int, request: LineRequest, rid: str) -> tuple[int, dict]:
        try:
            return await self.executor.answer(self.endpoint, request.body, rid)
        except Exception as exc:  # every line ends in one file or the other
            if isinstance(exc, UnicodeEncodeError):
                error = InvalidRequest(
                    f"line {n}: the body is not valid Unicode text", code="invalid_line"
                )
            else:
                log.exception("batch %s: line %d failed", self.batch_id, n)
                error = LLMQError(f"line {n}: internal error: {exc}")
            return error.status, error.to_dict()

    async def _record_expired(self, n: int, custom_id: object, status: int, body: dict) -> None:
        """The window ends before the next retry: the line's row says so, as OpenAI's rows of
        lines that never ran, with the last temporary error."""
        last = (body.get("error") or {}).get("message", "") if isinstance(body, dict) else ""
        message = (
            "the batch's completion window ended while this request kept meeting temporary "
            f"errors (last: {status} {last})"
        )
        row = ResultRow(custom_id, None, RowError("batch_expired", message))
        await self._with_retries(lambda: self.checkpoint.record(n, row.to_dict(), False), n)

    async def _record(
        self, n: int, custom_id: object, status: int, body: dict, request_id: str
    ) -> None:
        row = ResultRow(custom_id, LineResponse(status, request_id, body)).to_dict()
        await self._with_retries(lambda: self.checkpoint.record(n, row, status == 200), n)

    async def _with_retries(self, write, n: int):
        """A checkpoint write, again until it is done (Redis away, out of memory, the key of
        the wrong type for a while); the run's stop cancels it. Writes are idempotent."""
        retry = 0
        while True:
            try:
                return await write()
            except (redis.RedisError, OSError) as exc:
                delay = RECORD_BACKOFF.delay(retry)
                log.warning(
                    "batch %s: recording line %d failed (%s); again in %.2fs",
                    self.batch_id,
                    n,
                    exc,
                    delay,
                )
                await asyncio.sleep(delay)
                retry += 1
