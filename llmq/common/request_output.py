"""One request's output messages, in order and each token once: repeats dropped, gaps filled
from the request's record in Redis, errors raised, and the deadline and inactivity enforced."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from llmq.common.engine_status import EngineStatus
from llmq.common.errors import (
    DeadlineExceeded,
    EngineFailure,
    InvalidRequest,
    LLMQError,
    Unavailable,
)
from llmq.common.protocol import PRIORITY_INTERACTIVE, EngineError, EngineRequest, OutputMessage
from llmq.common.transport import AsyncTransport

log = logging.getLogger(__name__)

_POLL = 1.0  # seconds between checks of a silent request's state
_UNAVAILABLE = "unavailable"  # recover() could not read Redis


class OutputReader:
    def __init__(
        self,
        transport: AsyncTransport,
        engines: Callable[[], Awaitable[list[EngineStatus]]],
        inactivity_timeout: float,
    ):
        self.transport = transport
        self.engines = engines
        self.inactivity_timeout = inactivity_timeout

    async def messages(
        self, request: EngineRequest, queue: asyncio.Queue
    ) -> AsyncIterator[OutputMessage]:
        """Output messages in order, each token exactly once; raises on errors and deadlines."""
        expected = 0
        last_activity = time.monotonic()
        while True:
            remaining = request.deadline - time.time()
            if remaining <= 0:
                raise _deadline(request)
            msg = await _next(queue, min(_POLL, remaining))
            if msg is None:
                msg, state = await self.recover(request, expected)
                if msg is None:
                    if await self._still_waiting(request, state, last_activity):
                        last_activity = time.monotonic()
                    continue
            if isinstance(msg, LLMQError):  # put there by RequestStream.fail
                raise msg
            if msg.error is not None:
                raise _engine_error(msg)
            batch = [msg]
            if msg.index > expected:  # a gap: the missing tokens are in the request's record
                batch = [await self._fill_gap(request, expected, msg.index), msg]
            for m in batch:
                if m.error is not None:
                    raise _engine_error(m)
                skip = expected - m.index
                if skip > 0:
                    m.tokens = m.tokens[skip:]
                    m.logprobs = m.logprobs[skip:] if m.logprobs else m.logprobs
                    m.index = expected
                if not m.tokens and not m.done:
                    continue
                expected = m.index + len(m.tokens)
                last_activity = time.monotonic()
                yield m
                if m.done:
                    return

    async def _still_waiting(
        self, request: EngineRequest, state: str | None, last_activity: float
    ) -> bool:
        """After a silent poll: True when the request waits its turn in the queue (which is
        not inactivity); raises once it has been inactive for too long."""
        served = await self._served(request, state)
        if state == "queued" and served:
            return True
        if time.monotonic() - last_activity > self.inactivity_timeout:
            if not served:
                raise Unavailable(
                    f"no worker has served {request.model!r} for "
                    f"{_seconds(self.inactivity_timeout)}s; the request was cancelled, "
                    "retry shortly"
                )
            raise DeadlineExceeded(
                f"no output for {_seconds(self.inactivity_timeout)}s; the request was cancelled",
                code="inactivity_timeout",
            )
        return False

    async def _served(self, request: EngineRequest, state: str | None) -> bool:
        """Whether a live worker serves the request's model. An interactive request queued
        with none ends after inactivity_timeout with the 503 a new request gets, not at its
        deadline (a worker that restarts within it takes the request over). A batch line
        waits for a worker however long it takes."""
        if request.priority != PRIORITY_INTERACTIVE or state in (_UNAVAILABLE, "finished"):
            return True
        return any(e.model == request.model for e in await self.engines())

    async def _fill_gap(self, request: EngineRequest, expected: int, upto: int) -> OutputMessage:
        """Tokens [expected, upto) from the request's record. Retried while Redis is
        unreachable: a restart drops pub/sub messages and stale pool connections alike."""
        while True:
            filled, state = await self.recover(request, expected)
            if state != _UNAVAILABLE:
                if filled is None or filled.index + len(filled.tokens) < upto:
                    raise EngineFailure("output tokens were lost in transit", code="output_lost")
                return filled
            if time.time() >= request.deadline:
                raise _deadline(request)
            await asyncio.sleep(0.1)

    async def recover(
        self, request: EngineRequest, expected: int
    ) -> tuple[OutputMessage | None, str | None]:
        """Read the request's record: tokens published while this client missed them (Redis
        restarted, a pub/sub gap), or its end. Also returns its state (``_UNAVAILABLE`` when
        Redis could not be read)."""
        try:
            wants_logprobs = request.params.logprobs is not None
            state, tokens, logprobs = await self.transport.request_state(request.id, wants_logprobs)
        except Exception as exc:
            log.debug("request state unavailable: %s", exc)
            return None, _UNAVAILABLE
        status = state.get("state")
        if status == "failed":
            return OutputMessage(index=expected, tokens=[], error=_error_from_state(state)), status
        done = status == "finished"
        if done and request.kind == "embed":
            return None, status  # vectors travel only by pub/sub: wait for the message
        if len(tokens) <= expected and not done:
            return None, status
        return OutputMessage(
            index=expected,
            tokens=tokens[expected:],
            logprobs=logprobs[expected : len(tokens)] if wants_logprobs else None,
            finish_reason=(state.get("finish_reason") or "stop") if done else None,
            usage={"prompt_tokens": len(request.prompt_token_ids), "completion_tokens": len(tokens)}
            if done
            else None,
        ), status


async def _next(queue: asyncio.Queue, timeout: float) -> OutputMessage | LLMQError | None:
    """The queue's next item, or None after ``timeout`` seconds without one."""
    try:
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for drops a cancellation that
        # lands as the queue yields a message, and a client that disconnected mid-stream then
        # left its request running to the end on the engine.
        async with asyncio.timeout(timeout):
            return await queue.get()
    except TimeoutError:
        return None


def _seconds(value: float) -> str:
    """1.5 -> "1.5", 600.0 -> "600": a timeout as its setting says it."""
    return f"{value:.1f}".removesuffix(".0")


def _deadline(request: EngineRequest) -> DeadlineExceeded:
    return DeadlineExceeded(
        f"the request did not finish within {_seconds(request.deadline - request.created)}s"
    )


def _engine_error(msg: OutputMessage) -> LLMQError:
    err = msg.error
    if err.type == "invalid_request_error":
        return InvalidRequest(err.message, code=err.code)
    if err.code == "deadline_exceeded":
        return DeadlineExceeded(err.message)
    return EngineFailure(err.message, code=err.code)


def _error_from_state(state: dict) -> EngineError:
    return EngineError(state.get("error") or "the request failed on the worker")
