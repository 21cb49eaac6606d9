"""``context_management`` edits applied to a Messages conversation before it is rendered.
``clear_tool_uses_*``: once the prompt passes its trigger (input tokens), the results of all
but the last ``keep`` tool uses are replaced by a placeholder (their calls' inputs too where
``clear_tool_inputs`` asks), oldest first, skipping ``exclude_tools``. ``clear_thinking_*``
changes nothing here: earlier turns' thinking is never shown to the model."""

from __future__ import annotations

from llmq.common.serving.messages_api.content import (
    InputMessage,
    ToolResultBlock,
    ToolUseBlock,
)
from llmq.common.serving.messages_api.request import ClearToolUsesEdit, MessagesPrompt

# Anthropic's defaults for clear_tool_uses.
DEFAULT_TRIGGER = 100_000
DEFAULT_KEEP = 3
CLEARED = "[tool result cleared to save context]"


def tool_clearing(body: MessagesPrompt) -> ClearToolUsesEdit | None:
    """The request's clear_tool_uses edit, if it has one."""
    edits = body.context_management.edits if body.context_management else []
    return next((e for e in edits if isinstance(e, ClearToolUsesEdit)), None)


def _value(spec: dict | None, default: int) -> int:
    value = (spec or {}).get("value", default)
    return value if isinstance(value, int) and value >= 0 else default


def trigger_tokens(edit: ClearToolUsesEdit) -> int:
    return _value(edit.trigger, DEFAULT_TRIGGER)


def _clears_input(edit: ClearToolUsesEdit, name: str) -> bool:
    inputs = edit.clear_tool_inputs
    return inputs is True or (isinstance(inputs, list) and name in inputs)


def cleared(body: MessagesPrompt, edit: ClearToolUsesEdit) -> tuple[MessagesPrompt, int]:
    """``body`` with the edit applied, and how many tool uses it cleared."""
    excluded = set(edit.exclude_tools or [])
    uses = [
        b
        for m in body.messages
        if m.role == "assistant" and not isinstance(m.content, str)
        for b in m.content
        if isinstance(b, ToolUseBlock) and b.name not in excluded
    ]
    keep = _value(edit.keep, DEFAULT_KEEP)
    gone = {b.id: b.name for b in uses[: max(len(uses) - keep, 0)]}
    if not gone:
        return body, 0
    messages = [_cleared_turn(m, gone, edit) for m in body.messages]
    return body.model_copy(update={"messages": messages}), len(gone)


def _cleared_turn(
    message: InputMessage, gone: dict[str, str], edit: ClearToolUsesEdit
) -> InputMessage:
    if isinstance(message.content, str):
        return message
    blocks = []
    for block in message.content:
        if isinstance(block, ToolResultBlock) and block.tool_use_id in gone:
            block = block.model_copy(update={"content": CLEARED, "is_error": None})
        elif (
            isinstance(block, ToolUseBlock) and block.id in gone and _clears_input(edit, block.name)
        ):
            block = block.model_copy(update={"input": {}})
        blocks.append(block)
    return message.model_copy(update={"content": blocks})
