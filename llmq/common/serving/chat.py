"""/v1/chat/completions: the messages through the chat template, n choices, OpenAI's chat
answer and chunks."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator

from llmq.common.engine_client.pipeline import TokenGeneratorPipeline
from llmq.common.engine_client.request_stream import GenerationChunk
from llmq.common.engine_status import EngineStatus
from llmq.common.images.decode import CheckedImage
from llmq.common.images.prompt import expand_images, image_tokens, text_expansion
from llmq.common.images.request import chat_image_refs, checked_images, store_images
from llmq.common.serving.chat_request import ChatCompletionRequest
from llmq.common.serving.choices import (
    Choice,
    PromptGroup,
    choice_params,
    max_tokens,
    truncated,
)
from llmq.common.serving.logprobs import chat_logprobs
from llmq.common.serving.marker_tokens import MarkerKeepingStream, skipped_markers
from llmq.common.serving.prompt_limits import prompt_limits
from llmq.common.serving.reasoning import (
    answer_grammar,
    chat_reasoning,
    reasoning_template_kwargs,
)
from llmq.common.serving.responses import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatLogprobs,
    CompletionTokensDetails,
    Usage,
    WireModel,
)
from llmq.common.serving.run import Generation
from llmq.common.serving.structured_output import requested_constraint
from llmq.common.serving.tool_calls import ChoiceToolCalls
from llmq.common.serving.tool_grammar import tool_grammar
from llmq.common.serving.tool_parsers import FORCED_ARRAY, choose_format
from llmq.common.serving.tool_request import forced_tool_name
from llmq.common.settings import get_settings


async def chat_choices(
    pipeline: TokenGeneratorPipeline, engine: EngineStatus, body: ChatCompletionRequest
) -> tuple[list[Choice], int]:
    """The request's choices, and its prompt tokens."""
    vocab = engine.vocab_size
    images = await request_images(pipeline, engine, body)
    effort = reasoning_template_kwargs(
        body.reasoning_effort, getattr(pipeline.tokenizer, "chat_template", None)
    )
    transform = text_expansion(engine, images)
    prompt_ids = await pipeline.encode_chat_prompt(
        body.template_messages(),
        body.template_tools(),
        {**body.template_kwargs(), **effort},
        prompt_limits(body, engine.max_model_len),
        transform,
    )
    if images and transform is None:
        prompt_ids = expand_images(prompt_ids, engine, images)
    prompt_ids = truncated(body, prompt_ids, engine.max_model_len)
    limit = max_tokens(body, len(prompt_ids), engine.max_model_len)
    logprobs = body.wanted_logprobs()
    group = PromptGroup(body.n)
    digests = [i.digest for i in images]
    choices = [
        Choice(i, prompt_ids, choice_params(body, limit, logprobs, i, vocab), group, images=digests)
        for i in range(body.n)
    ]
    grammar = answer_grammar(
        pipeline.tokenizer, prompt_ids, _answer_grammar(body), body.thinking_budget
    )
    if grammar is not None:
        for c in choices:
            c.params.grammar = grammar
    return choices, len(prompt_ids)


async def request_images(
    pipeline: TokenGeneratorPipeline, engine: EngineStatus, body: ChatCompletionRequest
) -> list[CheckedImage]:
    """The request's images, checked and stored, before anything is tokenized or queued."""
    refs = chat_image_refs(body.messages)
    if not refs:
        return []
    images = await checked_images(refs, pipeline.model, engine.images)
    keys = pipeline.transport.keys.for_model(pipeline.base_model)
    await store_images(pipeline.transport.r, keys.image, images, get_settings().image_ttl)
    return images


async def with_image_tokens(
    pipeline: TokenGeneratorPipeline,
    engine: EngineStatus,
    body: ChatCompletionRequest,
    prompt_ids: list[int],
) -> list[int]:
    """A rendered chat prompt with its images' tokens, as a generation of ``body`` sends it
    (the images checked, not stored): what /tokenize answers."""
    refs = chat_image_refs(body.messages)
    if not refs:
        return prompt_ids
    images = await checked_images(refs, pipeline.model, engine.images)
    transform = text_expansion(engine, images)
    if transform is None:
        return expand_images(prompt_ids, engine, images)
    args = (body.template_messages(), body.template_tools(), body.template_kwargs())
    return await pipeline.encode_chat_prompt(*args, None, transform)


