"""GenerationService: from a validated request body to its answer, for the HTTP routes (which
stream it or wait for it) and for batch lines (``answer``: a status code and a JSON body)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import redis
from pydantic import BaseModel, ValidationError

from llmq.common.engine_client.model_registry import ModelRegistry
from llmq.common.engine_client.pipeline import TokenGeneratorPipeline
from llmq.common.engine_status import EngineStatus
from llmq.common.errors import LLMQError, redis_failure
from llmq.common.serving import tokenization
from llmq.common.serving.chat import ChatGeneration, chat_choices, image_token_surplus
from llmq.common.serving.chat_request import ChatCompletionRequest
from llmq.common.serving.choices import Choice, check_token_ids
from llmq.common.serving.completions import CompletionGeneration, completion_choices
from llmq.common.serving.embeddings import embed, embedding_inputs
from llmq.common.serving.messages_api.objects import TokenCount
from llmq.common.serving.messages_api.request import MessagesPrompt, MessagesRequest
from llmq.common.serving.messages_api.run import MessagesRun
from llmq.common.serving.messages_api.translate import (
    Template,
    edited,
    ignored_effort,
    prompt_tokens,
)
from llmq.common.serving.messages_api.translate import (
    chat_request as messages_chat_request,
)
from llmq.common.serving.metrics import ChoiceRecorder, GenerationMetrics
from llmq.common.serving.model_cards import find_model, model_list
from llmq.common.serving.request_bodies import (
    CompletionRequest,
    EmbeddingRequest,
    SamplingFields,
)
from llmq.common.serving.rerank import (
    RerankRequest,
    RerankResponse,
    ScoreRequest,
    ScoreResponse,
    rerank,
    score,
)
from llmq.common.serving.responses import EmbeddingList, ModelCard, ModelList, WireModel
from llmq.common.serving.responses_api.answer import chat_request, echoed_fields
from llmq.common.serving.responses_api.items import input_items
from llmq.common.serving.responses_api.objects import new_response
from llmq.common.serving.responses_api.request import ResponsesRequest
from llmq.common.serving.responses_api.run import ResponsesRun
from llmq.common.serving.run import Generation
from llmq.common.serving.submission import SubmitOptions, submit_all
from llmq.common.serving.tokenization import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from llmq.common.validation import validation_error

PrepareChoices = Callable[
    [TokenGeneratorPipeline, EngineStatus, Any], Awaitable[tuple[list[Choice], int]]
]

# The endpoints ``answer`` serves, with the body each takes.
ENDPOINT_BODIES: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/v1/embeddings": EmbeddingRequest,
    "/v1/rerank": RerankRequest,
    "/v1/score": ScoreRequest,
    "/v1/messages": MessagesRequest,
}

_INTERACTIVE = SubmitOptions()
G = TypeVar("G", bound=Generation)

log = logging.getLogger(__name__)


class GenerationService:
    def __init__(self, registry: ModelRegistry, metrics: GenerationMetrics | None = None):
        self.registry = registry
        self.metrics = metrics

    async def chat(
        self, body: ChatCompletionRequest, options: SubmitOptions = _INTERACTIVE
    ) -> ChatGeneration:
        """The request's choices, submitted: run them with ``complete()`` or ``chunks()``."""
        return await self._generation(body, options, chat_choices, ChatGeneration)

    async def responses(
        self,
        body: ResponsesRequest,
        history: list[dict[str, Any]],
        options: SubmitOptions = _INTERACTIVE,
    ) -> ResponsesRun:
        """A Responses request after ``history`` (the items of the responses before it), run
        as the chat request it translates to."""
        generation = await self.chat(chat_request(body, history), options)
        response = new_response(generation.model, echoed_fields(body))
        items = history + input_items(body.input)
        return ResponsesRun(generation, response, items, body.namespaces())

    async def messages(
        self, body: MessagesRequest, options: SubmitOptions = _INTERACTIVE
    ) -> MessagesRun:
        """A Messages request (Anthropic's), run as the chat request it translates to."""
        pipeline, engine = await self.registry.get(body.model)
        template = Template.of(pipeline.tokenizer)
        body = await edited(pipeline, body)  # type: ignore[assignment]
        if (effort := ignored_effort(body, template)) is not None:
            log.debug("output_config.effort %r not applied: the template has no effort", effort)
        generation = await self.chat(messages_chat_request(body, template), options)
        return MessagesRun(generation, body, effort, engine.block_size)

    async def count_message_tokens(self, body: MessagesPrompt) -> TokenCount:
        pipeline, engine = await self.registry.get(body.model)
        body = await edited(pipeline, body)
        chat = messages_chat_request(body, Template.of(pipeline.tokenizer))
        images = await image_token_surplus(pipeline, engine, chat)
        return TokenCount(input_tokens=await prompt_tokens(pipeline, body) + images)

    async def completions(
        self, body: CompletionRequest, options: SubmitOptions = _INTERACTIVE
    ) -> CompletionGeneration:
        return await self._generation(body, options, completion_choices, CompletionGeneration)

    async def _generation(
        self,
        body: SamplingFields,
        options: SubmitOptions,
        prepare: PrepareChoices,
        kind: type[G],
    ) -> G:
        pipeline, engine = await self.registry.get(body.model)
        check_token_ids(body, engine.vocab_size)
        await body.prepare_grammar()  # a 400 for a bad constraint before anything is enqueued
        choices, prompt_tokens = await prepare(pipeline, engine, body)
        try:
            streams = await submit_all(pipeline, choices, body, options)
        except LLMQError as exc:
            if self.metrics:
                self.metrics.count_rejected(pipeline.model, exc.code or exc.type)
            raise
        recorder = ChoiceRecorder(self.metrics, pipeline.model)
        return kind(pipeline.tokenizer, body, choices, streams, prompt_tokens, recorder)

    async def embeddings(
        self, body: EmbeddingRequest, options: SubmitOptions = _INTERACTIVE
    ) -> EmbeddingList:
        items = embedding_inputs(body.input)
        pipeline, engine = await self.registry.get(body.model, kind="embed")
        return await embed(pipeline, engine, body, items, options)

    async def rerank(
        self, body: RerankRequest, options: SubmitOptions = _INTERACTIVE
    ) -> RerankResponse:
        return await rerank(self.registry, body, options)

    async def score(
        self, body: ScoreRequest, options: SubmitOptions = _INTERACTIVE
    ) -> ScoreResponse:
        return await score(self.registry, body, options)

    async def tokenize(self, body: TokenizeRequest) -> TokenizeResponse:
        pipeline, engine = await self.registry.get(body.model)
        return await tokenization.tokenize(pipeline, engine, body)

    async def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        pipeline, engine = await self.registry.get(body.model)
        return tokenization.detokenize(pipeline, engine, body)

    async def tokenizer_info(self, model: str | None) -> dict[str, Any]:
        pipeline, engine = await self.registry.get(model)
        return tokenization.tokenizer_info(pipeline, engine)

    async def models(self) -> ModelList:
        return model_list(await self.registry.engines(), await self.registry.adapters())

    async def model(self, model_id: str) -> ModelCard:
        engines = await self.registry.engines()
        return find_model(engines, model_id, await self.registry.adapters())

    async def answer(
        self, endpoint: str, body: dict, options: SubmitOptions
    ) -> tuple[int, dict[str, Any]]:
        """The status code and JSON body the HTTP route would answer to ``body`` (never
        streamed): a batch line's result."""
        try:
            return 200, (await self._answer(endpoint, body, options)).model_dump()
        except LLMQError as exc:
            return exc.status, exc.to_dict()
        except redis.RedisError as exc:  # as the API answers it
            log.warning("redis failed: %s", exc)
            error = redis_failure(exc)
            return error.status, error.to_dict()

    async def _answer(self, endpoint: str, body: dict, options: SubmitOptions) -> WireModel:
        model = ENDPOINT_BODIES.get(endpoint)
        if model is None:
            raise ValueError(f"{endpoint!r} is not an endpoint of the generation service")
        try:
            request = model.model_validate({**body, "stream": False})
        except ValidationError as exc:
            raise validation_error(list(exc.errors())) from None
        if isinstance(request, EmbeddingRequest):
            return await self.embeddings(request, options)
        if isinstance(request, RerankRequest):
            return await self.rerank(request, options)
        if isinstance(request, ScoreRequest):
            return await self.score(request, options)
        if isinstance(request, MessagesRequest):
            return await (await self.messages(request, options)).complete()
        if isinstance(request, ChatCompletionRequest):
            generation: Generation = await self.chat(request, options)
        else:
            generation = await self.completions(request, options)
        return await generation.complete()
