"""Ollama's API: /api/chat and /api/generate (NDJSON streams by default, or one object),
/api/embed and /api/embeddings, /api/tags, /api/show, /api/ps, /api/version. Errors leave in
Ollama's shape, {"error": "message"}. The routes that manage models (pull, push, create, copy,
delete, blobs) answer 403: the models are the operator's, loaded by the workers."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from llmq.api.errors import register_error_shape
from llmq.api.streaming import SHUTDOWN_DRAIN_S, whole_answer
from llmq.common.catalogue import expires_at
from llmq.common.errors import LLMQError, ServerShuttingDown
from llmq.common.serving.ollama_api.models import OLLAMA_VERSION, ModelDetails, TagModel
from llmq.common.serving.ollama_api.objects import rfc3339
from llmq.common.serving.ollama_api.request import (
    ChatBody,
    EmbedBody,
    GenerateBody,
    LegacyEmbeddingsBody,
    ShowBody,
)
from llmq.common.serving.ollama_api.run import OllamaRun
from llmq.common.serving.ollama_api.service import OllamaService
from llmq.common.serving.responses import WireModel

router = APIRouter()
register_error_shape("/api/", lambda error: {"error": error.message})


class ModelsAreTheOperators(LLMQError):
    """Forbidden rather than not implemented: which models run is the operator's choice (the
    workers' LLMQ_MODEL), never a client's."""

    status = 403
    type = "permission_error"
    code = "model_management_forbidden"


def _ollama(request: Request) -> OllamaService:
    return OllamaService(request.app.state.service)


async def _end_at_shutdown(began: asyncio.Event, run: OllamaRun) -> None:
    await began.wait()
    await asyncio.sleep(SHUTDOWN_DRAIN_S)
    run.fail(
        ServerShuttingDown(
            f"the server shut down before the answer was complete ({SHUTDOWN_DRAIN_S}s after "
            "shutdown began); retry on another replica"
        )
    )


def _ndjson(request: Request, run: OllamaRun) -> StreamingResponse:
    """The run's lines, one JSON object per line; at shutdown it gets SHUTDOWN_DRAIN_S to
    finish, then ends with an error line."""
    began: asyncio.Event = request.app.state.shutting_down

    async def lines():
        ender = asyncio.ensure_future(_end_at_shutdown(began, run))
        try:
            async with contextlib.aclosing(run.stream()) as stream:
                async for line in stream:
                    yield json.dumps(line, separators=(",", ":")) + "\n"
        finally:
            ender.cancel()
            await run.aclose()

    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(lines(), media_type="application/x-ndjson", headers=headers)


async def _respond(request: Request, answer: OllamaRun | WireModel, stream: bool):
    if not isinstance(answer, OllamaRun):  # nothing to generate: the model loaded
        return answer.model_dump()
    if stream:
        return _ndjson(request, answer)
    return await whole_answer(request, answer)


@router.post("/api/chat")
async def chat(body: ChatBody, request: Request):
    return await _respond(request, await _ollama(request).chat(body), body.stream)


@router.post("/api/generate")
async def generate(body: GenerateBody, request: Request):
    return await _respond(request, await _ollama(request).generate(body), body.stream)


@router.post("/api/embed")
async def embed(body: EmbedBody, request: Request) -> dict:
    return (await _ollama(request).embed(body)).model_dump()


@router.post("/api/embeddings", include_in_schema=False)
async def embeddings(body: LegacyEmbeddingsBody, request: Request) -> dict:
    return await _ollama(request).embeddings(body)


@router.get("/api/tags")
async def tags(request: Request) -> dict:
    """The served models, then those workers are loading (details not known yet): Ollama lists
    what it has, loaded or not, and a client that lists once at its start finds its model."""
    listed = await _ollama(request).tags()
    names = {m.name for m in listed.models}
    registry = request.app.state.registry
    for record in await registry.loading():
        if record["model"] not in names:
            listed.models.append(loading_tag(record))
            names.add(record["model"])
    for name, entry in (await registry.on_demand.catalogue()).items():
        if name not in names:  # Ollama lists every model it has, loaded or not
            listed.models.append(loading_tag({"model": name, "since": 0, **entry}))
    listed.models.sort(key=lambda m: m.name)
    return listed.model_dump()


def loading_tag(record: dict) -> TagModel:
    """/api/tags' entry of a model a worker is loading (``ModelRegistry.loading``)."""
    source = Path(record["source"])
    digest = hashlib.sha256(f"{record['model']}\n{record['source']}".encode()).hexdigest()
    return TagModel(
        name=record["model"],
        model=record["model"],
        modified_at=rfc3339(record["since"]),
        size=source.stat().st_size if source.is_file() else 0,
        digest=digest,
        details=ModelDetails(
            format="gguf" if source.suffix == ".gguf" else "safetensors",
            family="",
            families=[],
            parameter_size="",
            quantization_level="",
        ),
    )


@router.get("/api/ps")
async def ps(request: Request) -> dict:
    """What is loaded; a catalogue model's ``expires_at`` is when its keep-alive runs out
    (Ollama's far future for one kept for good or running a request)."""
    loaded = await _ollama(request).ps()
    on_demand = request.app.state.registry.on_demand
    catalogue = await on_demand.catalogue()
    if catalogue:
        residents = await on_demand.residents()
        for model in loaded.models:
            until = expires_at(residents, model.name) if model.name in catalogue else None
            if until is not None:
                model.expires_at = rfc3339(until)
    return loaded.model_dump()


@router.post("/api/show")
async def show(body: ShowBody, request: Request) -> dict:
    return (await _ollama(request).show(body)).model_dump()


@router.get("/api/version")
async def version() -> dict:
    return {"version": OLLAMA_VERSION}


def _forbidden(request: Request) -> None:
    raise ModelsAreTheOperators(
        f"{request.method} {request.url.path} is not served: the models are managed by this "
        "server's operator (the workers' LLMQ_MODEL); see /api/tags for those served"
    )


for _method, _path in (
    ("POST", "/api/pull"),
    ("POST", "/api/push"),
    ("POST", "/api/create"),
    ("POST", "/api/copy"),
    ("DELETE", "/api/delete"),
    ("POST", "/api/blobs/{digest}"),
    ("HEAD", "/api/blobs/{digest}"),
):
    router.add_api_route(_path, _forbidden, methods=[_method], include_in_schema=False)
