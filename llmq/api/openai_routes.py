"""/v1/chat/completions, /v1/completions and /v1/models: validate, call the pipeline, shape the
response as OpenAI does (streaming as Server-Sent Events)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import anyio
from fastapi import APIRouter, Request
from sse_starlette import EventSourceResponse
from sse_starlette.sse import AppStatus

from llmq.api.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from llmq.common.engine_status import EngineStatus
from llmq.common.errors import InvalidRequest, LLMQError, ModelNotFound, ServerShuttingDown
from llmq.common.pipeline import GenerationChunk, RequestStream, TokenGeneratorPipeline
from llmq.common.sampling_params import SamplingParams

router = APIRouter()


# ---- models ------------------------------------------------------------------------------
def _model_card(e: EngineStatus) -> dict:
    card = {
        "id": e.model,
        "object": "model",
        "created": int(e.started),
        "owned_by": "llmq",
        "root": e.source or e.model,
        "max_model_len": e.max_model_len,
        "kind": e.kind,
    }
    if e.random_weights:
        card["random_weights"] = True
    return card


async def _live_models(request: Request) -> dict[str, dict]:
    models: dict[str, dict] = {}
    for e in await request.app.state.registry.engines():
        card = models.get(e.model)
        if card is None:
            models[e.model] = _model_card(e)
        else:
            card["created"] = min(card["created"], int(e.started))
    return models


@router.get("/v1/models")
async def list_models(request: Request) -> dict:
    models = await _live_models(request)
    return {"object": "list", "data": sorted(models.values(), key=lambda m: m["id"])}


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request) -> dict:
    models = await _live_models(request)
    if model_id not in models:
        raise ModelNotFound(f"the model {model_id!r} is not served right now", "model")
    return models[model_id]


# ---- shared generation core ---------------------------------------------------------------
@dataclass(slots=True)
class PromptGroup:
    """The n choices of one prompt: one request to the metrics, as in vLLM and OpenAI."""

    size: int
    first_token_at: float = 0.0
    finished: int = 0
    completion_tokens: int = 0


@dataclass(slots=True)
class Choice:
    index: int
    prompt_ids: list[int]
    params: SamplingParams
    group: PromptGroup
    prompt_text: str = ""  # for completions' echo
    last_token_at: float = 0.0
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


def _max_tokens(body: SamplingFields, wanted: int | None, prompt_len: int, context: int) -> int:
    if prompt_len >= context:
        raise InvalidRequest(
            f"this model's maximum context length is {context} tokens; the prompt has "
            f"{prompt_len} tokens",
            "messages" if isinstance(body, ChatCompletionRequest) else "prompt",
            "context_length_exceeded",
        )
    room = context - prompt_len
    if wanted is None:
        return room
    if wanted > room:
        raise InvalidRequest(
            f"this model's maximum context length is {context} tokens; you asked for "
            f"{prompt_len + wanted} tokens ({prompt_len} in the prompt, {wanted} to generate)",
            body.max_tokens_field(),
            "context_length_exceeded",
        )
    return wanted


def _truncated(body: SamplingFields, prompt_ids: list[int], context: int) -> list[int]:
    """The prompt's last ``truncate_prompt_tokens`` tokens (-1: as many as leave room for
    max_tokens, or for one token)."""
    keep = body.truncate_prompt_tokens
    if keep is None:
        return prompt_ids
    if keep == -1:
        keep = max(1, context - (body.wanted_max_tokens() or 1))
    return prompt_ids[-keep:]


# Choice i of a seeded request samples with its own seed (each reproducible); seeds are taken
# modulo 2**64, the range of torch's generators.
_CHOICE_SEED_STRIDE = 0xD1B54A32D192ED03


def _choice_params(
    body: SamplingFields, max_tokens: int, logprobs: int | None, i: int, vocab: int
) -> SamplingParams:
    params = body.sampling_params(max_tokens, logprobs)
    if params.seed is not None:
        params.seed = (params.seed + i * _CHOICE_SEED_STRIDE) % (1 << 64)
    if vocab and params.top_k >= vocab:
        params.top_k = 0  # keeps every token: off (and no int64 overflow in the sampler)
    return params


def _vocab(engine) -> int:
    """The served model's vocabulary size, from its worker's heartbeat (0: not known)."""
    return engine.vocab_size


def _check_token_ids(body: SamplingFields, vocab: int) -> None:
    """An id past the vocabulary would fail in the worker's sampler: refuse it here."""
    if not vocab:
        return
    if any(t >= vocab for t in body.stop_token_ids or []):
        raise InvalidRequest(
            f"stop_token_ids must be below the vocabulary size {vocab}", "stop_token_ids"
        )
    if any(int(t) >= vocab for t in body.logit_bias or {}):
        raise InvalidRequest(
            f"logit_bias token ids must be below the vocabulary size {vocab}", "logit_bias"
        )


