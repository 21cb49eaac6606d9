"""The output of one submitted request as text chunks: detokenized incrementally, trimmed at
stop strings, and cancelled on its engine when closed before the end."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

from llmq.common.engine_client.request_output import OutputReader
from llmq.common.engine_client.tokenizer import IncrementalDetokenizer, StopStringMatcher
from llmq.common.errors import EngineFailure, LLMQError
from llmq.common.placement.placer import Placer
from llmq.common.protocol import EngineRequest
from llmq.common.transport import AsyncTransport


class StreamSource(Protocol):
    """What a stream reads from its pipeline, named here so this module needs no import of it."""

    transport: AsyncTransport
    tokenizer: Any
    placer: Placer | None
    output: OutputReader


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
    prompt_logprobs: list[dict | None] | None = None  # on the first chunk, when asked for


class RequestStream:
    """The output of one submitted request, as GenerationChunks. Closing it before the end
    (client gone, stop string) cancels the request on its engine."""

    def __init__(
        self,
        pipeline: StreamSource,
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
        self.pipeline.transport.release(
            self.request.id, self.request.model, cancel=not self.finished
        )

    async def _run(self) -> AsyncIterator[GenerationChunk]:
        request = self.request
        num_prompt = len(request.prompt_token_ids)
        detok = IncrementalDetokenizer(self.pipeline.tokenizer)
        stopper = StopStringMatcher(self.stop, self.include_stop)
        placer = self.pipeline.placer
        try:
            async for msg in self.pipeline.output.messages(request, self.queue):
                if placer is not None and msg.index == 0:
                    placer.computed(request.id)
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
                    prompt_logprobs=msg.prompt_logprobs,
                )
                if reason is not None:
                    self.finished = msg.done
                    yield chunk
                    return
                if text or msg.tokens:
                    yield chunk
        finally:
            await self._cleanup()
