"""The content blocks of a Messages request's turns: text, tool_use (an assistant's call),
tool_result (a user's answer to it), thinking and redacted_thinking (an earlier turn's, kept by
clients: accepted, not shown to the model), image (a user's: base64 or a link). Documents are
refused with a 400 that says so; so is any other block type. A ``system`` turn inside ``messages`` (a mid-conversation
system message) holds text alone. Unknown fields of a block (``citations``, ``caller``, ...)
are accepted and ignored: clients send back the blocks they got; ``cache_control`` marks a
breakpoint (request.MessagesPrompt.cache_marked)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

# Block types llmq reads, by where they may stand.
_TEXT_TYPES = ("text",)
_TURN_TYPES = ("text", "image", "tool_use", "tool_result", "thinking", "redacted_thinking")
_MEDIA_TYPES = ("document",)


def check_block_types(value: Any, allowed: tuple[str, ...], where: str) -> Any:
    """A list of blocks whose types are all served (a clear 400 for the others)."""
    if not isinstance(value, list):
        return value
    for block in value:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind in allowed or not isinstance(kind, str):
            continue  # a block without a type: the union's own error names it
        if kind in _MEDIA_TYPES:
            raise ValueError(
                f"{kind} content blocks are not supported by this server: it serves text "
                "models (send the content as text)"
            )
        raise ValueError(
            f"content blocks of type {kind!r} are not supported {where} (served: "
            f"{', '.join(allowed)})"
        )
    return value


class Block(BaseModel):
    model_config = ConfigDict(extra="allow")


class TextBlock(Block):
    type: Literal["text"]
    text: str


class Base64Source(Block):
    type: Literal["base64"]
    media_type: str
    data: str


class URLSource(Block):
    type: Literal["url"]
    url: str


class ImageBlock(Block):
    type: Literal["image"]
    source: Annotated[Base64Source | URLSource, Field(discriminator="type")]

    def chat_part(self) -> dict[str, Any]:
        """The block as chat's image_url part (base64 as a data URL)."""
        source = self.source
        if isinstance(source, URLSource):
            url = source.url
        else:
            url = f"data:{source.media_type};base64,{source.data}"
        return {"type": "image_url", "image_url": {"url": url}}


class ToolUseBlock(Block):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(Block):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_content(cls, v):
        return check_block_types(v, _TEXT_TYPES, "in a tool_result")

    def text(self) -> str:
        """The result as the model reads it; an error says that it is one."""
        if self.content is None:
            text = ""
        elif isinstance(self.content, str):
            text = self.content
        else:
            text = "".join(b.text for b in self.content)
        return f"Error: {text}" if self.is_error else text


class ThinkingBlock(Block):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(Block):
    type: Literal["redacted_thinking"]
    data: str


ContentBlock = Annotated[
    TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]


Effort = Literal["low", "medium", "high", "xhigh", "max"]


class TurnConfig(BaseModel):
    """A turn's own ``output_config`` (per-turn control): the effort from that turn on."""

    model_config = ConfigDict(extra="forbid")
    effort: Effort | None = None


class InputMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]
    output_config: TurnConfig | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _served_blocks(cls, v):
        return check_block_types(v, _TURN_TYPES, "in messages")

    @field_validator("content")
    @classmethod
    def _blocks_of_role(cls, v, info):
        role = info.data.get("role")
        for block in v if isinstance(v, list) else []:
            if role == "user" and block.type in ("tool_use", "thinking", "redacted_thinking"):
                raise ValueError(f"a user turn cannot hold {block.type} blocks")
            if role == "assistant" and block.type in ("tool_result", "image"):
                raise ValueError(f"an assistant turn cannot hold {block.type} blocks")
            if role == "system" and block.type != "text":
                raise ValueError(f"a system turn holds text blocks only, not {block.type}")
        return v

    def text(self) -> str:
        """The turn's text blocks joined (a system turn's whole content)."""
        if isinstance(self.content, str):
            return self.content
        return "".join(b.text for b in self.content if isinstance(b, TextBlock))


class SystemTextBlock(Block):
    type: Literal["text"]
    text: str
