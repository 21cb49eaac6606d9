"""The chunks of a streamed chat answer as the Messages API's events: ``message_start`` (the
message, no content yet, its input tokens), a ``ping``, then per content block
``content_block_start``, its deltas (``thinking_delta`` and a closing ``signature_delta``,
``text_delta``, ``input_json_delta``) and ``content_block_stop``; ``message_delta`` (the stop
reason and sequence, the usage) and ``message_stop``. A failure mid-stream ends it with an
``error`` event."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from llmq.common.errors import LLMQError
from llmq.common.serving.messages_api.answer import stop_reason
from llmq.common.serving.messages_api.errors import error_body
from llmq.common.serving.messages_api.objects import (
    MessageObject,
    message_usage,
    signature,
    tool_use_id,
)
from llmq.common.serving.responses import ChatCompletionChunk, ChatDelta, Usage

Event = dict[str, Any]


class MessageEvents:
    """``text_allowed`` False: a forced call's turn (see answer.content_blocks);
    ``stop_sequence()`` the stop sequence that ended the output, asked once it has ended."""

    def __init__(
        self,
        message: MessageObject,
        text_allowed: bool,
        stop_sequence: Callable[[], str | None],
        cache_block: int = 0,
    ):
        self.message = message
        self.cache_block = cache_block  # see objects.message_usage
        self.text_allowed = text_allowed
        self.stop_sequence = stop_sequence
        self.index = -1  # the open block's index (blocks so far - 1)
        self.open: str | None = None  # the open block's type
        self.thinking = ""  # the open thinking block's text
        self.called = False

    async def events(self, chunks: AsyncIterator[ChatCompletionChunk]) -> AsyncIterator[Event]:
        yield {"type": "message_start", "message": self.message.model_dump()}
        yield {"type": "ping"}
        reason: str | None = None
        usage: Usage | None = None
        try:
            async for chunk in chunks:
                usage = chunk.usage or usage
                for choice in chunk.choices:
                    for event in self.delta(choice.delta):
                        yield event
                    reason = choice.finish_reason or reason
        except LLMQError as exc:
            yield error_body(exc)
            return
        for event in self.close():
            yield event
        for event in self.finish(reason, usage):
            yield event

    def finish(self, reason: str | None, usage: Usage | None) -> list[Event]:
        stop = self.stop_sequence() if reason == "stop" else None
        stopped = stop_reason(reason, self.called, stop)
        delta = {
            "stop_reason": stopped,
            "stop_sequence": stop if stopped == "stop_sequence" else None,
        }
        counts = {"output_tokens": 0}
        if usage is not None:
            counts = message_usage(usage, self.cache_block).model_dump()
        return [
            {"type": "message_delta", "delta": delta, "usage": counts},
            {"type": "message_stop"},
        ]

    def delta(self, delta: ChatDelta) -> list[Event]:
        events: list[Event] = []
        if delta.reasoning_content:
            if self.open != "thinking":
                events += self.start({"type": "thinking", "thinking": "", "signature": ""})
            self.thinking += delta.reasoning_content
            events.append(
                self._delta({"type": "thinking_delta", "thinking": delta.reasoning_content})
            )
        if delta.content and self.text_allowed:
            if self.open != "text":
                events += self.start({"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": delta.content}))
        for call in delta.tool_calls or []:
            if call.id is not None:  # a call opens
                self.called = True
                block = {"type": "tool_use", "id": tool_use_id(call.id)}
                events += self.start({**block, "name": call.function.name or "", "input": {}})
            arguments = call.function.arguments
            if self.open == "tool_use" and arguments:
                events.append(self._delta({"type": "input_json_delta", "partial_json": arguments}))
        return events

    def _delta(self, delta: dict[str, Any]) -> Event:
        return {"type": "content_block_delta", "index": self.index, "delta": delta}

    def start(self, block: dict[str, Any]) -> list[Event]:
        events = self.close()
        self.index += 1
        self.open = block["type"]
        events.append({"type": "content_block_start", "index": self.index, "content_block": block})
        return events

    def close(self) -> list[Event]:
        """The open block's closing events (none if no block is open)."""
        if self.open is None:
            return []
        events: list[Event] = []
        if self.open == "thinking":
            sig = {"type": "signature_delta", "signature": signature(self.thinking)}
            events.append(self._delta(sig))
            self.thinking = ""
        events.append({"type": "content_block_stop", "index": self.index})
        self.open = None
        return events
