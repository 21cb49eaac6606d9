"""GET /v1/models and /v1/models/{id}: the models live workers serve, those workers are
loading, and the catalogue's (``state``: ready, loading, sleeping or available; ``workers``
holding it, or with it asleep)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from llmq.common.catalogue import holders, sleepers, state_of
from llmq.common.errors import ModelNotFound
from llmq.common.on_demand import OnDemand
from llmq.common.serving.model_cards import loading_card_named, with_loading
from llmq.common.serving.responses import ModelCard, ModelList

router = APIRouter()


@router.get("/v1/models")
async def list_models(request: Request) -> dict:
    service = request.app.state.service
    loading = await service.registry.loading()
    listed = with_loading(await service.models(), loading)
    return (await catalogue_cards(service.registry.on_demand, listed, loading)).model_dump()


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request) -> dict:
    service = request.app.state.service
    try:
        return (await service.model(model_id)).model_dump()
    except ModelNotFound:
        loading = await service.registry.loading()
        card = loading_card_named(model_id, loading)
        if card is None:  # a catalogue model no worker holds
            listed = await catalogue_cards(service.registry.on_demand, ModelList(data=[]), loading)
            card = next((c for c in listed.data if c.id == model_id.removesuffix(":latest")), None)
        if card is None:
            raise
        return card.model_dump()


async def catalogue_cards(on_demand: OnDemand, listed: ModelList, loading: list[dict]) -> ModelList:
    """``listed`` with each catalogue model's card: ``workers`` holding it, or its state
    (loading, available) where none does."""
    catalogue = await on_demand.catalogue()
    if not catalogue:
        return listed
    residents = await on_demand.residents()
    cards = {c.id: c for c in listed.data}
    for card in cards.values():
        if card.id in catalogue and card.state == "ready":
            card.workers = holders(residents, card.id)
    loading_names = {r["model"] for r in loading}
    for name, entry in catalogue.items():
        if name not in cards:
            state = state_of(residents, name, name in loading_names)
            card = ModelCard(id=name, created=0, root=entry["source"], state=state)
            if state == "sleeping":
                card.workers = sleepers(residents, name)
            cards[name] = card
    return ModelList(data=sorted(cards.values(), key=lambda m: m.id))