def _check_tokens(prompt_ids: list[int], vocab: int | None, index: int | None) -> None:
    if not prompt_ids:
        raise InvalidRequest("the prompt is empty", "prompt")
    if vocab and any(t >= vocab for t in prompt_ids):
        where = f"prompt[{index}]" if index is not None else "prompt"
        raise InvalidRequest(f"token ids must be below the vocabulary size {vocab}", where)


async def _submit_all(
    pipeline: TokenGeneratorPipeline, choices: list[Choice], body: SamplingFields
) -> list[RequestStream]:
    """Every choice, or none: a full queue refuses the request before its first choice (a
    429 after work was done would have a retrying client do it all again)."""
    streams: list[RequestStream] = []
    try:
        for c in choices:
            streams.append(
                await pipeline.submit(
                    c.prompt_ids,
                    c.params,
                    stop=body.stop_list(),
                    include_stop=body.include_stop_str_in_output,
                    queue_limit=not streams,
                )
            )
    except BaseException:
        for s in streams:
            await s.aclose()
        raise
    return streams


def _record(request: Request, model: str, choice: Choice, chunk: GenerationChunk, started: float):
    metrics = request.app.state.metrics
    group = choice.group
    now = time.monotonic()
    if chunk.token_ids:
        if group.first_token_at == 0.0:
            group.first_token_at = now
            metrics.ttft.labels(model).observe(now - started)
        if choice.last_token_at:
            gap = now - choice.last_token_at
            metrics.itl.labels(model).observe(gap / len(chunk.token_ids))
        choice.last_token_at = now
    choice.text.append(chunk.text)
    choice.token_ids.extend(chunk.token_ids)
    if chunk.logprobs:
        choice.logprobs.extend(chunk.logprobs)
    if chunk.finish_reason is not None:
        choice.finish_reason = chunk.finish_reason
        choice.prompt_tokens = chunk.prompt_tokens
        choice.completion_tokens = chunk.completion_tokens
        choice.cached_tokens = chunk.cached_tokens
        if chunk.queue_time is not None:
            metrics.queue_time.labels(model).observe(chunk.queue_time)
        group.finished += 1
        group.completion_tokens += chunk.completion_tokens
        if group.finished == group.size:  # the prompt's last choice: the request is done
            metrics.e2e.labels(model).observe(now - started)
            metrics.success.labels(model, chunk.finish_reason).inc()
            metrics.prompt_tokens.labels(model).inc(chunk.prompt_tokens)
            metrics.generation_tokens.labels(model).inc(group.completion_tokens)


class ClientDisconnected(LLMQError):
    """The client left before a non-streamed answer was ready: its requests were cancelled.
    Answered quietly (nobody reads it), not logged as an exception in the ASGI app."""

    status = 499
    type = "client_closed_request"
    code = "client_disconnected"


async def _until_disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


# When the server shuts down, an answer gets this long to finish; then a stream ends with a
# server_shutting_down error event and [DONE], and a non-streamed request gets that error as a
# 503 (within uvicorn's 5 s graceful shutdown), so that a client tells a cut-off answer from a
# whole one, and its request is cancelled on the worker.
SHUTDOWN_DRAIN_S = 2.5


def _shutdown_error() -> ServerShuttingDown:
    return ServerShuttingDown(
        f"the server shut down before the answer was complete ({SHUTDOWN_DRAIN_S}s after "
        "shutdown began); retry on another replica"
    )


async def _end_at_shutdown(shutdown: anyio.Event, streams: list[RequestStream]) -> None:
    await shutdown.wait()
    await asyncio.sleep(SHUTDOWN_DRAIN_S)
    for s in streams:
        s.fail(_shutdown_error())


async def watch_shutdown(began: asyncio.Event) -> None:
    """Sets ``began`` once uvicorn starts to shut down (the flag sse-starlette's hook on
    uvicorn's exit handler sets): one poll for the app, not one per request in flight."""
    while not AppStatus.should_exit:
        await asyncio.sleep(0.25)
    began.set()


async def _shutdown_drained(began: asyncio.Event) -> None:
    """Returns SHUTDOWN_DRAIN_S after shutdown began."""
    await began.wait()
    await asyncio.sleep(SHUTDOWN_DRAIN_S)


