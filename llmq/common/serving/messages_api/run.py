"""One Messages request running as a chat generation: answered whole (``complete``) or as
events (``events``)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from llmq.common.errors import LLMQError
from llmq.common.serving.chat import ChatGeneration
from llmq.common.serving.messages_api.answer import fill, matched_stop
from llmq.common.serving.messages_api.events import Event, MessageEvents
from llmq.common.serving.messages_api.objects import (
    MessageObject,
    MessageUsage,
    new_message_id,
)
from llmq.common.serving.messages_api.request import MessagesRequest
from llmq.common.serving.responses import ChatCompletion


class MessagesRun:
    def __init__(
        self,
        generation: ChatGeneration,
        body: MessagesRequest,
        ignored_effort: str | None = None,
        cache_block: int = 0,
    ):
        self.generation = generation
        self.ignored_effort = ignored_effort  # output_config.effort, not applied
        # The prefix cache's block size where the request marks breakpoints (its writes counted).
        self.cache_block = cache_block if body.cache_marked() else 0
        self.stops = body.stop_sequences
        self.text_allowed = not body.forced_call()
        self.message = MessageObject(
            id=new_message_id(),
            model=generation.model,
            usage=MessageUsage(input_tokens=generation.prompt_tokens, output_tokens=0),
        )

    def stop_sequence(self) -> str | None:
        """The stop sequence that ended the (finished) output, or None."""
        choice = self.generation.choices[0]
        if choice.finish_reason != "stop":
            return None
        return matched_stop(self.generation.tokenizer, choice.token_ids, self.stops)

    async def complete(self) -> MessageObject:
        completion = await self.generation.complete()
        assert isinstance(completion, ChatCompletion)
        stop = self.stop_sequence()
        return fill(self.message, completion, self.text_allowed, stop, self.cache_block)

    async def events(self) -> AsyncIterator[Event]:
        events = MessageEvents(
            self.message, self.text_allowed, self.stop_sequence, self.cache_block
        )
        async with contextlib.aclosing(self.generation.chunks()) as chunks:
            async for event in events.events(chunks):  # type: ignore[arg-type]
                yield event

    def fail(self, error: LLMQError) -> None:
        self.generation.fail(error)

    async def aclose(self) -> None:
        await self.generation.aclose()
