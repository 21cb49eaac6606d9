"""A Messages request's tools: client tools (``name``, ``description``, ``input_schema``) as
chat function tools, and ``tool_choice`` (auto, any, tool, none) as chat's (auto, required, a
named function, none), ``disable_parallel_tool_use`` as ``parallel_tool_calls: false``.
Server tools (``web_search_*``, ``bash_*``, ``code_execution_*``, ...) run on Anthropic's side
and are refused with a 400."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# Anthropic's rule for tool names.
ToolName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,128}$")]


def check_client_tools(value: Any) -> Any:
    """Only client tools (no ``type``, or ``custom``) are served."""
    if not isinstance(value, list):
        return value
    server = sorted(
        {
            str(t["type"])
            for t in value
            if isinstance(t, dict) and t.get("type") not in (None, "custom")
        }
    )
    if server:
        raise ValueError(
            f"server tools are not supported by this server: {', '.join(server)} (only client "
            "tools, with a name and an input_schema, are served)"
        )
    return value


class ToolDefinition(BaseModel):
    """A client tool; its other fields (``cache_control``, ``input_examples``,
    ``defer_loading``, ...) are accepted and ignored."""

    model_config = ConfigDict(extra="allow")
    type: Literal["custom"] | None = None
    name: ToolName
    description: str | None = None
    input_schema: dict[str, Any]
    strict: bool | None = None

    def chat_tool(self) -> dict[str, Any]:
        function: dict[str, Any] = {"name": self.name, "parameters": self.input_schema}
        if self.description is not None:
            function["description"] = self.description
        if self.strict is not None:
            function["strict"] = self.strict
        return {"type": "function", "function": function}


class _Choice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    disable_parallel_tool_use: bool | None = None


class AutoChoice(_Choice):
    type: Literal["auto"]


class AnyChoice(_Choice):
    type: Literal["any"]


class ToolChoiceByName(_Choice):
    type: Literal["tool"]
    name: str


class NoneChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["none"]
    disable_parallel_tool_use: None = None


ToolChoice = Annotated[
    AutoChoice | AnyChoice | ToolChoiceByName | NoneChoice, Field(discriminator="type")
]


def chat_tool_choice(choice: ToolChoice) -> str | dict[str, Any]:
    """The chat ``tool_choice`` asking for the same: any is "required", tool a named function."""
    if isinstance(choice, ToolChoiceByName):
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def forces_a_call(choice: ToolChoice | None) -> bool:
    return isinstance(choice, (AnyChoice, ToolChoiceByName))
