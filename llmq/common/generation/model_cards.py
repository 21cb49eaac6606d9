"""The models of /v1/models: what live workers serve, one card per model."""

from __future__ import annotations

from llmq.common.engine_status import EngineStatus
from llmq.common.errors import ModelNotFound
from llmq.common.generation.responses import ModelCard, ModelList


def model_card(e: EngineStatus) -> ModelCard:
    return ModelCard(
        id=e.model,
        created=int(e.started),
        root=e.source or e.model,
        max_model_len=e.max_model_len,
        kind=e.kind,
        random_weights=True if e.random_weights else None,
    )


def live_models(engines: list[EngineStatus]) -> dict[str, ModelCard]:
    """A card per served model; created when its first live worker started."""
    models: dict[str, ModelCard] = {}
    for e in engines:
        card = models.get(e.model)
        if card is None:
            models[e.model] = model_card(e)
        else:
            card.created = min(card.created, int(e.started))
    return models


def model_list(engines: list[EngineStatus]) -> ModelList:
    models = live_models(engines)
    return ModelList(data=sorted(models.values(), key=lambda m: m.id))


def find_model(engines: list[EngineStatus], model_id: str) -> ModelCard:
    models = live_models(engines)
    if model_id not in models:
        raise ModelNotFound(f"the model {model_id!r} is not served right now", "model")
    return models[model_id]
