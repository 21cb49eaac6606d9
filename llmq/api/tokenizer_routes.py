"""POST /tokenize, POST /detokenize, GET /tokenizer_info: vLLM's tokenizer endpoints (at the
root, as vLLM serves them), thin over the generation service."""

from __future__ import annotations

from fastapi import APIRouter, Request

from llmq.common.serving.tokenization import DetokenizeRequest, TokenizeRequest

router = APIRouter()


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict:
    return (await request.app.state.service.tokenize(body)).model_dump()


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
    return (await request.app.state.service.detokenize(body)).model_dump()


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request, model: str | None = None) -> dict:
    return await request.app.state.service.tokenizer_info(model)
