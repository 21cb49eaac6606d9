"""One request's output messages, in order and each token once: repeats dropped, gaps filled
from the request's record in Redis, errors raised, and the deadline and inactivity enforced; a
request whose model no live worker serves any more fails fast with the 503 a new one gets."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from llmq.common.engine_client.deadline import deadline_exceeded
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
# How old the live engines a silent poll reads may be: one read per API process shared by every
# silent request, fresh enough that a dead model is seen within a poll of its last heartbeat.
_LIVENESS_AGE = 0.25
_UNAVAILABLE = "unavailable"  # recover() could not read Redis
# A request Redis lost before any output (a failover to a replica that had not received its
# enqueue, a restart without persistence) is sent again by the process that holds it, this
# many times at most.
_MAX_RESENDS = 3


@dataclass(slots=True)
class _Watch:
    """What a request's silent polls saw: when it last made progress, and since when no live
    worker has served its model (None: one does)."""

    last_activity: float
    unserved_since: float | None = None
    resent: int = 0  # times the request was sent again after Redis lost it
    owner_steps: int | None = None  # the steps its worker had taken at the last silent poll


class OutputReader:
    def __init__(
        self,
        transport: AsyncTransport,
        engines: Callable[[float], Awaitable[list[EngineStatus]]],
        inactivity_timeout: float,
        no_worker_grace: float = 1.0,
        record_ttl: int = 3600,
    ):
        self.transport = transport
        self.engines = engines  # live engines, read at most the given seconds ago
        self.inactivity_timeout = inactivity_timeout
        self.no_worker_grace = no_worker_grace
        self.record_ttl = record_ttl

    async def messages(
        self, request: EngineRequest, queue: asyncio.Queue
    ) -> AsyncIterator[OutputMessage]:
        """Output messages in order, each token exactly once; raises on errors and deadlines."""
        expected = 0
        watch = _Watch(time.monotonic())
        while True:
            remaining = request.deadline - time.time()
            if remaining <= 0:
                raise _deadline(request)
            msg = await _next(queue, min(self._poll_in(watch), remaining))
            if msg is None:
                msg, state, owner = await self.recover(request, expected)
                if msg is None:
                    if state is None and expected == 0 and watch.resent < _MAX_RESENDS:
                        await self._resend(request, watch)
                        continue
                    await self._still_waiting(request, state, owner, watch)
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
                watch.last_activity, watch.unserved_since = time.monotonic(), None
                yield m
                if m.done:
                    return

    def _poll_in(self, watch: _Watch) -> float:
        """Seconds until the next check of a silent request: at the latest when the grace a
        model without live workers gets runs out."""
        if watch.unserved_since is None:
            return _POLL
        left = watch.unserved_since + self.no_worker_grace - time.monotonic()
        return max(0.05, min(_POLL, left))

    async def _still_waiting(
        self, request: EngineRequest, state: str | None, owner: str, watch: _Watch
    ) -> None:
        """After a silent poll: raises when Redis lost the request, once no live worker has
        served its model for no_worker_grace (it is then cancelled: a worker that comes back
        later drops it), or once it has been inactive for too long. Waiting its turn in the
        queue of a served model is not inactivity, nor is running on a worker whose engine
        keeps stepping (a long prompt's prefill, or others' before its first token, which on a
        slow CPU can take minutes);
        a worker whose loop stops is the stall timeout's, which withholds its heartbeat."""
        if state is None:  # its record lives until past its deadline unless Redis lost it
            raise Unavailable(
                "Redis lost this request (it restarted without persistence, was flushed or "
                "evicted keys); retry",
                code="request_lost",
            )
        now = time.monotonic()
        served = await self._served(request, state, _LIVENESS_AGE)
        since = watch.unserved_since
        if not served and since is not None and now - since >= self.no_worker_grace:
            served = await self._served(request, state, 0.0)  # none came back just now?
            if not served:
                raise Unavailable(
                    f"no live worker serves {request.model!r} (no heartbeat: its workers "
                    "stopped or cannot write to Redis); the request was cancelled, retry shortly"
                )
        if served:
            watch.unserved_since = None
            if state == "queued" or (state == "running" and await self._stepping(owner, watch)):
                watch.last_activity = now
        elif since is None:
            watch.unserved_since = now
        if now - watch.last_activity > self.inactivity_timeout:
            if watch.unserved_since is not None:
                raise Unavailable(
                    f"no worker has served {request.model!r} for "
                    f"{_seconds(self.inactivity_timeout)}s; the request was cancelled, "
                    "retry shortly"
                )
            raise DeadlineExceeded(
                f"no output for {_seconds(self.inactivity_timeout)}s; the request was cancelled",
                code="inactivity_timeout",
            )

    async def _resend(self, request: EngineRequest, watch: _Watch) -> None:
        """Enqueue again a request Redis lost before any output (attached to, should another
        process have sent it again first)."""
        watch.resent += 1
        ttl = int(max(1.0, request.deadline - time.time())) + self.record_ttl
        try:
            await self.transport.enqueue(request, 0, ttl, attach=True)
        except Exception as exc:  # Redis still away: the next poll tries again
            log.debug("request %s: sending it again failed: %s", request.id, exc)
            return
        watch.last_activity = time.monotonic()
        log.warning(
            "request %s: Redis lost it before any output (a failover or a restart without "
            "persistence); sent again",
            request.id,
        )

    async def _stepping(self, owner: str, watch: _Watch) -> bool:
        """Whether the request's worker has taken steps since the last silent poll."""
        try:
            engines = await self.engines(_LIVENESS_AGE)
        except Exception as exc:
            log.debug("live engines unavailable: %s", exc)
            return False
        steps = next((e.steps_total for e in engines if owner and e.worker == owner), None)
        stepped = steps is not None and steps != watch.owner_steps
        watch.owner_steps = steps
        return stepped

    async def _served(self, request: EngineRequest, state: str | None, max_age: float) -> bool:
        """Whether a live worker serves the request's model (engines read at most ``max_age``
        seconds ago). A batch line waits for a worker however long it takes; so does a
        request while Redis cannot say (unreachable: its restart is no worker's death)."""
        if request.priority != PRIORITY_INTERACTIVE or state in (_UNAVAILABLE, "finished"):
            return True
        try:
            engines = await self.engines(max_age)
        except Exception as exc:
            log.debug("live engines unavailable: %s", exc)
            return True
        return any(e.model == request.model for e in engines)

    async def _fill_gap(self, request: EngineRequest, expected: int, upto: int) -> OutputMessage:
        """Tokens [expected, upto) from the request's record. Retried while Redis is
        unreachable: a restart drops pub/sub messages and stale pool connections alike."""
        while True:
            filled, state, _ = await self.recover(request, expected)
            if state != _UNAVAILABLE:
                if filled is None or filled.index + len(filled.tokens) < upto:
                    raise EngineFailure("output tokens were lost in transit", code="output_lost")
                return filled
            if time.time() >= request.deadline:
                raise _deadline(request)
            await asyncio.sleep(0.1)

    async def recover(
        self, request: EngineRequest, expected: int
    ) -> tuple[OutputMessage | None, str | None, str]:
        """Read the request's record: tokens published while this client missed them (Redis
        restarted, a pub/sub gap), or its end. Also returns its state (``_UNAVAILABLE`` when
        Redis could not be read) and the worker that owns it ("": none)."""
        try:
            wants_logprobs = request.params.logprobs is not None
            state, tokens, logprobs = await self.transport.request_state(
                request.id, request.model, wants_logprobs
            )
        except Exception as exc:
            log.debug("request state unavailable: %s", exc)
            return None, _UNAVAILABLE, ""
        status, owner = state.get("state"), state.get("worker", "")
        if status == "failed":
            failed = OutputMessage(index=expected, tokens=[], error=_error_from_state(state))
            return failed, status, owner
        done = status == "finished"
        if done and request.kind != "generate":
            return None, status, owner  # vectors travel only by pub/sub: wait for the message
        if len(tokens) <= expected and not done:
            return None, status, owner
        prompt_logprobs = None
        if expected == 0 and state.get("prompt_logprobs"):  # the first message was missed
            prompt_logprobs = json.loads(state["prompt_logprobs"])
        return (
            OutputMessage(
                index=expected,
                tokens=tokens[expected:],
                logprobs=logprobs[expected : len(tokens)] if wants_logprobs else None,
                finish_reason=(state.get("finish_reason") or "stop") if done else None,
                usage={
                    "prompt_tokens": len(request.prompt_token_ids),
                    "completion_tokens": len(tokens),
                }
                if done
                else None,
                prompt_logprobs=prompt_logprobs,
            ),
            status,
            owner,
        )


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
    return deadline_exceeded(request.deadline - request.created)


def _engine_error(msg: OutputMessage) -> LLMQError:
    err = msg.error
    if err.type == "invalid_request_error":
        return InvalidRequest(err.message, code=err.code)
    if err.code == "deadline_exceeded":
        return DeadlineExceeded(err.message)
    return EngineFailure(err.message, code=err.code)


def _error_from_state(state: dict) -> EngineError:
    return EngineError(state.get("error") or "the request failed on the worker")
