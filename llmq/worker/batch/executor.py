"""Where a batch line's request is answered: the one place that knows how.

A line's request runs at batch priority, outside the interactive queue limit, with request ids
derived from the line, and is answered with the status and body the HTTP route would give.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Protocol

from llmq.common.pipeline import SubmitContext, submit_context
from llmq.common.protocol import PRIORITY_BATCH
from llmq.common.settings import Settings

logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per batch line is noise


class LineExecutor(Protocol):
    async def answer(
        self, endpoint: str, body: dict, request_id_prefix: str
    ) -> tuple[int, dict]: ...


class _InProcessApi:
    """The API app in this process, reached through an ASGI transport."""

    def __init__(self, http) -> None:
        self.http = http

    async def answer(self, endpoint: str, body: dict, request_id_prefix: str) -> tuple[int, dict]:
        token = submit_context.set(SubmitContext(PRIORITY_BATCH, request_id_prefix))
        try:
            response = await self.http.post(endpoint, json=body)
        finally:
            submit_context.reset(token)
        try:
            payload = response.json()
        except ValueError:
            error = {"message": response.text[:500], "type": "server_error"}
            payload = {"error": {**error, "param": None, "code": None}}
        return response.status_code, payload


@contextlib.asynccontextmanager
async def open_executor(settings: Settings) -> AsyncIterator[LineExecutor]:
    import httpx

    from llmq.api.app import create_app

    api = create_app(settings)
    async with api.router.lifespan_context(api):
        transport = httpx.ASGITransport(app=api)
        # The lines run as the batch's owner: the key that created the batch is the API's.
        key = settings.api_key
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        async with httpx.AsyncClient(
            transport=transport, base_url="http://llmq-batch", timeout=None, headers=headers
        ) as http:
            yield _InProcessApi(http)
