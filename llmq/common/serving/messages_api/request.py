"""The bodies of POST /v1/messages and /v1/messages/count_tokens. As Anthropic's API, an
unknown top-level field is a 400 ("Extra inputs are not permitted"); fields that ask for what
llmq does not serve (a container, MCP servers, server tools, images) are refused with a 400
naming them, and the ones that change nothing here (``service_tier``, ``speed``,
``inference_geo``, ...) are accepted and ignored. ``cache_control`` breakpoints change no
prompt (the prefix cache keeps every prompt's blocks, marked or not) and make the answer's
usage count the cache writes (objects.message_usage).
``output_config.effort`` is passed to a chat template that has ``reasoning_effort`` and accepted
otherwise (the answer says it was not applied: translate.py); ``context_management`` edits
are validated and applied where they change llmq's prompt (context_edits.py). One top-level
field is llmq's own: ``speculative`` (false: no speculative decoding for the request)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    field_validator,
    model_validator,
)
from pydantic.json_schema import SkipJsonSchema

from llmq.common.serving.messages_api.content import (
    Effort,
    InputMessage,
    SystemTextBlock,
    check_block_types,
)
from llmq.common.serving.messages_api.tools import (
    ToolChoice,
    ToolChoiceByName,
    ToolDefinition,
    check_client_tools,
    forces_a_call,
)
from llmq.common.serving.request_bodies import MAX_STOPS

# Anthropic's least thinking budget.
MIN_THINKING_BUDGET = 1024
# output_config.effort as chat's reasoning_effort (whose highest level is "high").
EFFORTS = {"low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}


class ThinkingEnabled(BaseModel):
    """``budget_tokens`` is validated as Anthropic's (at least 1024, below max_tokens); the
    thinking counts against ``max_tokens``, which bounds it with the answer."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["enabled"]
    budget_tokens: Annotated[int, Field(ge=MIN_THINKING_BUDGET)]
    display: Literal["summarized", "omitted"] | None = None