async def _collect(
    request: Request, model: str, streams: list[RequestStream], choices: list[Choice]
) -> None:
    """Run every choice to the end; a client that disconnects, or a server shutdown that
    outlasts the drain, cancels them all."""
    started = time.monotonic()

    async def one(stream: RequestStream, choice: Choice) -> None:
        try:
            async for chunk in stream:
                _record(request, model, choice, chunk, started)
        finally:
            await stream.aclose()

    tasks = [asyncio.ensure_future(one(s, c)) for s, c in zip(streams, choices, strict=True)]
    watcher = asyncio.ensure_future(_until_disconnected(request))
    shutdown = asyncio.ensure_future(_shutdown_drained(request.app.state.shutting_down))
    everything = asyncio.gather(*tasks)
    try:
        await asyncio.wait([everything, watcher, shutdown], return_when=asyncio.FIRST_COMPLETED)
        if not everything.done():
            if shutdown.done():
                raise _shutdown_error()
            raise ClientDisconnected("the client disconnected")
        everything.result()
    finally:
        watcher.cancel()
        shutdown.cancel()
        everything.cancel()  # cancels the choices still running (their streams cancel upstream)
        await asyncio.gather(*tasks, watcher, shutdown, return_exceptions=True)
        with contextlib.suppress(BaseException):
            await everything  # its outcome retrieved: no "exception was never retrieved" log


async def _merged(
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


def _sse(data: dict | str) -> dict:
    return {"data": data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))}


def _stream_response(
    request: Request,
    model: str,
    streams: list[RequestStream],
    choices: list[Choice],
    first: Callable[[], list[dict]],
    chunk_body: Callable[[Choice, GenerationChunk], dict],
    usage_body: Callable[[], dict] | None,
) -> EventSourceResponse:
    shutdown = anyio.Event()

    async def events():
        started = time.monotonic()
        ender = asyncio.ensure_future(_end_at_shutdown(shutdown, streams))
        try:
            for body in first():
                yield _sse(body)
            async for choice, chunk in _merged(streams, choices):
                _record(request, model, choice, chunk, started)
                if chunk.text or chunk.finish_reason is not None or chunk.logprobs:
                    yield _sse(chunk_body(choice, chunk))
            if usage_body is not None:
                yield _sse(usage_body())
        except LLMQError as exc:
            yield _sse(exc.to_dict())
        finally:
            ender.cancel()
            for s in streams:
                await s.aclose()
        yield _sse("[DONE]")

    return EventSourceResponse(
        events(),
        ping=15,
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        shutdown_event=shutdown,
        shutdown_grace_period=SHUTDOWN_DRAIN_S + 1.0,
    )


def _usage(choices: list[Choice], prompt_tokens: int) -> dict:
    completion = sum(c.completion_tokens for c in choices)
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
    }
    cached = max((c.cached_tokens for c in choices), default=0)
    if cached:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return usage


def _token_text(pipeline: TokenGeneratorPipeline, token_id: int) -> str:
    return pipeline.tokenizer.decode([token_id], skip_special_tokens=False)


