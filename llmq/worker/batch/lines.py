"""Running the lines of a batch: each line's request answered as the API would answer it, its
result checkpointed in Redis as soon as it is known."""

from __future__ import annotations

import asyncio
import logging

from llmq.common.errors import InvalidRequest, LLMQError
from llmq.common.store import Store
from llmq.worker.batch.executor import LineExecutor
from llmq.worker.batch.input_lines import InputLine, LineRefused, LineRequest, parse_line
from llmq.worker.batch.results import LineResponse, ResultRow

log = logging.getLogger("llmq.batch")


class LineRunner:
    """Runs lines of one batch, at most ``concurrency`` at a time; every line that starts ends
    in the output file or the error file."""

    def __init__(
        self, store: Store, batch_id: str, endpoint: str, executor: LineExecutor, concurrency: int
    ):
        self.store = store
        self.batch_id = batch_id
        self.endpoint = endpoint
        self.executor = executor
        self.limit = asyncio.Semaphore(concurrency)

    def request_id(self, n: int) -> str:
        """Line n's id: a re-run attaches to the requests its first run started."""
        return f"{self.batch_id}-{n}"

    async def run(self, line: InputLine, cancelled: asyncio.Event) -> None:
        async with self.limit:
            if cancelled.is_set():
                return
            try:
                request = parse_line(line, self.endpoint)
            except LineRefused as refused:
                await self._record_error(line.number, refused.custom_id, refused.error)
                return
            status, body = await self._answer(line.number, request)
            await self._record(line.number, request.custom_id, status, body)

    async def _answer(self, n: int, request: LineRequest) -> tuple[int, dict]:
        try:
            return await self.executor.answer(self.endpoint, request.body, self.request_id(n))
        except Exception as exc:  # every line ends in one file or the other
            if isinstance(exc, UnicodeEncodeError):
                error = InvalidRequest(
                    f"line {n}: the body is not valid Unicode text", code="invalid_line"
                )
            else:
                log.exception("batch %s: line %d failed", self.batch_id, n)
                error = LLMQError(f"line {n}: internal error: {exc}")
            return error.status, error.to_dict()

    async def _record_error(self, n: int, custom_id: object, error: LLMQError) -> None:
        await self._record(n, custom_id, error.status, error.to_dict())

    async def _record(self, n: int, custom_id: object, status: int, body: dict) -> None:
        row = ResultRow(custom_id, LineResponse(status, self.request_id(n), body))
        await self.store.record_line(self.batch_id, n, row.to_dict(), ok=status == 200)
