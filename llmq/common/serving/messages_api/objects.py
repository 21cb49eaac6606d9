"""The Messages API's answer objects, typed: the message, its content blocks (text, tool_use,
thinking), its usage, and count_tokens' answer."""

from __future__ import annotations

import hashlib
import uuid
from typing import Any, Literal

from llmq.common.serving.responses import Usage, WireModel

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def tool_use_id(call_id: str) -> str:
    """A chat call's id ("call_...") as a tool_use block's ("toolu_...")."""
    return "toolu_" + call_id.removeprefix("call_")


def signature(thinking: str) -> str:
    """A thinking block's ``signature``, which clients keep and send back: a digest of the
    thinking (llmq checks nothing with it; thinking sent back is not shown to the model)."""
    return hashlib.sha256(thinking.encode()).hexdigest()


class TextContent(WireModel):
    type: Literal["text"] = "text"
    text: str


class ToolUseContent(WireModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class ThinkingContent(WireModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str


ContentBlock = TextContent | ToolUseContent | ThinkingContent


class MessageUsage(WireModel):
    """As Anthropic counts: ``cache_read_input_tokens`` are the prompt tokens the prefix cache
    served; ``cache_creation_input_tokens`` the ones this request wrote to it (for a request
    with ``cache_control`` breakpoints: the prompt's full cache blocks it computed, which the
    cache keeps); ``input_tokens`` the rest. Their sum is the prompt."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


def message_usage(usage: Usage, cache_block: int = 0) -> MessageUsage:
    """``cache_block``: the size of the prefix cache's blocks where the request marked
    breakpoints (0: unmarked, or no prefix cache), so that its writes are counted."""
    details = usage.prompt_tokens_details
    cached = details.cached_tokens if details else 0
    prompt = usage.prompt_tokens
    written = max(prompt // cache_block * cache_block - cached, 0) if cache_block else 0
    return MessageUsage(
        input_tokens=prompt - cached - written,
        output_tokens=usage.completion_tokens,
        cache_creation_input_tokens=written,
        cache_read_input_tokens=cached,
    )


class MessageObject(WireModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ContentBlock] = []
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    usage: MessageUsage


class TokenCount(WireModel):
    input_tokens: int
