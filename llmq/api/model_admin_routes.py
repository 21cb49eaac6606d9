"""POST /models/load and /models/unload (llama.cpp's router mode's routes): a catalogue model
loaded by a worker with room, or unloaded from every worker holding it, by hand; and vLLM's
sleep mode per model: POST /models/sleep and /models/wake_up, GET /models/is_sleeping."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from pydantic import BaseModel

from llmq.common.catalogue import decode, keep_alive_seconds, state_of
from llmq.common.engine_client.deadline import current_deadline
from llmq.common.errors import InvalidRequest, ModelNotFound
from llmq.common.on_demand import POLL_S, OnDemand

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


@router.post("/models/sleep")
async def sleep(body: ModelAction, request: Request) -> dict:
    """vLLM's /sleep, per model: each worker holding it stops its engine and gives its memory
    back once its requests are done, keeping its place. Answers once no worker holds it awake
    and no engine of it is listed (so a listing right after shows it sleeping)."""
    name = await _catalogue_name(request, body.model)
    on_demand = request.app.state.registry.on_demand
    await on_demand.sleep(name)
    deadline = current_deadline(request.app.state.settings.request_timeout)
    while await on_demand.awake(name) or await _listed(request, name):
        if deadline.passed():
            raise deadline.exceeded(f"{name!r} is still running requests")
        await asyncio.sleep(POLL_S)
    return {"model": name, "state": await _state(on_demand, name)}


async def _listed(request: Request, name: str) -> bool:
    """Whether a live engine of ``name`` is still listed (its heartbeat not yet withdrawn)."""
    try:
        await request.app.state.service.model(name)
    except ModelNotFound:
        return False
    return True


@router.post("/models/wake_up")
async def wake_up(body: ModelAction, request: Request) -> dict:
    """vLLM's /wake_up, per model: a load, by the worker that has it asleep where one does."""
    return await load(body, request)


@router.get("/models/is_sleeping")
async def is_sleeping(model: str, request: Request) -> dict:
    """vLLM's /is_sleeping, per model: asleep on a worker and awake on none."""
    name = await _catalogue_name(request, model)
    state = await _state(request.app.state.registry.on_demand, name)
    return {"model": name, "is_sleeping": state == "sleeping", "state": state}


async def _state(on_demand: OnDemand, name: str) -> str:
    loading = {r.get("model") for r in decode(await on_demand.r.hgetall(on_demand.keys.loading))}
    return state_of(await on_demand.residents(), name, name in loading)
