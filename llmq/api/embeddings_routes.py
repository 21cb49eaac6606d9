"""POST /v1/embeddings: validate, call the generation service, answer OpenAI's list."""

from __future__ import annotations

from fastapi import APIRouter, Request

from llmq.common.serving.request_bodies import EmbeddingRequest

router = APIRouter()


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request) -> dict:
    return (await request.app.state.service.embeddings(body)).model_dump()
