"""Anthropic's Messages API: POST /v1/messages (answered whole or as Anthropic's SSE events)
and POST /v1/messages/count_tokens. Auth as on every route (``x-api-key`` or a bearer key);
``anthropic-version`` and ``anthropic-beta`` headers are accepted and not needed. Errors on
these paths leave in Anthropic's shape. An ``output_config.effort`` that the model's chat
template cannot take is named in the answer's ``llmq-effort-ignored`` header."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from llmq.api.errors import register_error_shape
from llmq.api.streaming import typed_events, whole_answer
from llmq.common.serving.messages_api.errors import error_body
from llmq.common.serving.messages_api.request import MessagesPrompt, MessagesRequest
from llmq.common.serving.messages_api.translate import EFFORT_HEADER

router = APIRouter()
register_error_shape("/v1/messages", error_body)


@router.post("/v1/messages")
async def create_message(body: MessagesRequest, request: Request, response: Response):
    run = await request.app.state.service.messages(body)
    headers = {EFFORT_HEADER: run.ignored_effort} if run.ignored_effort else {}
    if body.stream:
        streamed = typed_events(run, run.events())
        streamed.headers.update(headers)
        return streamed
    response.headers.update(headers)
    return await whole_answer(request, run)


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: MessagesPrompt, request: Request) -> dict:
    return (await request.app.state.service.count_message_tokens(body)).model_dump()
