"""TokenGeneratorPipeline: the async client of the engines, used by the API and batch tasks.

It tokenizes (chat template included) in a thread pool, subscribes to the request's output
channel before enqueueing it, yields outputs as they come (dropping repeats, filling gaps from
the request's recorded tokens), detokenizes incrementally, trims at stop strings and cancels
the request on the engine, and fails with a clear error when the deadline passes or nothing
arrives for too long.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from llmq.common.engine_status import EngineStatus
from llmq.common.errors import (
    DeadlineExceeded,
    EngineFailure,
    InvalidRequest,
    LLMQError,
    QueueFull,
    Unavailable,
)
from llmq.common.protocol import PRIORITY_INTERACTIVE, EngineError, EngineRequest, OutputMessage
from llmq.common.sampling_params import SamplingParams
from llmq.common.tokenizer import IncrementalDetokenizer, StopStringMatcher
from llmq.common.transport import AsyncTransport

log = logging.getLogger(__name__)

_POLL = 1.0  # seconds between checks of a silent request's state
_UNAVAILABLE = "unavailable"  # _recover could not read Redis


@dataclass(slots=True)
class SubmitContext:
    """Set by a batch task around one line: its requests run at batch priority, outside the
    interactive queue limit, with ids derived from the line, so that a re-run of the task
    attaches to what its first run started instead of generating it again."""

    priority: int
    id_prefix: str
    counter: itertools.count = field(default_factory=itertools.count)

    def next_id(self) -> str:
        return f"{self.id_prefix}-{next(self.counter)}"


submit_context: contextvars.ContextVar[SubmitContext | None] = contextvars.ContextVar(
    "llmq_submit_context", default=None
)


@dataclass(slots=True)
class GenerationChunk:
    """New output of one request: text delta, the tokens behind it, and on the last chunk the
    finish reason and usage."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[dict] | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    queue_time: float | None = None  # seconds before a worker took it (on the last chunk)


@dataclass(slots=True)
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[dict] = field(default_factory=list)
    cached_tokens: int = 0


@dataclass(slots=True)
class EmbeddingResult:
    vectors: list[str]  # base64 of little-endian float32, one per input
    prompt_tokens: int


