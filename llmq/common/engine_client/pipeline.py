"""TokenGeneratorPipeline: the async client of the engines, used by the API and batch tasks.

It tokenizes (chat template included) through a PromptEncoder (``prompt_encoder.py``: bounded
threads, prompts refused or truncated without tokenizing them whole), subscribes to the
request's output channel before enqueueing it, and hands back a RequestStream
(``request_stream.py``: incremental detokenizing, stop strings, cancelling the request on the
engine) that reads the output through an OutputReader (``request_output.py``: repeats dropped,
gaps filled from the request's recorded tokens, a clear error when the deadline passes or
nothing arrives for too long).
"""

from __future__ import annotations

import copy
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from llmq.common.engine_client.deadline import Deadline, current_deadline
from llmq.common.engine_client.prompt_encoder import (
    PromptEncoder,
    PromptLimits,
    TooManyTokens,
    context_exceeded,
)
from llmq.common.engine_client.request_output import OutputReader
from llmq.common.engine_client.request_stream import GenerationChunk, RequestStream
from llmq.common.engine_client.text_input import check_text
from llmq.common.engine_status import EngineStatus
from llmq.common.errors import EngineFailure, InvalidRequest, QueueFull, Unavailable
from llmq.common.lora_adapters import AdapterRecord
from llmq.common.placement.placer import Placer
from llmq.common.protocol import PRIORITY_INTERACTIVE, EngineRequest
from llmq.common.sampling_params import SamplingParams
from llmq.common.transport import AsyncTransport