async def image_token_surplus(
    pipeline: TokenGeneratorPipeline, engine: EngineStatus, body: ChatCompletionRequest
) -> int:
    """The tokens ``body``'s images add to its rendered prompt (each image token there
    becomes the image's tokens): what count_tokens adds."""
    refs = chat_image_refs(body.messages)
    if not refs:
        return 0
    images = await checked_images(refs, pipeline.model, engine.images)
    transform = text_expansion(engine, images)
    if transform is None:
        return sum(image_tokens(engine, i) - 1 for i in images)
    args = (body.template_messages(), body.template_tools(), body.template_kwargs())
    expanded = await pipeline.encode_chat_prompt(*args, None, transform)
    return len(expanded) - len(await pipeline.encode_chat_prompt(*args))


def _answer_grammar(body: ChatCompletionRequest) -> str | None:
    """The grammar of an answer a reasoning model gives after its thinking: a forced tool
    call's, or JSON's. A regex, choice or Lark grammar of the body's own holds from the first
    token (it may spell the thinking and its closing tag itself)."""
    if body.tools and body.tool_mode() in ("required", "named"):
        return tool_grammar(
            body.tools, forced_tool_name(body.tool_choice), body.parallel_tool_calls
        )
    constraint = requested_constraint(body)
    return body.grammar() if constraint is not None and constraint.kind == "json_schema" else None


class ChunkSequence(WireModel):
    """Several stream chunks for one chunk of output (a call's opening, then its arguments)."""

    chunks: list[ChatCompletionChunk]


def choice_tool_calls(body: ChatCompletionRequest, tokenizer) -> ChoiceToolCalls | None:
    """How a choice's output becomes tool calls; None: it is text."""
    mode = body.tool_mode()
    if mode == "named":
        return ChoiceToolCalls("named", None, forced_tool_name(body.tool_choice), True)
    if mode == "required":
        return ChoiceToolCalls("required", FORCED_ARRAY, None, body.parallel_tool_calls)
    if mode != "auto":
        return None
    template = getattr(tokenizer, "chat_template", None)
    fmt = choose_format(get_settings().tool_parser, template if isinstance(template, str) else None)
    return None if fmt is None else ChoiceToolCalls("auto", fmt, None, body.parallel_tool_calls)


