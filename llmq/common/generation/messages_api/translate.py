"""A Messages request as the chat request that generates its answer, and the prompt's token
count (count_tokens) rendered exactly as that chat request renders it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from pydantic import ValidationError

from llmq.common.errors import InvalidRequest
from llmq.common.generation.chat_request import ChatCompletionRequest
from llmq.common.generation.messages_api.conversation import chat_messages, is_prefill
from llmq.common.generation.messages_api.request import (
    EFFORTS,
    MessagesPrompt,
    MessagesRequest,
    ThinkingDisabled,
    ThinkingEnabled,
)
from llmq.common.generation.messages_api.tools import chat_tool_choice
from llmq.common.generation.reasoning import reasoning_template_kwargs
from llmq.common.pipeline import TokenGeneratorPipeline
from llmq.common.validation import validation_error


def _prompt_fields(body: MessagesPrompt) -> dict[str, Any]:
    """The chat fields that render the prompt (messages, tools, template variables)."""
    fields: dict[str, Any] = {"model": body.model, "messages": chat_messages(body)}
    if is_prefill(body):  # the answer continues the last assistant turn, as Anthropic's
        fields |= {"add_generation_prompt": False, "continue_final_message": True}
    if body.tools:
        fields["tools"] = [t.chat_tool() for t in body.tools]
        choice = body.tool_choice
        if choice is not None:
            fields["tool_choice"] = chat_tool_choice(choice)
            fields["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    if body.thinking is not None:
        # Templates with the knob (Qwen3's) think or not as asked; others ignore it.
        thinks = not isinstance(body.thinking, ThinkingDisabled)
        fields["chat_template_kwargs"] = {"enable_thinking": thinks}
        display = getattr(body.thinking, "display", None)
        fields["include_reasoning"] = thinks and display != "omitted"
        if isinstance(body.thinking, ThinkingEnabled):
            fields["thinking_budget"] = body.thinking.budget_tokens
    config = body.output_config
    if config is not None and config.effort is not None:
        fields["reasoning_effort"] = EFFORTS[config.effort]
    return fields


def _answer_fields(body: MessagesRequest) -> dict[str, Any]:
    fields: dict[str, Any] = {"max_tokens": body.max_tokens, "stream": body.stream}
    if body.stream:
        fields["stream_options"] = {"include_usage": True}
    optional = {
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "stop": body.stop_sequences,
        "user": body.user(),
    }
    fields |= {k: v for k, v in optional.items() if v is not None}
    config = body.output_config
    # A forced call is the constrained output of its turn: the format is for a text answer,
    # which a forced turn does not give (chat refuses the two together).
    if config is not None and config.format is not None and not body.forced_call():
        schema = {"name": "output", "schema": config.format.json_schema, "strict": True}
        fields["response_format"] = {"type": "json_schema", "json_schema": schema}
    return fields


def chat_request(body: MessagesPrompt) -> ChatCompletionRequest:
    """The chat request of ``body`` (a count_tokens body: its prompt alone)."""
    fields = _prompt_fields(body)
    if isinstance(body, MessagesRequest):
        fields |= _answer_fields(body)
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        raise validation_error(list(exc.errors())) from None


@contextlib.contextmanager
def effort_named() -> Iterator[None]:
    """chat's 400 for a reasoning_effort the model's template lacks, naming the Messages
    field that asked for it."""
    try:
        yield
    except InvalidRequest as exc:
        if exc.param != "reasoning_effort":
            raise
        raise InvalidRequest(
            "output_config.effort is not supported by this model: its chat template has no "
            "reasoning_effort variable",
            "output_config.effort",
        ) from None


async def prompt_tokens(pipeline: TokenGeneratorPipeline, body: MessagesPrompt) -> int:
    """The prompt's token count, rendered as the chat generation of ``body`` renders it."""
    chat = chat_request(body)
    template = getattr(pipeline.tokenizer, "chat_template", None)
    with effort_named():
        effort = reasoning_template_kwargs(chat.reasoning_effort, template)
    ids = await pipeline.encode_chat(
        chat.template_messages(),
        tools=chat.template_tools(),
        **{**chat.template_kwargs(), **effort},
    )
    return len(ids)
