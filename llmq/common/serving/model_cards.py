"""The models of /v1/models: what live workers serve, one card per model, and one per LoRA
adapter of a served model (``parent``: its base); then those workers are still loading
(``state: "loading"``)."""

from __future__ import annotations

from llmq.common.engine_status import EngineStatus
from llmq.common.errors import ModelNotFound
from llmq.common.lora_adapters import AdapterRecord
from llmq.common.model_ids import resolve_alias
from llmq.common.serving.responses import ModelCard, ModelList


def model_card(e: EngineStatus) -> ModelCard:
    return ModelCard(
        id=e.model,
        created=int(e.started),
        root=e.source or e.model,
        max_model_len=e.max_model_len,
        kind=e.kind,
        random_weights=True if e.random_weights else None,
        images=True if e.images else None,
    )


def live_models(
    engines: list[EngineStatus], adapters: dict[str, AdapterRecord] | None = None
) -> dict[str, ModelCard]:
    """A card per served model, created when its first live worker started; then a card per
    adapter whose base is served."""
    models: dict[str, ModelCard] = {}
    for e in engines:
        card = models.get(e.model)
        if card is None:
            models[e.model] = model_card(e)
        else:
            card.created = min(card.created, int(e.started))
    for a in (adapters or {}).values():
        base = models.get(a.base)
        if base is not None and base.kind == "generate" and a.name not in models:
            models[a.name] = ModelCard(
                id=a.name,
                created=a.created or base.created,
                root=a.path,
                parent=a.base,
                max_model_len=base.max_model_len,
                kind=base.kind,
            )
    return models


def model_list(
    engines: list[EngineStatus], adapters: dict[str, AdapterRecord] | None = None
) -> ModelList:
    models = live_models(engines, adapters)
    return ModelList(data=sorted(models.values(), key=lambda m: m.id))


def loading_card(record: dict) -> ModelCard:
    """A model a worker is loading (a ``ModelRegistry.loading`` record)."""
    return ModelCard(
        id=record["model"], created=int(record["since"]), root=record["source"], state="loading"
    )


def loading_card_named(name: str, loading: list[dict]) -> ModelCard | None:
    """The card of the loading model ``name`` names (its served name, short id or source)."""
    records = {r["model"]: r for r in loading}
    meant = name if name in records else resolve_alias(name, records)
    return loading_card(records[meant]) if meant is not None else None


def with_loading(listed: ModelList, loading: list[dict]) -> ModelList:
    """``listed`` and a card for each loading model it does not list."""
    served = {m.id for m in listed.data}
    cards = [loading_card(r) for r in loading if r["model"] not in served]
    return ModelList(data=sorted([*listed.data, *cards], key=lambda m: m.id))


def find_model(
    engines: list[EngineStatus], model_id: str, adapters: dict[str, AdapterRecord] | None = None
) -> ModelCard:
    models = live_models(engines, adapters)
    known = {card.id: {"source": card.root} for card in models.values() if card.parent is None}
    model_id = model_id if model_id in models else resolve_alias(model_id, known) or model_id
    if model_id not in models:
        raise ModelNotFound(f"the model {model_id!r} is not served right now", "model")
    return models[model_id]