class ChatGeneration(Generation):
    id_prefix = "chatcmpl"

    def __init__(self, tokenizer, body: ChatCompletionRequest, *args, **kwargs):
        super().__init__(tokenizer, body, *args, **kwargs)
        self.tool_calls: dict[int, ChoiceToolCalls] = {}
        for c in self.choices:
            if (calls := choice_tool_calls(body, tokenizer)) is not None:
                self.tool_calls[c.index] = calls
        self.reasoning = chat_reasoning(tokenizer, body, self.choices[0].prompt_ids)
        fmt = next(iter(self.tool_calls.values())).fmt if self.tool_calls else None
        tags = (self.reasoning.fmt.start, self.reasoning.fmt.end) if self.reasoning else ()
        markers = skipped_markers(tokenizer, (fmt.markers if fmt is not None else ()) + tags)
        if markers:
            self.streams = [MarkerKeepingStream(s, tokenizer, markers) for s in self.streams]

    async def chunks(self) -> AsyncIterator[WireModel]:
        async with contextlib.aclosing(super().chunks()) as chunks:
            async for item in chunks:
                if isinstance(item, ChunkSequence):
                    for c in item.chunks:
                        yield c
                else:
                    yield item

    def _logprobs(self, entries: list[dict]) -> ChatLogprobs:
        return chat_logprobs(self.tokenizer, entries, self.body.return_tokens_as_token_ids)

    def _chunk(self, rows: list[ChatChunkChoice], **usage) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model, choices=rows, **usage
        )

    def opening_chunks(self) -> list[ChatCompletionChunk]:
        opening = ChatDelta(role="assistant", content="")
        return [
            self._chunk(
                [ChatChunkChoice(index=c.index, delta=opening, logprobs=None, finish_reason=None)]
            )
            for c in self.choices
        ]

    def chunk(self, choice: Choice, chunk: GenerationChunk) -> WireModel:
        reasoning = ""
        if self.reasoning is not None:  # the thinking apart; the rest goes on as content
            final = chunk.finish_reason is not None
            reasoning, text = self.reasoning.feed(choice.index, chunk.text, final)
            if not (reasoning or text or final or chunk.logprobs):
                return ChunkSequence(chunks=[])  # all held back (a tag may be arriving)
            chunk = dataclasses.replace(chunk, text=text)
        thinking = self.reasoning.fields(reasoning) if self.reasoning is not None else {}
        calls = self.tool_calls.get(choice.index)
        if calls is not None:
            return self._tool_chunks(choice, chunk, calls, thinking)
        has_text = chunk.text or (chunk.finish_reason is None and not thinking)
        row = ChatChunkChoice(
            index=choice.index,
            delta=ChatDelta(content=chunk.text if has_text else None, **thinking),
            logprobs=self._logprobs(chunk.logprobs)
            if self.wants_logprobs and chunk.logprobs
            else None,
            finish_reason=chunk.finish_reason,
        )
        return self._chunk([row])

    def _tool_chunks(
        self, choice: Choice, chunk: GenerationChunk, calls: ChoiceToolCalls, thinking: dict
    ) -> ChunkSequence:
        """Text held back while it may open a call; a call's opening and its arguments as
        deltas of their own. Logprobs go with the first chunk, the finish reason with the
        last."""
        reason = chunk.finish_reason
        deltas = calls.feed(chunk.text) + (calls.finish() if reason is not None else [])
        if thinking:  # the parser sees only the content: the thinking goes first, apart
            deltas.insert(0, ChatDelta(**thinking))
        logprobs = (
            self._logprobs(chunk.logprobs) if self.wants_logprobs and chunk.logprobs else None
        )
        if not deltas and (reason is not None or logprobs is not None):
            deltas = [ChatDelta()]
        rows = [
            ChatChunkChoice(index=choice.index, delta=d, logprobs=None, finish_reason=None)
            for d in deltas
        ]
        if rows:
            rows[0].logprobs = logprobs
            if reason is not None:
                rows[-1].finish_reason = calls.stream_finish_reason(reason)
        return ChunkSequence(chunks=[self._chunk([r]) for r in rows])

    def usage(self) -> Usage:
        usage = super().usage()
        if self.reasoning is not None:
            count = sum(self.reasoning.tokens("".join(c.text), c.token_ids) for c in self.choices)
            usage.completion_tokens_details = CompletionTokensDetails(reasoning_tokens=count)
        return usage

    def usage_chunk(self) -> ChatCompletionChunk:
        return self._chunk([], usage=self.usage())

    def response(self) -> ChatCompletion:
        rows = [self._choice(c) for c in self.choices]
        return ChatCompletion(
            id=self.id, created=self.created, model=self.model, choices=rows, usage=self.usage()
        )

    def _choice(self, c: Choice) -> ChatChoice:
        text, reason, reasoning = "".join(c.text), c.finish_reason, None
        if self.reasoning is not None:  # tool calls are read from the content alone
            reasoning, text = self.reasoning.split(text)
        calls = self.tool_calls.get(c.index)
        if calls is not None and reason is not None:
            message, reason = calls.message(text, reason)
        else:
            message = AssistantMessage(content=text)
        if self.reasoning is not None:
            message = message.model_copy(update=self.reasoning.fields(reasoning))
        return ChatChoice(
            index=c.index,
            message=message,
            logprobs=self._logprobs(c.logprobs) if self.wants_logprobs else None,
            finish_reason=reason,
        )
