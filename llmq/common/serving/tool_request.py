"""What a chat request says about tools: the function tools offered, which of them the model
must call (``tool_choice``), and the calls and results of earlier turns in its history."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

# OpenAI's rule for function names.
FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none: no arguments
    strict: bool | None = None

    def schema(self) -> dict[str, Any]:
        """The schema of the arguments (an object with no properties when none is given)."""
        return self.parameters or {"type": "object", "properties": {}}


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(BaseModel):
    name: str
    arguments: str  # the JSON text of an object, as OpenAI sends it

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, v: str) -> str:
        try:
            parsed = json.loads(v)
        except ValueError:
            raise ValueError("arguments must be the JSON text of an object") from None
        if not isinstance(parsed, dict):
            raise ValueError("arguments must be the JSON text of an object")
        return v


class AssistantToolCall(BaseModel):
    """A call in an earlier assistant turn."""

    model_config = ConfigDict(extra="allow")
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction

    def template_dict(self) -> dict[str, Any]:
        # Templates read the arguments as a mapping (as vLLM hands them over).
        function = {"name": self.function.name, "arguments": json.loads(self.function.arguments)}
        return {"id": self.id, "type": "function", "function": function}


def check_tool_history(messages: list) -> None:
    """Each tool message answers a call of an earlier assistant turn (its ``tool_call_id``, when
    given, one of that turn's call ids)."""
    calls: set[str] | None = None  # the ids of the latest assistant turn's calls
    for i, m in enumerate(messages):
        if m.role == "assistant":
            calls = {c.id for c in m.tool_calls} if m.tool_calls else None
        elif m.role == "tool":
            if calls is None:
                raise ValueError(f"messages[{i}] is a tool message with no tool call before it")
            if m.tool_call_id is not None and m.tool_call_id not in calls:
                raise ValueError(
                    f"messages[{i}].tool_call_id {m.tool_call_id!r} answers no call of the "
                    "assistant message before it"
                )
        elif m.tool_calls:
            raise ValueError(f"messages[{i}]: only assistant messages carry tool_calls")


def forced_tool_name(choice: ToolChoice | None) -> str | None:
    return choice.function.name if isinstance(choice, NamedToolChoice) else None
