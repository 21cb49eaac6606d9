"""POST /v1/chat/completions and /v1/completions: validate, call the generation service, answer
whole or as Server-Sent Events."""

from __future__ import annotations

from fastapi import APIRouter, Request

from llmq.api.streaming import streamed_answer, whole_answer
from llmq.common.serving import Generation
from llmq.common.serving.chat_request import ChatCompletionRequest
from llmq.common.serving.request_bodies import CompletionRequest

router = APIRouter()


async def _respond(request: Request, generation: Generation, stream: bool):
    if stream:
        return streamed_answer(generation)
    return await whole_answer(request, generation)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    generation = await request.app.state.service.chat(body)
    return await _respond(request, generation, body.stream)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    generation = await request.app.state.service.completions(body)
    return await _respond(request, generation, body.stream)
