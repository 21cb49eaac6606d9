"""Generation: the choices of one submitted request, run to the end (``complete``) or streamed
(``chunks``); chat and completions differ only in how they shape the answer."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from typing import ClassVar

from llmq.common.engine_client.request_stream import GenerationChunk, RequestStream
from llmq.common.errors import LLMQError
from llmq.common.serving.choices import Choice
from llmq.common.serving.logprobs import vllm_prompt_logprobs
from llmq.common.serving.metrics import ChoiceRecorder
from llmq.common.serving.request_bodies import SamplingFields
from llmq.common.serving.responses import PromptTokensDetails, Usage, WireModel


class Generation(ABC):
    id_prefix: ClassVar[str]
    reports_cached_tokens: ClassVar[bool] = True

    def __init__(
        self,
        tokenizer,
        body: SamplingFields,
        choices: list[Choice],
        streams: list[RequestStream],
        prompt_tokens: int,
        recorder: ChoiceRecorder,
    ):
        self.tokenizer = tokenizer
        self.body = body
        self.choices = choices
        self.streams = streams
        # Each prompt counted once, however many choices it has (as OpenAI and vLLM count).
        self.prompt_tokens = prompt_tokens
        self.recorder = recorder
        self.model = recorder.model
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.wants_logprobs = body.wanted_logprobs() is not None

    # ---- running ---------------------------------------------------------------------------
    async def complete(self) -> WireModel:
        """Run every choice to the end and answer them all; cancelling this cancels them."""
        self.recorder.start()

        async def one(stream: RequestStream, choice: Choice) -> None:
            try:
                async for chunk in stream:
                    self.recorder.record(choice, chunk)
            finally:
                await stream.aclose()

        pairs = zip(self.streams, self.choices, strict=True)
        tasks = [asyncio.ensure_future(one(s, c)) for s, c in pairs]
        everything = asyncio.gather(*tasks)
        try:
            await everything
        finally:
            everything.cancel()  # cancels the choices still running (their streams cancel upstream)
            await asyncio.gather(*tasks, return_exceptions=True)
            with contextlib.suppress(BaseException):
                await everything  # its outcome retrieved: no "exception was never retrieved" log
        response = self.response()
        k = self.body.prompt_logprobs
        if k is not None and "prompt_logprobs" in type(response).model_fields:
            # vLLM's place on chat: the response's top level (one prompt for every choice).
            entries = self.choices[0].prompt_logprobs or []
            response.prompt_logprobs = vllm_prompt_logprobs(self.tokenizer, entries, k)
        return response

    async def chunks(self) -> AsyncIterator[WireModel]:
        """The answer as stream chunks: opening ones, one per chunk of output that carries
        something, and the usage last when the body asked for it."""
        self.recorder.start()
        for opening in self.opening_chunks():
            yield opening
        async for choice, chunk in merged(self.streams, self.choices):
            self.recorder.record(choice, chunk)
            if (
                chunk.text
                or chunk.finish_reason is not None
                or chunk.logprobs
                or (chunk.prompt_logprobs is not None)
            ):
                yield self.chunk(choice, chunk)
        options = self.body.stream_options
        if options and options.include_usage:
            yield self.usage_chunk()

    def fail(self, error: LLMQError) -> None:
        """End every choice with ``error`` (each is then cancelled on its worker)."""
        for s in self.streams:
            s.fail(error)

    async def aclose(self) -> None:
        for s in self.streams:
            await s.aclose()

    def usage(self) -> Usage:
        completion = sum(c.completion_tokens for c in self.choices)
        cached = max((c.cached_tokens for c in self.choices), default=0)
        details = None
        if cached and self.reports_cached_tokens:
            details = PromptTokensDetails(cached_tokens=cached)
        return Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=completion,
            total_tokens=self.prompt_tokens + completion,
            prompt_tokens_details=details,
        )

    # ---- shaping, per endpoint -------------------------------------------------------------
    @abstractmethod
    def opening_chunks(self) -> list[WireModel]:
        """Chunks sent before any output (chat's role, completions' echo)."""

    @abstractmethod
    def chunk(self, choice: Choice, chunk: GenerationChunk) -> WireModel:
        """The stream chunk of one chunk of a choice's output."""

    @abstractmethod
    def usage_chunk(self) -> WireModel:
        """The last stream chunk: no choices, the usage."""

    @abstractmethod
    def response(self) -> WireModel:
        """The whole answer, once every choice finished."""


async def merged(
    streams: list[RequestStream], choices: list[Choice]
) -> AsyncIterator[tuple[Choice, GenerationChunk]]:
    """Chunks of several streams as they come."""
    if len(streams) == 1:
        async for chunk in streams[0]:
            yield choices[0], chunk
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(stream: RequestStream, choice: Choice) -> None:
        try:
            async for chunk in stream:
                await queue.put((choice, chunk))
        except BaseException as exc:  # handed to the consumer
            await queue.put(exc)
        finally:
            await queue.put(done)

    tasks = [asyncio.ensure_future(pump(s, c)) for s, c in zip(streams, choices, strict=True)]
    remaining = len(tasks)
    try:
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
