"""GET /v1/models and /v1/models/{id}: the models live workers serve, those workers are
loading, and the catalogue's (``state``: ready, loading or available; ``workers`` holding it)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from llmq.common.errors import ModelNotFound
from llmq.common.generation.model_cards import loading_card_named, with_loading
from llmq.common.generation.responses import ModelList

router = APIRouter()


@router.get("/v1/models")
async def list_models(request: Request) -> dict:
    service = request.app.state.service
    loading = await service.registry.loading()
    listed = with_loading(await service.models(), loading)
    return (await service.registry.on_demand.cards(listed, loading)).model_dump()


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request) -> dict:
    service = request.app.state.service
    try:
        return (await service.model(model_id)).model_dump()
    except ModelNotFound:
        loading = await service.registry.loading()
        card = loading_card_named(model_id, loading)
        if card is None:  # a catalogue model no worker holds
            listed = await service.registry.on_demand.cards(ModelList(data=[]), loading)
            card = next((c for c in listed.data if c.id == model_id.removesuffix(":latest")), None)
        if card is None:
            raise
        return card.model_dump()
