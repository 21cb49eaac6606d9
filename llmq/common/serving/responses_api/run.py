"""One Responses request running as a chat generation: answered whole (``complete``) or as
events (``events``); what a stored response keeps (``record``)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from llmq.common.errors import LLMQError
from llmq.common.serving.chat import ChatGeneration
from llmq.common.serving.responses import ChatCompletion
from llmq.common.serving.responses_api.answer import fill
from llmq.common.serving.responses_api.events import Event, ResponseEvents
from llmq.common.serving.responses_api.objects import ResponseObject


class ResponsesRun:
    def __init__(
        self,
        generation: ChatGeneration,
        response: ResponseObject,
        items: list[dict[str, Any]],
        namespaces: dict[str, str] | None = None,
    ):
        self.generation = generation
        self.response = response
        self.namespaces = namespaces or {}  # each namespaced function's namespace
        self.items = items  # the conversation's input items: earlier turns', then this one's

    async def complete(self) -> ResponseObject:
        completion = await self.generation.complete()
        assert isinstance(completion, ChatCompletion)
        return fill(self.response, completion, self.namespaces)

    async def events(
        self, item_id: Callable[[str, int], str] | None = None
    ) -> AsyncIterator[Event]:
        """``item_id``: each output item's id from its prefix and index (default: random)."""
        events = ResponseEvents(self.response, self.namespaces, item_id)
        async with contextlib.aclosing(self.generation.chunks()) as chunks:
            async for event in events.events(chunks):  # type: ignore[arg-type]
                yield event

    def fail(self, error: LLMQError) -> None:
        self.generation.fail(error)

    async def aclose(self) -> None:
        await self.generation.aclose()

    def record(self) -> dict[str, Any]:
        """What is stored of the response: the object, and the input items a later
        ``previous_response_id`` puts before its own (the output items follow them)."""
        return {"response": self.response.model_dump(), "input": self.items}
