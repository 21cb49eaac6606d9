"""The chat answer as a message: its blocks (thinking, text, tool_use), why it stopped, which
stop sequence stopped it."""

from __future__ import annotations

import json
from typing import Any

from pydantic_core import from_json

from llmq.common.serving.messages_api.objects import (
    ContentBlock,
    MessageObject,
    StopReason,
    TextContent,
    ThinkingContent,
    ToolUseContent,
    message_usage,
    signature,
    tool_use_id,
)
from llmq.common.serving.responses import AssistantMessage, ChatCompletion


def matched_stop(tokenizer, token_ids: list[int], stops: list[str] | None) -> str | None:
    """The stop sequence that ended an output of ``token_ids``, or None (EOS ended it). The
    first one in the text, the longest of those there, as the stream's matcher picks it."""
    stops = [s for s in stops or [] if s]
    if not stops:
        return None
    text = tokenizer.decode(token_ids, skip_special_tokens=True)
    hits = [(at, -len(s), s) for s in stops if (at := text.find(s)) >= 0]
    return min(hits)[2] if hits else None


def stop_reason(finish_reason: str | None, called: bool, stop_sequence: str | None) -> StopReason:
    if finish_reason == "length":
        return "max_tokens"
    if called:
        return "tool_use"
    return "stop_sequence" if stop_sequence is not None else "end_turn"


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the ``input`` object: whole, or as far as they go when
    ``max_tokens`` cut them short (the parsed call's own text, never the raw output)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        try:
            value = from_json(arguments, allow_partial=True)
        except ValueError:
            value = None
    return value if isinstance(value, dict) else {}


def content_blocks(message: AssistantMessage, text_allowed: bool) -> list[ContentBlock]:
    """``text_allowed`` False: a forced call's turn, whose output is the calls alone (its
    text, if a cut-off call was not parsed, is llmq's call array: never shown as text)."""
    blocks: list[ContentBlock] = []
    if message.reasoning_content:
        thinking = message.reasoning_content
        blocks.append(ThinkingContent(thinking=thinking, signature=signature(thinking)))
    if message.content and text_allowed:
        blocks.append(TextContent(text=message.content))
    for call in message.tool_calls or []:
        fn = call.function
        blocks.append(
            ToolUseContent(id=tool_use_id(call.id), name=fn.name, input=tool_input(fn.arguments))
        )
    return blocks


def fill(
    message: MessageObject,
    completion: ChatCompletion,
    text_allowed: bool,
    stop_sequence: str | None,
    cache_block: int = 0,
) -> MessageObject:
    choice = completion.choices[0]
    message.content = content_blocks(choice.message, text_allowed)
    called = any(isinstance(b, ToolUseContent) for b in message.content)
    message.stop_reason = stop_reason(choice.finish_reason, called, stop_sequence)
    message.stop_sequence = stop_sequence if message.stop_reason == "stop_sequence" else None
    message.usage = message_usage(completion.usage, cache_block)
    return message
