"""The Responses API: POST /v1/responses (answered whole or as typed events, or queued to run
in the background), and the stored responses of each tenant: GET (a background one's events
too, with ``stream=true``) and DELETE /v1/responses/{id}, POST /v1/responses/{id}/cancel.
Another tenant's response is a 404, the same as a missing one."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request

from llmq.api.streaming import typed_events, whole_answer
from llmq.common.errors import InvalidRequest, LLMQError, NotFound
from llmq.common.serving.responses_api.answer import chat_request, echoed_fields
from llmq.common.serving.responses_api.events import Event
from llmq.common.serving.responses_api.items import input_items
from llmq.common.serving.responses_api.objects import new_response
from llmq.common.serving.responses_api.request import ResponsesRequest
from llmq.common.serving.responses_api.run import ResponsesRun
from llmq.common.storage.background_responses import (
    BackgroundResponses,
    dispatch_background,
    is_final,
)
from llmq.common.storage.responses_store import ResponsesStore, is_response_id

router = APIRouter()
_FINAL = ("response.completed", "response.incomplete", "response.failed")


def _store(request: Request) -> ResponsesStore:
    return request.app.state.responses


def _background(request: Request) -> BackgroundResponses:
    store = _store(request)
    return BackgroundResponses(store.r, store.keys, request.app.state.settings.background_retention)


class _Following:
    """A follower of stored events runs nothing: a client leaving stops only its reading."""

    def fail(self, error: LLMQError) -> None:
        pass

    async def aclose(self) -> None:
        pass


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
    if body.background:
        return await _create_background(body, history, request)
    run = await request.app.state.service.responses(body, history)
    if body.stream:
        return typed_events(run, _stored(run, store if body.store else None, owner))
    answer = await whole_answer(request, run)
    if body.store:
        await store.save(owner, run.record())
    return answer


async def _create_background(
    body: ResponsesRequest, history: list[dict[str, Any]], request: Request
):
    """Store the response queued and queue the task that runs it on a worker; with ``stream``
    follow its events as they are stored."""
    chat_request(body, history)  # a 400 now for what its run would refuse
    pipeline, _ = await request.app.state.registry.get(body.model)
    response = new_response(pipeline.model, {**echoed_fields(body), "background": True})
    response.status = "queued"
    record = {
        "response": response.model_dump(),
        "input": history + input_items(body.input),
        "owner": request.state.owner,
        "body": await request.json(),
        "history": history,
    }
    settings, background = request.app.state.settings, _background(request)
    await background.create(record, settings.file_retention)
    await asyncio.to_thread(dispatch_background, settings, response.id)
    if body.stream:
        return typed_events(_Following(), background.follow(response.id))
    return record["response"]


@router.get("/v1/responses/{response_id}")
async def get_response(
    response_id: str,
    request: Request,
    stream: bool = False,
    starting_after: Annotated[int | None, Query(ge=0)] = None,
):
    """The response; with ``stream=true``, a background response's events after sequence
    number ``starting_after`` (all of them without it), to its end."""
    record = await _store(request).get(response_id, request.state.owner)
    if record is None:
        raise _not_found(response_id)
    if not stream:
        return record["response"]
    if not record["response"].get("background"):
        raise InvalidRequest("Only responses created with background=true can be streamed.")
    after = -1 if starting_after is None else starting_after
    return typed_events(_Following(), _background(request).follow(response_id, after))


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> dict:
    """A background response still running is stopped first; its events go with it."""
    background = _background(request)
    record = await background.load(response_id) if is_response_id(response_id) else None
    if record is not None and record.get("owner") == request.state.owner:
        if record["response"].get("background") and not is_final(record):
            cancelled = {**record, "response": {**record["response"], "status": "cancelled"}}
            await background.save(cancelled, request.app.state.settings.file_retention)
            await background.cancel(response_id)
        await background.r.delete(background.events_key(response_id))
    if not await _store(request).delete(response_id, request.state.owner):
        raise _not_found(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: str, request: Request) -> dict:
    """Only a background response can be cancelled (OpenAI's rule); one cancelled already
    answers as it is, one finished otherwise is a 400. Its run stops at its next step."""
    background = _background(request)
    record = await background.load(response_id) if is_response_id(response_id) else None
    if record is None or record.get("owner") != request.state.owner:
        raise _not_found(response_id)
    response = record["response"]
    if not response.get("background"):
        raise InvalidRequest("Only responses created with background=true can be cancelled.")
    if response["status"] == "cancelled":
        return response
    if is_final(record):
        raise InvalidRequest(f"Cannot cancel a response with status {response['status']!r}.")
    cancelled = {**record, "response": {**response, "status": "cancelled"}}
    if not await background.save(cancelled, request.app.state.settings.file_retention):
        return await cancel_response(response_id, request)  # it finished meanwhile
    await background.cancel(response_id)
    return cancelled["response"]
