"""POST /v1/rerank (also /rerank and /v2/rerank, as vLLM serves it) and /v1/score (also
/score): validate, call the generation service, answer vLLM's shapes."""

from __future__ import annotations

from fastapi import APIRouter, Request

from llmq.common.serving.rerank import RerankRequest, ScoreRequest

router = APIRouter()


@router.post("/v1/rerank")
async def rerank(body: RerankRequest, request: Request) -> dict:
    return (await request.app.state.service.rerank(body)).model_dump()


@router.post("/v1/score")
async def score(body: ScoreRequest, request: Request) -> dict:
    return (await request.app.state.service.score(body)).model_dump()


# The paths vLLM also answers, out of the OpenAPI schema (the same routes).
for path in ("/rerank", "/v2/rerank"):
    router.add_api_route(path, rerank, methods=["POST"], include_in_schema=False)
router.add_api_route("/score", score, methods=["POST"], include_in_schema=False)
