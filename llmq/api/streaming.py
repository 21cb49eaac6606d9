"""How an answer leaves the API: streamed as Server-Sent Events, or whole once every choice
finished; and what happens to it when the client leaves (its requests are cancelled) or the
server shuts down (it gets SHUTDOWN_DRAIN_S to finish, then ends with an error)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any, Protocol

import anyio
from fastapi import Request
from sse_starlette import EventSourceResponse
from sse_starlette.sse import AppStatus

from llmq.common.errors import LLMQError, ServerShuttingDown
from llmq.common.serving import Generation
from llmq.common.serving.responses import WireModel

# When the server shuts down, an answer gets this long to finish; then a stream ends with a
# server_shutting_down error event and [DONE], and a non-streamed request gets that error as a
# 503 (within uvicorn's 5 s graceful shutdown), so that a client tells a cut-off answer from a
# whole one, and its request is cancelled on the worker.
SHUTDOWN_DRAIN_S = 2.5


class ClientDisconnected(LLMQError):
    """The client left before a non-streamed answer was ready: its requests were cancelled.
    Answered quietly (nobody reads it), not logged as an exception in the ASGI app."""

    status = 499
    type = "client_closed_request"
    code = "client_disconnected"


def _shutdown_error() -> ServerShuttingDown:
    return ServerShuttingDown(
        f"the server shut down before the answer was complete ({SHUTDOWN_DRAIN_S}s after "
        "shutdown began); retry on another replica"
    )


async def watch_shutdown(began: asyncio.Event) -> None:
    """Sets ``began`` once uvicorn starts to shut down (the flag sse-starlette's hook on
    uvicorn's exit handler sets): one poll for the app, not one per request in flight."""
    while not AppStatus.should_exit:
        await asyncio.sleep(0.25)
    began.set()


async def _shutdown_drained(began: asyncio.Event) -> None:
    """Returns SHUTDOWN_DRAIN_S after shutdown began."""
    await began.wait()
    await asyncio.sleep(SHUTDOWN_DRAIN_S)


async def _until_disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class Answering(Protocol):
    """A generation, or a run built on one, answered whole."""

    async def complete(self) -> WireModel: ...


async def whole_answer(request: Request, generation: Answering) -> dict[str, Any]:
    """Run every choice to the end; a client that disconnects, or a server shutdown that
    outlasts the drain, cancels them all."""
    run = asyncio.ensure_future(generation.complete())
    watcher = asyncio.ensure_future(_until_disconnected(request))
    shutdown = asyncio.ensure_future(_shutdown_drained(request.app.state.shutting_down))
    try:
        await asyncio.wait([run, watcher, shutdown], return_when=asyncio.FIRST_COMPLETED)
        if not run.done():
            if shutdown.done():
                raise _shutdown_error()
            raise ClientDisconnected("the client disconnected")
        return run.result().model_dump()
    finally:
        watcher.cancel()
        shutdown.cancel()
        run.cancel()  # cancels the choices still running (their streams cancel upstream)
        await asyncio.gather(run, watcher, shutdown, return_exceptions=True)


def _sse(data: dict | str, event: str | None = None) -> dict:
    frame = {"data": data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))}
    return frame if event is None else {"event": event, **frame}


class Running(Protocol):
    """What a stream ends: a generation, or a run built on one."""

    def fail(self, error: LLMQError) -> None: ...

    async def aclose(self) -> None: ...


async def _end_at_shutdown(shutdown: anyio.Event, running: Running) -> None:
    await shutdown.wait()
    await asyncio.sleep(SHUTDOWN_DRAIN_S)
    running.fail(_shutdown_error())


def event_stream(running: Running, frames: AsyncIterator[dict]) -> EventSourceResponse:
    """``frames`` as SSE events; at shutdown ``running`` gets SHUTDOWN_DRAIN_S to finish, then
    fails (``frames`` answer that failure as they do any other)."""
    shutdown = anyio.Event()

    async def events():
        ender = asyncio.ensure_future(_end_at_shutdown(shutdown, running))
        try:
            async with contextlib.aclosing(frames) as framed:
                async for frame in framed:
                    yield frame
        finally:
            ender.cancel()
            await running.aclose()

    return EventSourceResponse(
        events(),
        ping=15,
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        shutdown_event=shutdown,
        shutdown_grace_period=SHUTDOWN_DRAIN_S + 1.0,
    )


def streamed_answer(generation: Generation) -> EventSourceResponse:
    """The answer's chunks as SSE events, an error event if it fails, then ``[DONE]``."""

    async def frames():
        try:
            async with contextlib.aclosing(generation.chunks()) as chunks:
                async for chunk in chunks:
                    yield _sse(chunk.model_dump())
        except LLMQError as exc:
            yield _sse(exc.to_dict())
        await generation.aclose()  # its choices cancelled before the client reads [DONE]
        yield _sse("[DONE]")

    return event_stream(generation, frames())


def typed_events(running: Running, events: AsyncIterator[dict]) -> EventSourceResponse:
    """Events that name their type (the Responses API's): each frame ``event: <type>``."""

    async def frames():
        async for event in events:
            yield _sse(event, event["type"])

    return event_stream(running, frames())