def check_text(value, param: str) -> None:
    """A 400 for text that is not valid Unicode (JSON allows lone surrogates such as "\\ud800";
    tokenizers reject them with an internal error)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidRequest(
                f"{param} is not valid Unicode text: a lone surrogate at character {exc.start}",
                param,
            ) from None
    elif isinstance(value, dict):
        for v in value.values():
            check_text(v, param)
    elif isinstance(value, list):
        for v in value:
            check_text(v, param)


class TokenGeneratorPipeline:
    def __init__(
        self,
        transport: AsyncTransport,
        tokenizer,
        model: str,
        *,
        max_queue: int = 1024,
        request_timeout: float = 600.0,
        inactivity_timeout: float = 60.0,
        record_ttl: int = 3600,
    ):
        self.transport = transport
        self.tokenizer = tokenizer
        self.model = model
        self.max_queue = max_queue
        self.request_timeout = request_timeout
        self.inactivity_timeout = inactivity_timeout
        self.record_ttl = record_ttl
        self._engines_cache: tuple[float, list[EngineStatus]] = (0.0, [])

    # ---- tokenizing ------------------------------------------------------------------
    async def encode(
        self, text: str, add_special_tokens: bool = True, param: str = "prompt"
    ) -> list[int]:
        check_text(text, param)
        return await asyncio.to_thread(
            lambda: self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        )

    async def encode_chat(self, messages: list[dict], **template_kwargs) -> list[int]:
        check_text(messages, "messages")

        def run() -> list[int]:
            if not getattr(self.tokenizer, "chat_template", None):
                raise InvalidRequest("this model has no chat template; use /v1/completions")
            try:
                ids = self.tokenizer.apply_chat_template(
                    messages,
                    tokenize=True,
                    return_dict=False,
                    **{"add_generation_prompt": True, **template_kwargs},
                )
            except Exception as exc:  # a template that rejects these messages
                raise InvalidRequest(
                    f"the chat template rejected the messages: {exc}", "messages"
                ) from exc
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            return list(ids)

        return await asyncio.to_thread(run)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    # ---- engines ---------------------------------------------------------------------
    async def engines(self, max_age: float = 1.0) -> list[EngineStatus]:
        """Live engines (from their heartbeats), cached for ``max_age`` seconds."""
        stamp, cached = self._engines_cache
        if time.monotonic() - stamp < max_age:
            return cached
        infos = await self.transport.engines()
        self._engines_cache = (time.monotonic(), infos)
        return infos

    async def require_engine(self, model: str, kind: str = "generate") -> EngineStatus:
        engines = [e for e in await self.engines() if e.model == model]
        if not engines:
            raise Unavailable(f"no worker is serving {model!r} right now; retry shortly")
        matching = [e for e in engines if e.kind == kind]
        if not matching:
            what = "embedding" if engines[0].kind == "embed" else "generation"
            raise InvalidRequest(
                f"{model!r} is a{'n' if what == 'embedding' else ''} {what} model; it cannot serve {kind} requests",
                "model",
                "wrong_model_kind",
            )
        return matching[0]

    # ---- generating ------------------------------------------------------------------
    async def submit(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        stop: list[str] | None = None,
        include_stop: bool = False,
        request_id: str | None = None,
        priority: int = PRIORITY_INTERACTIVE,
        timeout: float | None = None,
        model: str | None = None,
        queue_limit: bool = True,
    ) -> RequestStream:
        """Enqueue a request (subscribed to its output first); raises QueueFull when the queue
        is full (``queue_limit``: the later choices of one HTTP request skip the check, so
        that a request the queue admitted is never refused half-way through).
        Iterate the returned stream for its output; ``aclose()`` it when done."""
        ctx = submit_context.get()
        if ctx is not None:
            priority, request_id = ctx.priority, ctx.next_id()
        request_id = request_id or uuid.uuid4().hex
        timeout = timeout or self.request_timeout
        started = time.time()
        request = EngineRequest(
            id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            model=model or self.model,
            priority=priority,
            deadline=started + timeout,
            created=started,
        )
        queue = await self.transport.subscribe(request_id)
        try:
            entry = await self._enqueue(request, timeout, ctx, queue_limit)
        except BaseException:
            self.transport.release(request_id, cancel=True)  # it may have been enqueued
            raise
        if entry is None:
            self.transport.release(request_id, cancel=False)
            raise QueueFull(f"the queue holds {self.max_queue} requests; retry shortly")
        return RequestStream(self, request, queue, stop or [], include_stop)

    async def _enqueue(
        self, request: EngineRequest, timeout: float, ctx: SubmitContext | None, queue_limit: bool
    ) -> str | None:
        ttl = int(timeout) + self.record_ttl
        if ctx is not None:  # batch lines: bounded by the task's concurrency, not the queue
            return await self.transport.enqueue(request, 0, ttl, attach=True)
        return await self.transport.enqueue(request, self.max_queue if queue_limit else 0, ttl)

    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, **kwargs
    ) -> AsyncIterator[GenerationChunk]:
        """Submit and stream one request. Leaving the iteration early cancels it."""
        stream = await self.submit(prompt_token_ids, params, **kwargs)
        try:
            async for chunk in stream:
                yield chunk
        finally:
            await stream.aclose()

    async def _messages(
        self, request: EngineRequest, queue: asyncio.Queue
    ) -> AsyncIterator[OutputMessage]:
        """Output messages in order, each token exactly once; raises on errors and deadlines."""
        expected = 0
        last_activity = time.monotonic()
        while True:
            remaining = request.deadline - time.time()
            if remaining <= 0:
                raise DeadlineExceeded(
                    f"the request did not finish within {_seconds(request.deadline - request.created)}s"
                )
            try:
                # asyncio.timeout, not wait_for: on Python 3.11 wait_for drops a cancellation
                # that lands as the queue yields a message, and a client that disconnected
                # mid-stream then left its request running to the end on the engine.
                async with asyncio.timeout(min(_POLL, remaining)):
                    msg: OutputMessage | LLMQError = await queue.get()
            except TimeoutError:
                msg, state = await self._recover(request, expected)
                if msg is None:
                    served = await self._served(request, state)
                    if state == "queued" and served:  # waiting its turn is not inactivity
                        last_activity = time.monotonic()
                    elif time.monotonic() - last_activity > self.inactivity_timeout:
                        if not served:
                            raise Unavailable(
                                f"no worker has served {request.model!r} for "
                                f"{_seconds(self.inactivity_timeout)}s; the request was cancelled, "
                                "retry shortly"
                            ) from None
                        raise DeadlineExceeded(
                            f"no output for {_seconds(self.inactivity_timeout)}s; the request was "
                            "cancelled",
                            code="inactivity_timeout",
                        ) from None
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
            filled, state = await self._recover(request, expected)
            if state != _UNAVAILABLE:
                if filled is None or filled.index + len(filled.tokens) < upto:
                    raise EngineFailure("output tokens were lost in transit", code="output_lost")
                return filled
            if time.time() >= request.deadline:
                raise DeadlineExceeded(
                    f"the request did not finish within {_seconds(request.deadline - request.created)}s"
                )
            await asyncio.sleep(0.1)

    async def _recover(
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

    async def embed(
        self,
        inputs: list[list[int]],
        *,
        dimensions: int | None = None,
        request_id: str | None = None,
        priority: int = PRIORITY_INTERACTIVE,
        timeout: float | None = None,
        model: str | None = None,
    ) -> EmbeddingResult:
        """Embed token-id inputs on an embeddings worker; vectors come back in input order."""
        ctx = submit_context.get()
        if ctx is not None:
            priority, request_id = ctx.priority, ctx.next_id()
        request_id = request_id or uuid.uuid4().hex
        timeout = timeout or self.request_timeout
        started = time.time()
        request = EngineRequest(
            id=request_id,
            prompt_token_ids=[],
            kind="embed",
            inputs=[list(x) for x in inputs],
            options={"dimensions": dimensions} if dimensions else {},
            model=model or self.model,
            priority=priority,
            deadline=started + timeout,
            created=started,
        )
        queue = await self.transport.subscribe(request_id)
        finished = False
        try:
            entry = await self._enqueue(request, timeout, ctx, True)
            if entry is None:
                raise QueueFull(f"the queue holds {self.max_queue} requests; retry shortly")
            async for msg in self._messages(request, queue):
                if not msg.done:
                    continue
                finished = True
                if msg.embeddings is None or len(msg.embeddings) != len(inputs):
                    raise EngineFailure("the embeddings were lost in transit", code="output_lost")
                usage = msg.usage or {}
                return EmbeddingResult(
                    msg.embeddings, usage.get("prompt_tokens", sum(map(len, inputs)))
                )
            raise EngineFailure("the embedding request ended without a result")
        finally:
            self.transport.release(request_id, cancel=not finished)

    async def all_tokens(
        self, prompt_token_ids: list[int], params: SamplingParams, **kwargs
    ) -> GenerationResult:
        """Run a request to the end and gather its output."""
        text: list[str] = []
        tokens: list[int] = []
        logprobs: list[dict] = []
        last = None
        async for chunk in self.generate(prompt_token_ids, params, **kwargs):
            text.append(chunk.text)
            tokens.extend(chunk.token_ids)
            if chunk.logprobs:
                logprobs.extend(chunk.logprobs)
            last = chunk
        assert last is not None and last.finish_reason is not None
        return GenerationResult(
            text="".join(text),
            token_ids=tokens,
            finish_reason=last.finish_reason,
            prompt_tokens=last.prompt_tokens,
            completion_tokens=last.completion_tokens,
            logprobs=logprobs,
            cached_tokens=last.cached_tokens,
        )


class RequestStream:
    """The output of one submitted request, as GenerationChunks. Closing it before the end
    (client gone, stop string) cancels the request on its engine."""

    def __init__(
        self,
        pipeline: TokenGeneratorPipeline,
        request: EngineRequest,
        queue: asyncio.Queue,
        stop: list[str],
        include_stop: bool = False,
    ):
        self.pipeline = pipeline
        self.request = request
        self.queue = queue
        self.stop = stop
        self.include_stop = include_stop
        self.finished = False
        self._closed = False
        self._gen = self._run()

    @property
    def id(self) -> str:
        return self.request.id

    def __aiter__(self) -> AsyncIterator[GenerationChunk]:
        return self._gen

    async def aclose(self) -> None:
        await self._gen.aclose()
        await self._cleanup()

    def fail(self, error: LLMQError) -> None:
        """End the stream with ``error`` at its next read (the request is then cancelled)."""
        self.queue.put_nowait(error)

    async def _cleanup(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.pipeline.transport.release(self.request.id, cancel=not self.finished)

    async def _run(self) -> AsyncIterator[GenerationChunk]:
        request = self.request
        num_prompt = len(request.prompt_token_ids)
        detok = IncrementalDetokenizer(self.pipeline.tokenizer)
        stopper = StopStringMatcher(self.stop, self.include_stop)
        try:
            async for msg in self.pipeline._messages(request, self.queue):
                delta = detok.add(msg.tokens) if msg.tokens else ""
                reason = msg.finish_reason
                if msg.done:
                    delta += detok.flush()
                # Stop strings count from min_tokens on, as EOS and stop_token_ids do.
                generated = msg.index + len(msg.tokens)
                text, hit = stopper.feed(delta, generated >= request.params.min_tokens)
                if hit:
                    reason = "stop"
                elif reason is not None:
                    text += stopper.flush()
                if reason == "abort" and not hit:
                    raise EngineFailure("the request was aborted on the worker")
                usage = msg.usage or {}
                chunk = GenerationChunk(
                    text=text,
                    token_ids=msg.tokens,
                    finish_reason=reason,
                    logprobs=msg.logprobs,
                    prompt_tokens=usage.get("prompt_tokens", num_prompt),
                    completion_tokens=usage.get("completion_tokens", msg.index + len(msg.tokens)),
                    cached_tokens=usage.get("cached_tokens", 0),
                    queue_time=usage.get("queue_time"),
                )
                if reason is not None:
                    self.finished = msg.done
                    yield chunk
                    return
                if text or msg.tokens:
                    yield chunk
        finally:
            await self._cleanup()


def _seconds(value: float) -> str:
    """1.5 -> "1.5", 600.0 -> "600": a timeout as its setting says it."""
    return f"{value:.1f}".removesuffix(".0")


def _engine_error(msg: OutputMessage) -> LLMQError:
    err = msg.error
    if err.type == "invalid_request_error":
        return InvalidRequest(err.message, code=err.code)
    if err.code == "deadline_exceeded":
        return DeadlineExceeded(err.message)
    return EngineFailure(err.message, code=err.code)


def _error_from_state(state: dict) -> EngineError:
    return EngineError(state.get("error") or "the request failed on the worker")
