"""The Responses API's objects, typed: the response, its output items (a message of
``output_text`` parts, function calls) and its usage."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import SerializerFunctionWrapHandler, model_serializer

from llmq.common.serving.responses import WireModel

Status = Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputText(WireModel):
    type: str = "output_text"
    text: str
    annotations: list[Any] = []
    logprobs: list[Any] = []


class OutputMessage(WireModel):
    id: str
    type: str = "message"
    role: str = "assistant"
    status: Status
    content: list[OutputText]


class FunctionCallItem(WireModel):
    omit_if_none = frozenset({"namespace"})

    id: str
    type: str = "function_call"
    call_id: str
    name: str
    namespace: str | None = None  # the namespace tool the function belongs to
    arguments: str
    status: Status


OutputItem = OutputMessage | FunctionCallItem


class InputTokensDetails(WireModel):
    cached_tokens: int = 0


class OutputTokensDetails(WireModel):
    reasoning_tokens: int = 0


class ResponseUsage(WireModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(WireModel):
    reason: str


class ResponseError(WireModel):
    code: str
    message: str


class ResponseObject(WireModel):
    """``echo`` holds the request's fields the response repeats (see answer.echoed_fields)."""

    id: str
    object: str = "response"
    created_at: int
    status: Status
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    model: str
    output: list[OutputItem] = []
    usage: ResponseUsage | None = None
    echo: dict[str, Any] = {}

    @model_serializer(mode="wrap")
    def _omit(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        echo = data.pop("echo")
        return {**data, **echo}  # the echoed fields beside the others


def new_response(model: str, echo: dict[str, Any]) -> ResponseObject:
    return ResponseObject(
        id=new_item_id("resp"),
        created_at=int(time.time()),
        status="in_progress",
        model=model,
        echo=echo,
    )