def _chat_logprobs(pipeline: TokenGeneratorPipeline, entries: list[dict]) -> dict:
    def item(token_id: int, logprob: float) -> dict:
        text = _token_text(pipeline, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    content = []
    for e in entries:
        row = item(e["token_id"], e["logprob"])
        row["top_logprobs"] = [item(t, lp) for t, lp in e.get("top", [])]
        content.append(row)
    return {"content": content}


def _completion_logprobs(
    pipeline: TokenGeneratorPipeline, entries: list[dict], offset: int
) -> tuple[dict, int]:
    """The logprobs object, and the text offset after its last token: offsets count each
    token's own text, streamed or not (a token that ends inside a character counts U+FFFD)."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for e in entries:
        text = _token_text(pipeline, e["token_id"])
        tokens.append(text)
        token_logprobs.append(e["logprob"])
        top.append({_token_text(pipeline, t): lp for t, lp in e.get("top", [])})
        offsets.append(offset)
        offset += len(text)
    body = {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": offsets,
    }
    return body, offset


# ---- chat ------------------------------------------------------------------------------
@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    registry = request.app.state.registry
    pipeline, engine = await registry.get(body.model)
    model = pipeline.model
    vocab = _vocab(engine)
    _check_token_ids(body, vocab)
    prompt_ids = await pipeline.encode_chat(body.template_messages(), **body.template_kwargs())
    prompt_ids = _truncated(body, prompt_ids, engine.max_model_len)
    max_tokens = _max_tokens(body, body.wanted_max_tokens(), len(prompt_ids), engine.max_model_len)
    logprobs = body.wanted_logprobs()
    group = PromptGroup(body.n)
    choices = [
        Choice(i, prompt_ids, _choice_params(body, max_tokens, logprobs, i, vocab), group)
        for i in range(body.n)
    ]
    streams = await _submit_metered(request, model, pipeline, choices, body)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())

    def envelope(choice_rows: list[dict], **extra) -> dict:
        return {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": choice_rows,
            **extra,
        }

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def first() -> list[dict]:
            return [
                envelope(
                    [
                        {
                            "index": c.index,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ]
                )
                for c in choices
            ]

        def chunk_body(choice: Choice, chunk: GenerationChunk) -> dict:
            delta = {"content": chunk.text} if chunk.text or chunk.finish_reason is None else {}
            row = {
                "index": choice.index,
                "delta": delta,
                "logprobs": _chat_logprobs(pipeline, chunk.logprobs)
                if logprobs is not None and chunk.logprobs
                else None,
                "finish_reason": chunk.finish_reason,
            }
            return envelope([row])

        usage = (
            (lambda: envelope([], usage=_usage(choices, len(prompt_ids))))
            if include_usage
            else None
        )
        return _stream_response(request, model, streams, choices, first, chunk_body, usage)

    await _collect(request, model, streams, choices)
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": "".join(c.text)},
                "logprobs": _chat_logprobs(pipeline, c.logprobs) if logprobs is not None else None,
                "finish_reason": c.finish_reason,
            }
            for c in choices
        ],
        "usage": _usage(choices, len(prompt_ids)),
    }


async def _submit_metered(
    request: Request, model: str, pipeline, choices: list[Choice], body: SamplingFields
):
    metrics = request.app.state.metrics
    try:
        return await _submit_all(pipeline, choices, body)
    except LLMQError as exc:
        metrics.rejected.labels(model, exc.code or exc.type).inc()
        raise


# ---- completions -------------------------------------------------------------------------
@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    registry = request.app.state.registry
    pipeline, engine = await registry.get(body.model)
    model = pipeline.model
    vocab = _vocab(engine)
    _check_token_ids(body, vocab)
    prompts = body.prompts()
    encoded: list[tuple[list[int], str]] = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if not p:
                raise InvalidRequest("the prompt is empty", "prompt")
            ids = await pipeline.encode(p)
            encoded.append((ids, p))
        else:
            index = i if len(prompts) > 1 else None
            _check_tokens(p, vocab, index)
            encoded.append((list(p), pipeline.decode(list(p)) if body.echo else ""))
    logprobs = body.wanted_logprobs()
    if body.truncate_prompt_tokens is not None:
        encoded = [
            (kept, text if len(kept) == len(ids) or not body.echo else pipeline.decode(kept))
            for ids, text in encoded
            for kept in [_truncated(body, ids, engine.max_model_len)]
        ]
    choices: list[Choice] = []
    for ids, text in encoded:
        max_tokens = _max_tokens(body, body.wanted_max_tokens(), len(ids), engine.max_model_len)
        group = PromptGroup(body.n)
        for j in range(body.n):
            params = _choice_params(body, max_tokens, logprobs, j, vocab)
            choices.append(Choice(len(choices), ids, params, group, text))
    streams = await _submit_metered(request, model, pipeline, choices, body)
    rid = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    # Each prompt counted once, however many choices it has (as chat, OpenAI and vLLM count).
    prompt_tokens = sum(len(ids) for ids, _ in encoded)

    def envelope(choice_rows: list[dict], **extra) -> dict:
        return {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": choice_rows,
            **extra,
        }

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        offsets = {c.index: len(c.prompt_text) if body.echo else 0 for c in choices}

        def first() -> list[dict]:
            if not body.echo:
                return []
            return [
                envelope(
                    [
                        {
                            "index": c.index,
                            "text": c.prompt_text,
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ]
                )
                for c in choices
            ]

        def chunk_body(choice: Choice, chunk: GenerationChunk) -> dict:
            lp = None
            if logprobs is not None and chunk.logprobs:
                lp, offsets[choice.index] = _completion_logprobs(
                    pipeline, chunk.logprobs, offsets[choice.index]
                )
            return envelope(
                [
                    {
                        "index": choice.index,
                        "text": chunk.text,
                        "logprobs": lp,
                        "finish_reason": chunk.finish_reason,
                    }
                ]
            )

        usage = (
            (lambda: envelope([], usage=_usage_completions(choices, prompt_tokens)))
            if include_usage
            else None
        )
        return _stream_response(request, model, streams, choices, first, chunk_body, usage)

    await _collect(request, model, streams, choices)
    rows = []
    for c in choices:
        prefix = c.prompt_text if body.echo else ""
        rows.append(
            {
                "index": c.index,
                "text": prefix + "".join(c.text),
                "logprobs": _completion_logprobs(pipeline, c.logprobs, len(prefix))[0]
                if logprobs is not None
                else None,
                "finish_reason": c.finish_reason,
            }
        )
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": rows,
        "usage": _usage_completions(choices, prompt_tokens),
    }


def _usage_completions(choices: list[Choice], prompt_tokens: int) -> dict:
    completion = sum(c.completion_tokens for c in choices)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
    }