class ThinkingAdaptive(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["adaptive"]
    display: Literal["summarized", "omitted"] | None = None


class ThinkingDisabled(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["disabled"]


Thinking = Annotated[
    ThinkingEnabled | ThinkingAdaptive | ThinkingDisabled, Field(discriminator="type")
]


class JsonOutputFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: JsonOutputFormat | None = None
    effort: Effort | None = None


class ClearThinkingEdit(BaseModel):
    """Which earlier turns keep their thinking: llmq never shows an earlier turn's thinking to
    the model (as chat templates drop it), so every setting leaves the prompt as it is."""

    model_config = ConfigDict(extra="allow")
    type: Annotated[str, Field(pattern=r"^clear_thinking_\d{8}$")]
    keep: Any = None


class ClearToolUsesEdit(BaseModel):
    """Tool results cleared, oldest first, once the prompt passes ``trigger`` input tokens
    (Anthropic's default 100,000), all but the last ``keep`` tool uses (default 3)."""

    model_config = ConfigDict(extra="forbid")
    type: Annotated[str, Field(pattern=r"^clear_tool_uses_\d{8}$")]
    trigger: dict[str, Any] | None = None
    keep: dict[str, Any] | None = None
    clear_at_least: dict[str, Any] | None = None
    exclude_tools: list[str] | None = None
    clear_tool_inputs: bool | list[str] | None = None


def _edit_type(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    if isinstance(kind, str) and kind.startswith("clear_thinking_"):
        return "thinking"
    if isinstance(kind, str) and kind.startswith("clear_tool_uses_"):
        return "tool_uses"
    return None


ContextEdit = Annotated[
    Annotated[ClearThinkingEdit, Tag("thinking")] | Annotated[ClearToolUsesEdit, Tag("tool_uses")],
    Discriminator(_edit_type),
]


class ContextManagement(BaseModel):
    model_config = ConfigDict(extra="forbid")
    edits: list[ContextEdit] = []

    @field_validator("edits", mode="before")
    @classmethod
    def _served_edits(cls, v):
        for edit in v if isinstance(v, list) else []:
            if _edit_type(edit) is None:
                kind = edit.get("type") if isinstance(edit, dict) else None
                raise ValueError(
                    f"context_management edits of type {kind!r} are not supported (served: "
                    "clear_thinking_*, clear_tool_uses_*)"
                )
        return v


class MessagesPrompt(BaseModel):
    """What renders the prompt: the body of count_tokens, and the start of a message's."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, description="Model to use; default: the one served.")
    messages: Annotated[list[InputMessage], Field(min_length=1)]
    system: str | list[SystemTextBlock] | None = None
    # Tools and what constrains the output stay out of the OpenAPI schema, as on chat: a
    # generated request's random schemas and names would mostly be 400s.
    tools: SkipJsonSchema[list[ToolDefinition] | None] = None
    tool_choice: SkipJsonSchema[ToolChoice | None] = None
    thinking: SkipJsonSchema[Thinking | None] = None
    output_config: SkipJsonSchema[OutputConfig | None] = None
    context_management: SkipJsonSchema[ContextManagement | None] = None
    mcp_servers: SkipJsonSchema[list[Any] | None] = None
    cache_control: SkipJsonSchema[dict[str, Any] | None] = None  # a breakpoint: cache_marked
    speed: SkipJsonSchema[Literal["standard", "fast"] | None] = None  # accepted, ignored
    user_profile_id: SkipJsonSchema[str | None] = None  # accepted, ignored
    workspace_id: SkipJsonSchema[str | None] = None  # accepted, ignored

    @field_validator("system", mode="before")
    @classmethod
    def _system_text(cls, v):
        return check_block_types(v, ("text",), "in system")

    @field_validator("tools", mode="before")
    @classmethod
    def _client_tools(cls, v):
        return check_client_tools(v)

    @field_validator("tools")
    @classmethod
    def _distinct_tools(cls, v: list[ToolDefinition] | None):
        names = [t.name for t in v or []]
        if len(set(names)) < len(names):
            raise ValueError("tools must have distinct names")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _choice_of_tools(cls, v, info):
        tools = info.data.get("tools") or []
        if forces_a_call(v) and not tools:
            raise ValueError(f"tool_choice of type {v.type!r} needs tools")
        if isinstance(v, ToolChoiceByName) and v.name not in {t.name for t in tools}:
            raise ValueError(f"tool_choice names the tool {v.name!r}, which is not in tools")
        return v

    @field_validator("mcp_servers")
    @classmethod
    def _no_mcp(cls, v):
        if v:
            raise ValueError("MCP servers are not supported by this server")
        return v

    def system_text(self) -> str | None:
        if self.system is None or isinstance(self.system, str):
            return self.system or None
        return "".join(b.text for b in self.system) or None

    def effort(self) -> str | None:
        """The effort asked for: the last turn's own (per-turn control), else the request's."""
        for message in reversed(self.messages):
            if message.output_config is not None and message.output_config.effort is not None:
                return message.output_config.effort
        return self.output_config.effort if self.output_config is not None else None

    def cache_marked(self) -> bool:
        """Whether any ``cache_control`` breakpoint is set (on the request, the system prompt,
        a tool or a content block)."""
        if self.cache_control is not None:
            return True
        blocks = [*(self.system if isinstance(self.system, list) else []), *(self.tools or [])]
        for message in self.messages:
            blocks += message.content if isinstance(message.content, list) else []
        return any((b.model_extra or {}).get("cache_control") for b in blocks)

    def forced_call(self) -> bool:
        return bool(self.tools) and forces_a_call(self.tool_choice)


class MessagesRequest(MessagesPrompt):
    max_tokens: Annotated[int, Field(ge=1)]
    stop_sequences: list[str] | None = Field(None, max_length=MAX_STOPS)
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    service_tier: SkipJsonSchema[Literal["auto", "standard_only"] | None] = None  # one tier
    container: SkipJsonSchema[Any] = None
    inference_geo: SkipJsonSchema[str | None] = None  # accepted, ignored
    diagnostics: SkipJsonSchema[dict[str, Any] | None] = None  # accepted, ignored
    # llmq's own, as on chat (the SDK's extra_body): false turns speculative decoding off.
    speculative: SkipJsonSchema[bool] = True

    @field_validator("container")
    @classmethod
    def _no_container(cls, v):
        if v is not None:
            raise ValueError("containers (code execution) are not supported by this server")
        return v

    @model_validator(mode="after")
    def _budget_below_max_tokens(self):
        thinking = self.thinking
        if isinstance(thinking, ThinkingEnabled) and thinking.budget_tokens >= self.max_tokens:
            raise ValueError("thinking.budget_tokens must be less than max_tokens")
        return self

    def user(self) -> str | None:
        user = (self.metadata or {}).get("user_id")
        return user if isinstance(user, str) else None
