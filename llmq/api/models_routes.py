"""GET /v1/models and /v1/models/{id}: the models live workers serve, and those workers are
loading."""

from __future__ import annotations

from fastapi import APIRouter, Request

from llmq.common.errors import ModelNotFound
from llmq.common.generation.model_cards import loading_card_named, with_loading

router = APIRouter()


@router.get("/v1/models")
async def list_models(request: Request) -> dict:
    service = request.app.state.service
    loading = await service.registry.loading()
    return with_loading(await service.models(), loading).model_dump()


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request) -> dict:
    service = request.app.state.service
    try:
        return (await service.model(model_id)).model_dump()
    except ModelNotFound:
        card = loading_card_named(model_id, await service.registry.loading())
        if card is None:
            raise
        return card.model_dump()
