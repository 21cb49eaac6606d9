"""Anthropic's Message Batches API on the Batch API's runner (common/storage/message_batches.py):
POST /v1/messages/batches, GET /v1/messages/batches (a page), GET, POST .../cancel, DELETE,
and GET .../results (JSONL). Tenancy as the OpenAI batches have it: another tenant's batch is a
404, the same as a missing one. Errors leave in Anthropic's shape (the /v1/messages prefix)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse

from llmq.common.errors import InvalidRequest, NotFound
from llmq.common.storage.message_batches import (
    ENDPOINT,
    MARK,
    MessageBatchCreate,
    batch_id_of,
    is_message_batch,
    message_batch,
    processing_status,
    result_line,
)
from llmq.common.storage.store import Store
from llmq.common.transport.celery_client import dispatch_batch
from llmq.common.validation import validation_error

router = APIRouter()


def _store(request: Request) -> Store:
    return request.app.state.store


async def _batch(request: Request, message_batch_id: str) -> dict:
    batch_id = batch_id_of(message_batch_id)
    batch = None
    if batch_id is not None:
        batch = await _store(request).get_batch(batch_id, request.state.owner)
    if batch is None or not is_message_batch(batch):
        raise NotFound(f"message batch {message_batch_id!r} not found", "message_batch_id")
    return batch


async def _rows(store: Store, batch: dict) -> AsyncIterator[dict]:
    """The rows of the batch's output and error files."""
    for file_id in (batch["output_file_id"], batch["error_file_id"]):
        if file_id is None:
            continue
        rest = b""
        async for piece in store.file_chunks(file_id):
            *lines, rest = (rest + piece).split(b"\n")
            for line in lines:
                if line.strip():
                    yield json.loads(line)
        if rest.strip():
            yield json.loads(rest)


async def _shown(request: Request, batch: dict) -> dict:
    counts: dict[str, int] = {}
    if processing_status(batch["status"]) == "ended":
        async for row in _rows(_store(request), batch):
            kind = result_line(row)["result"]["type"]
            counts[kind] = counts.get(kind, 0) + 1
    return message_batch(batch, counts, str(request.base_url).rstrip("/"))


@router.post("/v1/messages/batches")
async def create_message_batch(body: MessageBatchCreate, request: Request) -> dict:
    try:
        content = body.input_file()
    except ValueError as exc:
        raise validation_error([{"loc": ("requests",), "msg": str(exc)}]) from None
    store, owner, settings = _store(request), request.state.owner, request.app.state.settings
    f = await store.create_file(
        "message_batch.jsonl", "batch", content, owner, settings.tenant_quota_bytes
    )
    batch = await store.create_batch(f["id"], ENDPOINT, "24h", {MARK: "1"}, owner)
    await asyncio.to_thread(dispatch_batch, settings, batch["id"])
    return await _shown(request, batch)


@router.get("/v1/messages/batches")
async def list_message_batches(
    request: Request,
    after_id: str | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 20,
) -> dict:
    """Newest first; a page holds the message batches among the tenant's batches."""
    after = batch_id_of(after_id) if after_id else None
    batches, more = await _store(request).list_batches(after, limit, request.state.owner)
    data = [await _shown(request, b) for b in batches if is_message_batch(b)]
    return {
        "data": data,
        "has_more": more,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
    }


@router.get("/v1/messages/batches/{message_batch_id}")
async def get_message_batch(message_batch_id: str, request: Request) -> dict:
    return await _shown(request, await _batch(request, message_batch_id))


@router.post("/v1/messages/batches/{message_batch_id}/cancel")
async def cancel_message_batch(message_batch_id: str, request: Request) -> dict:
    batch = await _batch(request, message_batch_id)
    store = _store(request)
    moved = await store.transition(batch["id"], "cancelling", ("validating", "in_progress"))
    if moved is None and await store.status(batch["id"]) not in ("cancelling", "cancelled"):
        raise InvalidRequest(f"message batch {message_batch_id!r} has ended already")
    return await _shown(request, await _batch(request, message_batch_id))


@router.delete("/v1/messages/batches/{message_batch_id}")
async def delete_message_batch(message_batch_id: str, request: Request) -> dict:
    """An ended batch only (Anthropic's rule: cancel one that runs first); its files go too."""
    batch = await _batch(request, message_batch_id)
    if processing_status(batch["status"]) != "ended":
        raise InvalidRequest("a message batch must end before it is deleted (cancel it first)")
    store, owner = _store(request), request.state.owner
    for file_id in (batch["input_file_id"], batch["output_file_id"], batch["error_file_id"]):
        if file_id is not None:
            await store.delete_file(file_id, owner)
    await store.r.delete(store.keys.batch(batch["id"]))
    await store.r.zrem(store.keys.tenant_batches(owner), batch["id"])
    return {"id": message_batch_id, "type": "message_batch_deleted"}


@router.get("/v1/messages/batches/{message_batch_id}/results")
async def message_batch_results(message_batch_id: str, request: Request) -> StreamingResponse:
    batch = await _batch(request, message_batch_id)
    if processing_status(batch["status"]) != "ended":
        raise InvalidRequest(f"message batch {message_batch_id!r} has not ended yet")

    async def lines() -> AsyncIterator[bytes]:
        async for row in _rows(_store(request), batch):
            yield json.dumps(result_line(row)).encode() + b"\n"

    return StreamingResponse(lines(), media_type="application/x-jsonl")
