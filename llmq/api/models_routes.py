"""GET /v1/models and /v1/models/{id}: the models live workers serve."""

from __future__ import annotations

from fastapi import APIRouter, Request

router = APIRouter()


@router.get("/v1/models")
async def list_models(request: Request) -> dict:
    return (await request.app.state.service.models()).model_dump()


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request) -> dict:
    return (await request.app.state.service.model(model_id)).model_dump()
