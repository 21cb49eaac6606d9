"""The FastAPI app: lifespan (Redis, transport, model registry, generation service, metrics),
auth, body limit."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging

from fastapi import Depends, FastAPI, HTTPException, Request
from starlette.routing import Match, Router
from starlette.types import ASGIApp, Receive, Scope, Send

from llmq.api.errors import error_response, install_error_handlers
from llmq.api.metrics import Metrics
from llmq.api.streaming import watch_shutdown
from llmq.common.engine_client.deadline import fix_deadline
from llmq.common.engine_client.model_registry import ModelRegistry
from llmq.common.errors import AuthenticationFailed, BodyTooLarge
from llmq.common.serving import GenerationService
from llmq.common.settings import Settings, get_settings
from llmq.common.storage.responses_store import ResponsesStore
from llmq.common.storage.store import Store
from llmq.common.tenants import ANONYMOUS, current_owner, owner_id
from llmq.common.transport import AsyncTransport
from llmq.common.transport.redis_clients import async_client, keys_for

log = logging.getLogger("llmq.api")


class BodyLimit:
    """Refuses bodies over the limit with 413 before they are parsed: by Content-Length when
    given, else by counting the bytes as they arrive."""

    def __init__(self, app: ASGIApp, max_bytes: int, paths: dict[str, int] | None = None):
        self.app = app
        self.max_bytes = max_bytes
        self.paths = paths or {}  # larger limits for some routes (file uploads)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.paths.get(scope.get("path", ""), self.max_bytes)
        too_large = BodyTooLarge(f"the request body is over the limit of {limit} bytes")
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    if int(value) > limit:
                        return await error_response(too_large, scope.get("path", ""))(
                            scope, receive, send
                        )
                except ValueError:
                    pass
        received = 0

        async def limited() -> dict:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    # FastAPI passes HTTPExceptions raised while reading the body through.
                    raise HTTPException(413, too_large.message)
            return message

        await self.app(scope, limited, send)


class OllamaJsonBodies:
    """Ollama's server reads every body as JSON whatever its content type; its clients and
    scripts (``curl -d`` sends a form's type) rely on it. Bodies under ``/api/`` are taken as
    JSON here too, instead of a 422 for a form body."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("path", "").startswith("/api/"):
            headers = [(k, v) for k, v in scope.get("headers", []) if k != b"content-type"]
            scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        await self.app(scope, receive, send)


class HeadAsGet:
    """``HEAD`` on every route that answers ``GET`` (HTTP's rule; clients probe a server with
    ``HEAD /`` before they use it): the ``GET`` is run and its status and headers sent, without
    its body. A route of its own for ``HEAD`` answers it; a path with no ``GET`` answers 405."""

    def __init__(self, app: ASGIApp, router: Router):
        self.app = app
        self.router = router

    def _own_route(self, scope: Scope) -> bool:
        return any(route.matches(scope)[0] == Match.FULL for route in self.router.routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "HEAD" or self._own_route(scope):
            return await self.app(scope, receive, send)
        ended = False

        async def headers_only(message: dict) -> None:
            nonlocal ended
            if message["type"] == "http.response.start":
                await send(message)
            elif not ended and not message.get("more_body", False):  # the body's last part
                ended = True
                await send({"type": "http.response.body", "body": b""})

        await self.app({**scope, "method": "GET"}, receive, headers_only)


async def require_api_key(request: Request) -> None:
    """Let in a request that carries one of the API keys (``Authorization: Bearer`` or
    ``x-api-key``), and name its tenant in ``request.state.owner`` (the anonymous one when no
    key is set)."""
    keys: list[tuple[bytes, str]] = request.app.state.api_keys
    if not keys:
        request.state.owner = ANONYMOUS
        current_owner.set(ANONYMOUS)
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" and "x-api-key" in request.headers:
        # Anthropic's clients send the key as x-api-key.
        scheme, token = "bearer", request.headers["x-api-key"]
    sent = token.strip().encode()
    owner = None
    # Every key compared, each in constant time, none skipped: the time taken tells nothing
    # of which key matched, or how much of one.
    for key, tenant in keys:
        if hmac.compare_digest(sent, key):
            owner = tenant
    if scheme.lower() != "bearer" or owner is None:
        raise AuthenticationFailed(
            "a valid API key is required: Authorization: Bearer <key> (or x-api-key: <key>)"
        )
    request.state.owner = owner
    # An async dependency runs in the route's own context: the service reads the tenant there.
    current_owner.set(owner)


async def start_deadline(request: Request) -> None:
    """Fix the request's deadline (LLMQ_REQUEST_TIMEOUT from its arrival) in the route's context:
    a wait for its model's load and its generation count against the same one."""
    fix_deadline(request.app.state.settings.request_timeout)


def _include_routes(app: FastAPI) -> None:
    from llmq.api import (
        adapter_routes,
        batches_routes,
        completions_routes,
        embeddings_routes,
        health,
        message_batches_routes,
        messages_routes,
        model_admin_routes,
        models_routes,
        ollama_routes,
        playground,
        rerank_routes,
        responses_routes,
        tokenizer_routes,
    )

    app.include_router(health.router)
    app.include_router(playground.router)
    keyed = (models_routes, completions_routes, responses_routes, embeddings_routes, rerank_routes)
    keyed += (adapter_routes,)
    keyed += (message_batches_routes,)
    keyed += (model_admin_routes,)
    for routes in (*keyed, messages_routes, ollama_routes, batches_routes, tokenizer_routes):
        app.include_router(
            routes.router, dependencies=[Depends(require_api_key), Depends(start_deadline)]
        )


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        client = async_client(
            settings.redis_url_or_default(),
            settings.redis_max_connections,
            settings.redis_sentinel_master,
        )
        transport = AsyncTransport(client, keys_for(settings))
        app.state.redis = client
        app.state.transport = transport
        app.state.registry = ModelRegistry(transport, settings)
        app.state.service = GenerationService(app.state.registry, app.state.metrics)
        app.state.store = Store(client, transport.keys, settings.file_retention)
        app.state.responses = ResponsesStore(client, transport.keys, settings.file_retention)
        app.state.shutting_down = asyncio.Event()
        shutdown_watch = asyncio.create_task(watch_shutdown(app.state.shutting_down))
        preload = asyncio.create_task(app.state.registry.preload())
        try:
            yield
        finally:
            preload.cancel()
            shutdown_watch.cancel()
            await transport.close()
            await client.aclose()

    app = FastAPI(
        title="llmq",
        version="0.1.0",
        description="OpenAI-compatible LLM serving on Celery and Redis.",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.api_keys = [(key.encode(), owner_id(key)) for key in settings.api_keys()]
    app.state.metrics = Metrics()
    install_error_handlers(app)

    _include_routes(app)
    # An upload is refused with a 400 past max_file_bytes as it streams in (api/uploads.py),
    # its rest read and dropped so that the client sees the answer; only a body far past the
    # limit has its connection cut with a 413.
    app.add_middleware(OllamaJsonBodies)
    app.add_middleware(HeadAsGet, router=app.router)
    app.add_middleware(
        BodyLimit,
        max_bytes=settings.max_body_bytes,
        paths={"/v1/files": 2 * settings.max_file_bytes + (1 << 20)},
    )
    return app
