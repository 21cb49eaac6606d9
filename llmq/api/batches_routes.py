"""The OpenAI Files and Batch APIs: /v1/files and /v1/batches. Batches run as Celery tasks
(queue ``llmq.batch``) that clients poll. Every file and batch belongs to the tenant (API key)
that made it: another tenant's is a 404, the same as a missing one, and no list shows it."""

from __future__ import annotations

import asyncio
from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from llmq.api.uploads import FILE_PURPOSES, Limits, receive_file
from llmq.common.errors import InvalidRequest, NotFound
from llmq.common.storage.store import BATCH_ENDPOINTS, Store
from llmq.common.transport.celery_client import dispatch_batch

router = APIRouter()


def _store(request: Request) -> Store:
    return request.app.state.store


def _owner(request: Request) -> str:
    """The tenant of the request, which require_api_key named."""
    return request.state.owner


def _list_page(items: list[dict], has_more: bool) -> dict:
    """One page of a list, in OpenAI's cursor shape."""
    return {
        "object": "list",
        "data": items,
        "first_id": items[0]["id"] if items else None,
        "last_id": items[-1]["id"] if items else None,
        "has_more": has_more,
    }


# ---- files -------------------------------------------------------------------------------
_UPLOAD_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file", "purpose"],
                    "properties": {
                        "file": {"type": "string", "format": "binary"},
                        "purpose": {"type": "string", "enum": list(FILE_PURPOSES)},
                    },
                }
            }
        },
    }
}


@router.post("/v1/files", openapi_extra=_UPLOAD_BODY)
async def create_file(request: Request) -> dict:
    """Multipart fields ``file`` and ``purpose``, read as they stream in (api/uploads.py)."""
    settings = request.app.state.settings
    limits = Limits(settings.max_file_bytes, settings.max_batch_lines, settings.tenant_quota_bytes)
    return await receive_file(request, _store(request), limits, _owner(request))


@router.get("/v1/files")
async def list_files(
    request: Request,
    purpose: str | None = None,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10000)] = 10000,
    order: Literal["asc", "desc"] = "desc",
) -> dict:
    store = _store(request)
    page, more = await store.list_files(purpose, after, limit, order == "desc", _owner(request))
    return _list_page(page, more)


async def _file(request: Request, file_id: str) -> dict:
    f = await _store(request).get_file(file_id, _owner(request))
    if f is None:
        raise NotFound(f"no file with id {file_id!r}", "file_id", "file_not_found")
    return f


@router.get("/v1/files/{file_id}")
async def get_file(file_id: str, request: Request) -> dict:
    return await _file(request, file_id)


@router.get("/v1/files/{file_id}/content")
async def file_content(file_id: str, request: Request) -> StreamingResponse:
    """The content streamed out a stored piece at a time."""
    f = await _file(request, file_id)
    media = "application/jsonl" if f["filename"].endswith(".jsonl") else "application/octet-stream"
    headers = {"content-length": str(f["bytes"])}
    return StreamingResponse(
        _store(request).file_chunks(file_id), media_type=media, headers=headers
    )


@router.delete("/v1/files/{file_id}")
async def delete_file(file_id: str, request: Request) -> dict:
    await _file(request, file_id)
    if not await _store(request).delete_file(file_id, _owner(request)):  # a delete raced
        raise NotFound(f"no file with id {file_id!r}", "file_id", "file_not_found")
    return {"id": file_id, "object": "file", "deleted": True}


# ---- batches -----------------------------------------------------------------------------
class BatchCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_file_id: str
    endpoint: Literal[
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/embeddings",
        "/v1/rerank",
        "/v1/score",
        "/v1/messages",
    ]
    completion_window: Annotated[str, Field(pattern=r"^\d{1,3}h$")] = Field(
        "24h", description="Hours the batch may take, 1h to 168h (OpenAI offers 24h)."
    )
    # OpenAI's bounds: 16 pairs, keys up to 64 characters, values up to 512.
    metadata: (
        Annotated[
            dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
            Field(max_length=16),
        ]
        | None
    ) = None

    @field_validator("completion_window")
    @classmethod
    def _window(cls, v: str) -> str:
        if not 1 <= int(v[:-1]) <= 168:
            raise ValueError("completion_window must be between 1h and 168h")
        return v


@router.post("/v1/batches")
async def create_batch(body: BatchCreate, request: Request) -> dict:
    store = _store(request)
    f = await store.get_file(body.input_file_id, _owner(request))
    if f is None:
        raise NotFound(f"no file with id {body.input_file_id!r}", "input_file_id", "file_not_found")
    if f["purpose"] != "batch":
        raise InvalidRequest("the input file's purpose must be 'batch'", "input_file_id")
    assert body.endpoint in BATCH_ENDPOINTS
    batch = await store.create_batch(
        body.input_file_id, body.endpoint, body.completion_window, body.metadata, _owner(request)
    )
    await asyncio.to_thread(dispatch_batch, request.app.state.settings, batch["id"])
    return batch


@router.get("/v1/batches")
async def list_batches(
    request: Request,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> dict:
    batches, has_more = await _store(request).list_batches(after, limit, _owner(request))
    return _list_page(batches, has_more)


async def _batch(request: Request, batch_id: str) -> dict:
    batch = await _store(request).get_batch(batch_id, _owner(request))
    if batch is None:
        raise NotFound(f"no batch with id {batch_id!r}", "batch_id", "batch_not_found")
    return batch


@router.get("/v1/batches/{batch_id}")
async def get_batch(batch_id: str, request: Request) -> dict:
    return await _batch(request, batch_id)


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, request: Request) -> dict:
    await _batch(request, batch_id)
    store = _store(request)
    prev = await store.transition(batch_id, "cancelling", ("validating", "in_progress"))
    if prev is None:
        status = await store.status(batch_id)
        if status not in ("cancelling", "cancelled"):
            raise InvalidRequest(f"a batch that is {status} cannot be cancelled", "batch_id")
    return await _batch(request, batch_id)
