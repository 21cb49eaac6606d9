"""Ollama's chat and generate bodies as the chat and completion requests that answer them:
messages (tool calls' arguments as JSON text), options as sampling fields, ``format`` as a
response format, ``think`` as the chat template's thinking switch or reasoning effort. A
generate prompt is rendered by the chat template as one user turn (after ``system``), as Ollama
renders it with the model's template; ``raw`` sends it as it is, a completion."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ValidationError

from llmq.common.errors import InvalidRequest
from llmq.common.serving.chat_request import ChatCompletionRequest
from llmq.common.serving.ollama_api.options import sampling_fields
from llmq.common.serving.ollama_api.request import (
    ChatBody,
    Format,
    GenerateBody,
    GenerationBody,
    OllamaMessage,
)
from llmq.common.serving.request_bodies import CompletionRequest
from llmq.common.validation import validation_error


def format_fields(fmt: Format | None) -> dict[str, Any]:
    """``format`` as the response format asking for it: any JSON object, or JSON valid under
    the schema."""
    if fmt is None or fmt == "":
        return {}
    if fmt == "json":
        return {"response_format": {"type": "json_object"}}
    spec = {"name": "format", "schema": fmt, "strict": True}
    return {"response_format": {"type": "json_schema", "json_schema": spec}}


def think_fields(body: GenerationBody, reasons: bool) -> dict[str, Any]:
    """``think``: true or false switches the chat template's thinking (Qwen3's
    ``enable_thinking``); a level is the template's ``reasoning_effort``. A model with no
    reasoning parser cannot think apart: true or a level is a 400, as Ollama answers it."""
    think = body.think
    if think is None:
        return {}
    if think is not False and not reasons:
        raise InvalidRequest(f"{body.model!r} does not support thinking", "think")
    if isinstance(think, str):
        return {"reasoning_effort": think}
    return {"chat_template_kwargs": {"enable_thinking": think}}


def _call_dict(message_index: int, i: int, call) -> dict[str, Any]:
    function = {"name": call.function.name, "arguments": json.dumps(call.function.arguments)}
    return {"id": call.id or f"call_{message_index}_{i}", "type": "function", "function": function}


def with_images(text: str | None, images: list[str] | None) -> str | list[dict[str, Any]]:
    """Content of text, or of text then the images (Ollama's base64 without a media type: the
    bytes say their format)."""
    if not images:
        return text or ""
    parts = [
        {"type": "image_url", "image_url": {"url": f"data:image/*;base64,{b64}"}} for b64 in images
    ]
    return ([{"type": "text", "text": text}] if text else []) + parts


def chat_messages(messages: list[OllamaMessage]) -> list[dict[str, Any]]:
    """Ollama's messages as chat messages (an earlier turn's thinking left out, as chat
    templates drop it)."""
    out: list[dict[str, Any]] = []
    for n, m in enumerate(messages):
        message: dict[str, Any] = {"role": m.role, "content": with_images(m.content, m.images)}
        if m.tool_calls:
            message["tool_calls"] = [_call_dict(n, i, c) for i, c in enumerate(m.tool_calls)]
        if m.role == "tool" and m.tool_name:
            message["name"] = m.tool_name
        out.append(message)
    return out


def _common_fields(body: GenerationBody) -> dict[str, Any]:
    try:
        sampling = sampling_fields(body.options)
    except ValueError as exc:
        raise InvalidRequest(str(exc), "options") from None
    fields: dict[str, Any] = {"model": body.model, "stream": body.stream, **sampling}
    if body.stream:
        fields["stream_options"] = {"include_usage": True}
    return fields | format_fields(body.format)


def _validated(kind: type[BaseModel], fields: dict[str, Any]) -> Any:
    try:
        return kind.model_validate(fields)
    except ValidationError as exc:
        raise validation_error(list(exc.errors())) from None


def chat_request(body: ChatBody, reasons: bool) -> ChatCompletionRequest:
    """The chat request answering an /api/chat body (``reasons``: the model has a reasoning
    parser)."""
    fields = _common_fields(body) | think_fields(body, reasons)
    fields["messages"] = chat_messages(body.messages)
    if body.tools:
        fields["tools"] = [t.model_dump(exclude_none=True) for t in body.tools]
    return _validated(ChatCompletionRequest, fields)


def generate_request(
    body: GenerateBody, reasons: bool
) -> ChatCompletionRequest | CompletionRequest:
    """The request answering an /api/generate body: a chat request of one user turn, or with
    ``raw`` a completion of the prompt as it is."""
    fields = _common_fields(body)
    if body.raw:
        if body.system:
            raise InvalidRequest(
                "system is not used with raw: true; put it in the prompt", "system"
            )
        if body.think:
            raise InvalidRequest("think needs the chat template: not with raw: true", "think")
        if body.images:
            raise InvalidRequest("images need the chat template: not with raw: true", "images")
        # Unset num_predict: up to the context (completions' own default is 16 tokens).
        fields = {"max_tokens": None} | fields | {"prompt": body.prompt}
        return _validated(CompletionRequest, fields)
    messages = [{"role": "user", "content": with_images(body.prompt, body.images)}]
    if body.system:
        messages.insert(0, {"role": "system", "content": body.system})
    fields |= think_fields(body, reasons) | {"messages": messages}
    return _validated(ChatCompletionRequest, fields)
