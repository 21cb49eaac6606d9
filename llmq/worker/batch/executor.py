"""Where a batch line's request is answered: the generation service, in this process, with the
status and body the HTTP route would give.

A line's request runs at batch priority, outside the interactive queue limit, with request ids
derived from the line (a re-run attaches to what its first run started).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any, Protocol

from llmq.common.engine_client.model_registry import ModelRegistry
from llmq.common.errors import BodyTooLarge
from llmq.common.protocol import PRIORITY_BATCH
from llmq.common.serving import GenerationService, SubmitOptions
from llmq.common.settings import Settings
from llmq.common.transport import AsyncTransport
from llmq.common.transport.redis_clients import async_client, keys_for


class LineExecutor(Protocol):
    async def answer(
        self, endpoint: str, body: dict, request_id_prefix: str
    ) -> tuple[int, dict[str, Any]]: ...

    async def attachable(self, request_id_prefix: str, model: str | None) -> bool: ...


class AnsweringService(Protocol):
    async def answer(
        self, endpoint: str, body: dict, options: SubmitOptions
    ) -> tuple[int, dict[str, Any]]: ...


def encoded_size(body: dict) -> int:
    """The body's size as an HTTP client sends it (compact JSON, UTF-8). Raises
    UnicodeEncodeError for text that is not valid Unicode (a lone surrogate) and ValueError
    for NaN or infinities, as the client would."""
    text = json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return len(text.encode("utf-8"))


class ServiceExecutor:
    def __init__(
        self,
        service: AnsweringService,
        max_body_bytes: int,
        transport: AsyncTransport | None = None,
    ):
        self.service = service
        self.max_body_bytes = max_body_bytes
        self.transport = transport

    async def attachable(self, request_id_prefix: str, model: str | None) -> bool:
        """Whether the requests of these ids, if any, can be followed to their end: never
        started, or queued, running or finished. One cancelled or failed may hold tokens that
        a new request of the same id would be confused with."""
        if self.transport is None:
            return True
        model = model or await self.service.registry.default_model()
        state, _, _ = await self.transport.request_state(f"{request_id_prefix}-0", model)
        return state.get("state") in (None, "queued", "running", "finished")

    async def answer(
        self, endpoint: str, body: dict, request_id_prefix: str
    ) -> tuple[int, dict[str, Any]]:
        # The API refuses a body over its limit before parsing it; so does a batch line.
        if encoded_size(body) > self.max_body_bytes:
            limit = self.max_body_bytes
            error = BodyTooLarge(f"the request body is over the limit of {limit} bytes")
            return error.status, error.to_dict()
        options = SubmitOptions(priority=PRIORITY_BATCH, request_id_prefix=request_id_prefix)
        return await self.service.answer(endpoint, body, options)


@contextlib.asynccontextmanager
async def open_executor(settings: Settings) -> AsyncIterator[LineExecutor]:
    """An executor on its own Redis connections, for the lines of one batch run."""
    client = async_client(
        settings.redis_url_or_default(),
        settings.redis_max_connections,
        settings.redis_sentinel_master,
    )
    transport = AsyncTransport(client, keys_for(settings))
    try:
        service = GenerationService(ModelRegistry(transport, settings))
        yield ServiceExecutor(service, settings.max_body_bytes, transport)
    finally:
        await transport.close()
        await client.aclose()
