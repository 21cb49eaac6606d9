"""Anthropic's Messages API: POST /v1/messages (answered whole or as Anthropic's SSE events)
and POST /v1/messages/count_tokens. Auth as on every route (``x-api-key`` or a bearer key);
``anthropic-version`` and ``anthropic-beta`` headers are accepted and not needed. Errors on
these paths leave in Anthropic's shape."""

from __future__ import annotations

from fastapi import APIRouter, Request

from llmq.api.errors import register_error_shape
from llmq.api.streaming import typed_events, whole_answer
from llmq.common.generation.messages_api.errors import error_body
from llmq.common.generation.messages_api.request import MessagesPrompt, MessagesRequest

router = APIRouter()
register_error_shape("/v1/messages", error_body)


@router.post("/v1/messages")
async def create_message(body: MessagesRequest, request: Request):
    run = await request.app.state.service.messages(body)
    if body.stream:
        return typed_events(run, run.events())
    return await whole_answer(request, run)


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: MessagesPrompt, request: Request) -> dict:
    return (await request.app.state.service.count_message_tokens(body)).model_dump()
