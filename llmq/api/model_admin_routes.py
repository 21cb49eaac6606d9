"""POST /models/load and /models/unload (llama.cpp's router mode's routes): a catalogue model
loaded by a worker with room, or unloaded from every worker holding it, by hand."""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import BaseModel

from llmq.common.catalogue import keep_alive_seconds
from llmq.common.errors import InvalidRequest, ModelNotFound

router = APIRouter()


class ModelAction(BaseModel):
    model: str
    keep_alive: str | float | None = None  # load: as Ollama's (default LLMQ_KEEP_ALIVE)


async def _catalogue_name(request: Request, name: str) -> str:
    catalogue = await request.app.state.registry.on_demand.catalogue()
    name = name.removesuffix(":latest")
    if name not in catalogue:
        raise ModelNotFound(
            f"the model {name!r} is not in the catalogue (LLMQ_CATALOGUE); see /v1/models",
            "model",
        )
    return name


@router.post("/models/load")
async def load(body: ModelAction, request: Request) -> dict:
    """Answers once a worker serves the model (it may have been loaded already)."""
    name = await _catalogue_name(request, body.model)
    try:
        keep = keep_alive_seconds(body.keep_alive, None)  # type: ignore[arg-type]
    except ValueError as exc:
        raise InvalidRequest(str(exc), "keep_alive") from None
    _, engine = await request.app.state.registry.get(name, ("generate", "embed", "score"), keep)
    return {"model": engine.model, "state": "ready"}


@router.post("/models/unload")
async def unload(body: ModelAction, request: Request) -> dict:
    """Asked of the workers holding it: each unloads it once its requests are done."""
    name = await _catalogue_name(request, body.model)
    await request.app.state.registry.on_demand.unload(name)
    return {"model": name, "state": "unloading"}
