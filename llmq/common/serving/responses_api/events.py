"""The chunks of a streamed chat answer as the Responses API's typed events: the response
created and in progress, then each output item (a message's text, a function call's arguments)
added, its deltas and done, and the response completed, incomplete or failed. Every event has
its ``sequence_number``, 0, 1, 2, ... in the order sent."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from llmq.common.errors import LLMQError
from llmq.common.serving.responses import ChatCompletionChunk, ChatDelta, Usage
from llmq.common.serving.responses_api.answer import finish
from llmq.common.serving.responses_api.objects import (
    FunctionCallItem,
    OutputItem,
    OutputMessage,
    OutputText,
    ResponseError,
    ResponseObject,
    new_item_id,
)

Event = dict[str, Any]
_FINAL_EVENTS = {
    "completed": "response.completed",
    "incomplete": "response.incomplete",
    "failed": "response.failed",
}


class ResponseEvents:
    """Turns chunks into events; ``response`` is filled in as they come."""

    def __init__(
        self,
        response: ResponseObject,
        namespaces: dict[str, str] | None = None,
        item_id: Callable[[str, int], str] | None = None,
    ):
        self.response = response
        self.namespaces = namespaces or {}  # each namespaced function's namespace
        # An item's id from its prefix and output index (a background response's are the
        # same in a re-run after a crash); random by default.
        self.item_id = item_id or (lambda prefix, _index: new_item_id(prefix))
        self.sequence = 0
        self.item: OutputItem | None = None  # the item being streamed
        self.text = ""  # the open message's text so far

    def event(self, kind: str, **fields: Any) -> Event:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def _whole(self) -> Event:
        return self.response.model_dump()

    async def events(self, chunks: AsyncIterator[ChatCompletionChunk]) -> AsyncIterator[Event]:
        yield self.event("response.created", response=self._whole())
        yield self.event("response.in_progress", response=self._whole())
        reason: str | None = None
        usage: Usage | None = None
        try:
            async for chunk in chunks:
                usage = chunk.usage or usage
                for choice in chunk.choices:
                    for event in self._delta(choice.delta):
                        yield event
                    reason = choice.finish_reason or reason
        except LLMQError as exc:
            for event in self._close("incomplete"):
                yield event
            self.response.status = "failed"
            self.response.error = ResponseError(code=exc.code or exc.type, message=exc.message)
        else:
            if not self.response.output and self.item is None:
                for event in self._open_message():  # no text and no call: an empty message
                    yield event
            for event in self._close("incomplete" if reason == "length" else "completed"):
                yield event
            finish(self.response, reason, usage)
        kind = _FINAL_EVENTS[self.response.status]
        yield self.event(kind, response=self._whole())

    def _delta(self, delta: ChatDelta) -> list[Event]:
        events: list[Event] = []
        if delta.content:
            if not isinstance(self.item, OutputMessage):
                events += self._close("completed") + self._open_message()
            assert self.item is not None
            self.text += delta.content
            events.append(
                self.event(
                    "response.output_text.delta",
                    item_id=self.item.id,
                    output_index=self._index(),
                    content_index=0,
                    delta=delta.content,
                    logprobs=[],
                )
            )
        for call in delta.tool_calls or []:
            if call.id is not None:  # a call opens
                events += self._close("completed") + self._open_call(call.id, call.function.name)
            item = self.item
            if isinstance(item, FunctionCallItem) and call.function.arguments:
                item.arguments += call.function.arguments
                events.append(
                    self.event(
                        "response.function_call_arguments.delta",
                        item_id=item.id,
                        output_index=self._index(),
                        delta=call.function.arguments,
                    )
                )
        return events

    def _index(self) -> int:
        return len(self.response.output)  # the open item's: it joins output once done

    def _open_message(self) -> list[Event]:
        self.item = OutputMessage(
            id=self.item_id("msg", self._index()), status="in_progress", content=[]
        )
        self.text = ""
        item_id, index = self.item.id, self._index()
        return [
            self.event(
                "response.output_item.added", output_index=index, item=self.item.model_dump()
            ),
            self.event(
                "response.content_part.added",
                item_id=item_id,
                output_index=index,
                content_index=0,
                part=OutputText(text="").model_dump(),
            ),
        ]

    def _open_call(self, call_id: str, name: str | None) -> list[Event]:
        self.item = FunctionCallItem(
            id=self.item_id("fc", self._index()),
            call_id=call_id,
            name=name or "",
            namespace=self.namespaces.get(name or ""),
            arguments="",
            status="in_progress",
        )
        return [
            self.event(
                "response.output_item.added",
                output_index=self._index(),
                item=self.item.model_dump(),
            )
        ]

    def _close(self, status: str) -> list[Event]:
        """The open item's closing events (none if no item is open)."""
        item, index = self.item, self._index()
        if item is None:
            return []
        events: list[Event] = []
        item.status = status  # type: ignore[assignment]
        if isinstance(item, OutputMessage):
            part = OutputText(text=self.text)
            fields = {"item_id": item.id, "output_index": index, "content_index": 0}
            events.append(
                self.event("response.output_text.done", **fields, text=self.text, logprobs=[])
            )
            events.append(
                self.event("response.content_part.done", **fields, part=part.model_dump())
            )
            item.content = [part]
        else:
            events.append(
                self.event(
                    "response.function_call_arguments.done",
                    item_id=item.id,
                    output_index=index,
                    arguments=item.arguments,
                )
            )
        events.append(
            self.event("response.output_item.done", output_index=index, item=item.model_dump())
        )
        self.response.output.append(item)
        self.item = None
        return events
