"""A Messages conversation as chat messages: ``system`` first, then each turn. An assistant
turn's text is its content and its tool_use blocks its tool calls (their ``input`` as the JSON
text chat takes); a user turn's tool_result blocks are tool messages answering those calls,
its text a user message, in the order they stand. Thinking blocks of earlier turns are not
shown to the model (as chat templates drop earlier reasoning). A system turn inside ``messages``
stands where it is sent when the model's chat template renders a system message there
(``mid_system``), else its text is joined to the system prompt, after what was there."""

from __future__ import annotations

import json
from typing import Any

from llmq.common.serving.messages_api.content import (
    ImageBlock,
    InputMessage,
    TextBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from llmq.common.serving.messages_api.request import MessagesPrompt


def _assistant(message: InputMessage) -> dict[str, Any]:
    if isinstance(message.content, str):
        return {"role": "assistant", "content": message.content}
    text = "".join(b.text for b in message.content if isinstance(b, TextBlock))
    calls = [
        {
            "id": b.id,
            "type": "function",
            "function": {"name": b.name, "arguments": json.dumps(b.input)},
        }
        for b in message.content
        if isinstance(b, ToolUseBlock)
    ]
    if not calls:
        return {"role": "assistant", "content": text}
    return {"role": "assistant", "content": text or None, "tool_calls": calls}


def _user(message: InputMessage) -> list[dict[str, Any]]:
    if isinstance(message.content, str):
        return [{"role": "user", "content": message.content}]
    out: list[dict[str, Any]] = []
    for block in message.content:
        if isinstance(block, ToolResultBlock):
            out.append({"role": "tool", "content": block.text(), "tool_call_id": block.tool_use_id})
        elif isinstance(block, TextBlock | ImageBlock):
            part = block.chat_part() if isinstance(block, ImageBlock) else block.text
            if out and out[-1]["role"] == "user":  # one user message per run of blocks
                out[-1]["content"] = _joined(out[-1]["content"], part)
            else:
                out.append({"role": "user", "content": part if isinstance(part, str) else [part]})
    return out or [{"role": "user", "content": ""}]


def _joined(content: str | list[dict[str, Any]], part: str | dict[str, Any]) -> Any:
    """Content with a block's text or image part after it (text alone stays a string)."""
    if isinstance(content, str) and isinstance(part, str):
        return content + part
    parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
    return [*parts, {"type": "text", "text": part} if isinstance(part, str) else part]


def chat_messages(body: MessagesPrompt, mid_system: bool = True) -> list[dict[str, Any]]:
    system = [body.system_text()] if body.system_text() is not None else []
    turns: list[dict[str, Any]] = []
    for message in body.messages:
        if message.role == "assistant":
            turns.append(_assistant(message))
        elif message.role == "user":
            turns.extend(_user(message))
        elif mid_system:
            turns.append({"role": "system", "content": message.text()})
        else:
            system.append(message.text())
    if not system:
        return turns
    return [{"role": "system", "content": "\n\n".join(system)}, *turns]


def is_prefill(body: MessagesPrompt) -> bool:
    """A conversation that ends with an assistant turn of text: the answer continues it."""
    last = body.messages[-1]
    if last.role != "assistant":
        return False
    return isinstance(last.content, str) or not any(
        isinstance(b, ToolUseBlock) for b in last.content
    )