_KIND_NAMES = {"generate": "a generation", "embed": "an embedding", "score": "a cross-encoder"}


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
        no_worker_grace: float = 1.0,
        placement: bool = False,
        placement_load_weight: float = 0.25,
    ):
        """``placement``: name in each generation request the worker chosen for it
        (``placer.py``); off, whichever worker reads it first takes it."""
        self.transport = transport
        self.tokenizer = tokenizer
        self.encoder = PromptEncoder(tokenizer)
        self.model = model  # the name answers carry: the model's, or an adapter's
        self.base_model = model  # the model whose stream requests go on
        self.adapter: AdapterRecord | None = None
        self.max_queue = max_queue
        self.request_timeout = request_timeout
        self.inactivity_timeout = inactivity_timeout
        self.record_ttl = record_ttl
        self._engines_cache: tuple[float, list[EngineStatus]] = (0.0, [])
        self.placer = Placer(transport, self.engines, placement_load_weight) if placement else None
        self.output = OutputReader(
            transport, self.engines, inactivity_timeout, no_worker_grace, record_ttl
        )

    def for_adapter(self, adapter: AdapterRecord) -> TokenGeneratorPipeline:
        """This model's pipeline for requests under a LoRA adapter: the same tokenizer, queue
        and output reader; answers name the adapter, entries carry it."""
        view = copy.copy(self)
        view.model = adapter.name
        view.adapter = adapter
        return view

    # ---- tokenizing ------------------------------------------------------------------
    async def encode(
        self,
        text: str,
        add_special_tokens: bool = True,
        param: str = "prompt",
        limits: PromptLimits | None = None,
    ) -> list[int]:
        """The text's token ids; with ``limits``: a 400 context_length_exceeded for a prompt
        that cannot fit (found without tokenizing it whole), or its kept tail only."""
        check_text(text, param)
        return await self._encode(text, add_special_tokens, param, limits)

    async def _encode(
        self, text: str, add_special_tokens: bool, param: str, limits: PromptLimits | None
    ) -> list[int]:
        if limits is None:
            return await self.encoder.encode(text, add_special_tokens)
        if limits.keep_last is not None:
            return await self.encoder.encode(text, add_special_tokens, keep_last=limits.keep_last)
        try:
            return await self.encoder.encode(text, add_special_tokens, most=limits.context - 1)
        except TooManyTokens as exc:
            raise context_exceeded(limits.context, exc.at_least, param) from None

    async def encode_chat(
        self, messages: list[dict], tools: list[dict] | None = None, **template_kwargs
    ) -> list[int]:
        """The prompt's token ids: ``messages`` (and the ``tools`` offered, when any) through
        the chat template."""
        return await self.encode_chat_prompt(messages, tools, template_kwargs)

    async def encode_chat_prompt(
        self,
        messages: list[dict],
        tools: list[dict] | None,
        template_kwargs: dict,
        limits: PromptLimits | None = None,
        transform: Callable[[str], str] | None = None,
    ) -> list[int]:
        """``encode_chat`` with the ``limits`` of ``encode`` on the rendered text (changed by
        ``transform`` first: a vision model's image text)."""
        check_text(messages, "messages")
        check_text(tools, "tools")
        text = await self.encoder.render_chat(messages, tools, template_kwargs)
        if transform is not None:
            text = transform(text)
        return await self._encode(text, False, "messages", limits)

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

    async def require_engine(
        self, model: str, kind: str | tuple[str, ...] = "generate"
    ) -> EngineStatus:
        """A live engine of ``model`` of ``kind`` (or of one of several kinds)."""
        engines = [e for e in await self.engines() if e.model == model]
        if not engines:  # the cache may predate a worker that just came (back) up
            engines = [e for e in await self.engines(max_age=0.0) if e.model == model]
        if not engines:
            raise Unavailable(f"no worker is serving {model!r} right now; retry shortly")
        kinds = (kind,) if isinstance(kind, str) else kind
        matching = [e for e in engines if e.kind in kinds]
        if not matching:
            what = _KIND_NAMES.get(engines[0].kind, engines[0].kind)
            raise InvalidRequest(
                f"{model!r} is {what} model; it cannot serve {' or '.join(kinds)} requests",
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
        queue_slots: int = 1,
        attach: bool = False,
        images: list[str] | None = None,
    ) -> RequestStream:
        """Enqueue a request (subscribed to its output first); raises QueueFull when the queue
        has no room for ``queue_slots`` requests (the first choice of an HTTP request counts
        all of its prompts x n; the later ones, 0, skip the check, so that a request the queue
        admitted is never refused half-way through). ``attach``: a
        request with this id that exists already is followed, not started again (a batch
        line run a second time); such requests skip the queue limit. ``images``: the
        content hashes of the prompt's images (stored in Redis), in order.
        Iterate the returned stream for its output; ``aclose()`` it when done."""
        request_id = request_id or uuid.uuid4().hex
        deadline = self._deadline(timeout)
        request = EngineRequest(
            id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            model=model or self.base_model,
            priority=priority,
            deadline=deadline.at,
            created=deadline.arrived,
            images=list(images or ()),
        )
        if self.adapter is not None:
            request.lora_name, request.lora_path = self.adapter.name, self.adapter.path
        queue, request.reply_to = await self.transport.subscribe(request_id, request.model)
        try:
            entry = await self._enqueue(request, attach, queue_slots)
        except BaseException:
            self.transport.release(request_id, request.model, cancel=True)  # it may be enqueued
            raise
        if entry is None:
            self.transport.release(request_id, request.model, cancel=False)
            raise QueueFull(f"the queue holds {self.max_queue} requests; retry shortly")
        return RequestStream(self, request, queue, stop or [], include_stop)

    def _deadline(self, timeout: float | None) -> Deadline:
        """The request's deadline: ``timeout`` from now where given, else the one fixed at its
        arrival (the time it waited for its model's load counted), else LLMQ_REQUEST_TIMEOUT
        from now; raises where it has passed already."""
        if timeout:
            now = time.time()
            deadline = Deadline(now, now + timeout)
        else:
            deadline = current_deadline(self.request_timeout)
        if deadline.passed():
            raise deadline.exceeded()
        return deadline

    async def _enqueue(self, request: EngineRequest, attach: bool, queue_slots: int) -> str | None:
        ttl = int(max(1.0, request.deadline - time.time())) + self.record_ttl
        target = await self.placer.target(request) if self.placer is not None else ""
        if attach:  # batch lines: bounded by the task's concurrency, not the queue
            return await self.transport.enqueue(request, 0, ttl, attach=True, target=target)
        limit = self.max_queue if queue_slots else 0
        slots = max(queue_slots, 1)
        return await self.transport.enqueue(request, limit, ttl, slots=slots, target=target)

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

    async def embed(
        self,
        inputs: list[list[int]],
        *,
        dimensions: int | None = None,
        request_id: str | None = None,
        priority: int = PRIORITY_INTERACTIVE,
        timeout: float | None = None,
        model: str | None = None,
        attach: bool = False,
        kind: str = "embed",
        options: dict | None = None,
    ) -> EmbeddingResult:
        """Embed token-id inputs on an embeddings worker; vectors come back in input order
        (``attach`` as for ``submit``). ``kind`` "score": inputs are pairs a cross-encoder
        scores, each answered as a vector of one."""
        request_id = request_id or uuid.uuid4().hex
        deadline = self._deadline(timeout)
        request = EngineRequest(
            id=request_id,
            prompt_token_ids=[],
            kind=kind,
            inputs=[list(x) for x in inputs],
            options={**(options or {}), **({"dimensions": dimensions} if dimensions else {})},
            model=model or self.base_model,
            priority=priority,
            deadline=deadline.at,
            created=deadline.arrived,
        )
        queue, request.reply_to = await self.transport.subscribe(request_id, request.model)
        finished = False
        try:
            entry = await self._enqueue(request, attach, 1)
            if entry is None:
                raise QueueFull(f"the queue holds {self.max_queue} requests; retry shortly")
            async for msg in self.output.messages(request, queue):
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
            self.transport.release(request_id, request.model, cancel=not finished)

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
