"""A Responses request as a chat request, and the chat answer as the response object."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from llmq.common.serving.chat_request import ChatCompletionRequest
from llmq.common.serving.responses import ChatCompletion, Usage
from llmq.common.serving.responses_api.items import chat_messages, input_items
from llmq.common.serving.responses_api.objects import (
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    OutputItem,
    OutputMessage,
    OutputText,
    OutputTokensDetails,
    ResponseObject,
    ResponseUsage,
    new_item_id,
)
from llmq.common.serving.responses_api.request import ResponsesRequest
from llmq.common.validation import validation_error


def _tool_fields(body: ResponsesRequest) -> dict[str, Any]:
    if not body.functions():
        return {}
    choice = body.tool_choice
    if not isinstance(choice, str):
        choice = {"type": "function", "function": {"name": choice.name}}
    tools = [t.chat_tool() for t in body.functions()]
    return {"tools": tools, "tool_choice": choice, "parallel_tool_calls": body.parallel_tool_calls}


def chat_request(body: ResponsesRequest, history: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request generating ``body``'s answer, after ``history`` (the items of the
    responses before it)."""
    messages = chat_messages(history + input_items(body.input))
    if body.instructions:
        messages.insert(0, {"role": "system", "content": body.instructions})
    fields: dict[str, Any] = {"model": body.model, "messages": messages, "stream": body.stream}
    if body.stream:
        fields["stream_options"] = {"include_usage": True}
    optional = {
        "temperature": body.temperature,
        "top_p": body.top_p,
        "max_completion_tokens": body.max_output_tokens,
        "user": body.user,
        "speculative": body.speculative,
    }
    fields |= {k: v for k, v in optional.items() if v is not None}
    fields |= _tool_fields(body)
    # A forced call is the constrained output of its turn: text.format is for text, which a
    # forced turn does not give (OpenAI takes both; chat refuses response_format beside it).
    forced = body.functions() and body.tool_choice != "auto" and body.tool_choice != "none"
    if body.text is not None and body.text.format.type != "text" and not forced:
        try:
            fields["response_format"] = body.text.format.response_format()
        except ValueError as exc:
            raise validation_error([{"loc": ("text", "format"), "msg": str(exc)}]) from None
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        raise validation_error(list(exc.errors())) from None


def echoed_fields(body: ResponsesRequest) -> dict[str, Any]:
    """The request's fields the response object repeats, as OpenAI's does."""
    text = body.text.model_dump(by_alias=True, exclude_none=True) if body.text else None
    return {
        "background": False,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "metadata": body.metadata or {},
        "parallel_tool_calls": body.parallel_tool_calls,
        "previous_response_id": body.previous_response_id,
        "reasoning": {"effort": None, "summary": None},
        "store": body.store,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "text": text or {"format": {"type": "text"}},
        "tool_choice": body.tool_choice
        if isinstance(body.tool_choice, str)
        else body.tool_choice.model_dump(),
        "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "truncation": "disabled",
        "user": body.user,
        "speculative": body.speculative,
    }


def response_usage(usage: Usage) -> ResponseUsage:
    details = usage.prompt_tokens_details
    return ResponseUsage(
        input_tokens=usage.prompt_tokens,
        input_tokens_details=InputTokensDetails(
            cached_tokens=details.cached_tokens if details else 0
        ),
        output_tokens=usage.completion_tokens,
        output_tokens_details=OutputTokensDetails(),
        total_tokens=usage.total_tokens,
    )


def finish(response: ResponseObject, finish_reason: str | None, usage: Usage | None) -> None:
    """The response's final status (incomplete: cut off at max_output_tokens) and usage."""
    if finish_reason == "length":
        response.status = "incomplete"
        response.incomplete_details = IncompleteDetails(reason="max_output_tokens")
    else:
        response.status = "completed"
    response.usage = response_usage(usage) if usage is not None else None


def fill(
    response: ResponseObject, completion: ChatCompletion, namespaces: dict[str, str]
) -> ResponseObject:
    """``response`` answered by the chat ``completion`` of its one choice, item for item as its
    events answer it: the text's message (an empty one when there is neither text nor a
    call), then each call; every item completed but the last, which is incomplete when
    max_output_tokens cut it (a call then with its arguments as far as they got). A call of
    a namespaced function names its namespace (``namespaces``, by function name)."""
    choice = completion.choices[0]
    message = choice.message
    output: list[OutputItem] = []
    if message.content or not message.tool_calls:
        text = OutputText(text=message.content or "")
        output.append(OutputMessage(id=new_item_id("msg"), status="completed", content=[text]))
    for call in message.tool_calls or []:
        fn = call.function
        output.append(
            FunctionCallItem(
                id=new_item_id("fc"),
                call_id=call.id,
                name=fn.name,
                namespace=namespaces.get(fn.name),
                arguments=fn.arguments,
                status="completed",
            )
        )
    if choice.finish_reason == "length":
        output[-1].status = "incomplete"
    response.output = output
    finish(response, choice.finish_reason, completion.usage)
    return response
