"""The Responses API: POST /v1/responses (answered whole or as typed events), and the stored
responses of each tenant: GET and DELETE /v1/responses/{id}, POST /v1/responses/{id}/cancel.
Another tenant's response is a 404, the same as a missing one."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request

from llmq.api.streaming import typed_events, whole_answer
from llmq.common.errors import InvalidRequest, NotFound
from llmq.common.generation.responses_api.events import Event
from llmq.common.generation.responses_api.request import ResponsesRequest
from llmq.common.generation.responses_api.run import ResponsesRun
from llmq.common.responses_store import ResponsesStore

router = APIRouter()
_FINAL = ("response.completed", "response.incomplete", "response.failed")


def _store(request: Request) -> ResponsesStore:
    return request.app.state.responses


def _not_found(response_id: str, param: str | None = None) -> NotFound:
    return NotFound(f"Response with id {response_id!r} not found.", param)


async def _stored(
    run: ResponsesRun, store: ResponsesStore | None, owner: str
) -> AsyncIterator[Event]:
    """The run's events; the response is stored before its final event is sent, so that a
    client who read that event finds it."""
    async for event in run.events():
        if store is not None and event["type"] in _FINAL:
            await store.save(owner, run.record())
        yield event


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request):
    store, owner = _store(request), request.state.owner
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        found = await store.history(body.previous_response_id, owner)
        if found is None:
            raise _not_found(body.previous_response_id, "previous_response_id")
        history = found
    run = await request.app.state.service.responses(body, history)
    if body.stream:
        return typed_events(run, _stored(run, store if body.store else None, owner))
    answer = await whole_answer(request, run)
    if body.store:
        await store.save(owner, run.record())
    return answer


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request) -> dict:
    record = await _store(request).get(response_id, request.state.owner)
    if record is None:
        raise _not_found(response_id)
    return record["response"]


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> dict:
    if not await _store(request).delete(response_id, request.state.owner):
        raise _not_found(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: str, request: Request) -> dict:
    """Only a background response can be cancelled (OpenAI's rule), and llmq runs none: a
    response is stored once it has finished."""
    if await _store(request).get(response_id, request.state.owner) is None:
        raise _not_found(response_id)
    raise InvalidRequest("Only responses created with background=true can be cancelled.")
