"""The body of POST /v1/responses: what llmq serves of it, and the 400 for what it does not
(built-in tools, tool choices other than a function)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic.json_schema import SkipJsonSchema

from llmq.common.generation.tool_request import FunctionName

MAX_METADATA_KEYS = 16


class ResponsesFunctionTool(BaseModel):
    """The Responses shape of a function tool: its fields at the top, not under ``function``."""

    model_config = ConfigDict(extra="allow")
    type: Literal["function"]
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def chat_tool(self) -> dict[str, Any]:
        function = {"name": self.name, "description": self.description}
        function |= {"parameters": self.parameters, "strict": self.strict}
        return {
            "type": "function",
            "function": {k: v for k, v in function.items() if v is not None},
        }


class NamedFunctionChoice(BaseModel):
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    """``text.format``: text, json_object, or json_schema with its name and schema at the top."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None

    def response_format(self) -> dict[str, Any]:
        """The chat ``response_format`` asking for the same output."""
        if self.type != "json_schema":
            return {"type": self.type}
        if self.json_schema is None:
            raise ValueError("text.format of type 'json_schema' needs a schema")
        spec = {"name": self.name or "response", "schema": self.json_schema, "strict": self.strict}
        return {"type": "json_schema", "json_schema": spec}


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="allow")
    format: TextFormat = TextFormat()


def _tool_type(tool: Any) -> str:
    return str(tool.get("type")) if isinstance(tool, dict) else type(tool).__name__


class ResponsesRequest(BaseModel):
    """Unknown fields are accepted and ignored (clients send extras), except the ones that
    would change the answer (see the validators)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = Field(None, description="Model to use; default: the one served.")
    input: str | Annotated[list[dict[str, Any]], Field(min_length=1)]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = Field(None, max_length=MAX_METADATA_KEYS)
    user: str | None = None
    # Tools, as on chat, stay out of the OpenAPI schema (a generated request's random schemas
    # and names would mostly be 400s); text.format with them (structured output's own rules).
    tools: SkipJsonSchema[list[ResponsesFunctionTool] | None] = None
    tool_choice: SkipJsonSchema[Literal["none", "auto", "required"] | NamedFunctionChoice] = "auto"
    parallel_tool_calls: SkipJsonSchema[bool] = True
    text: SkipJsonSchema[TextConfig | None] = None
    background: SkipJsonSchema[bool] = False

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools_only(cls, v):
        if isinstance(v, list):
            built_in = [t for t in v if _tool_type(t) != "function"]
            if built_in:
                names = sorted({_tool_type(t) for t in built_in})
                raise ValueError(
                    f"only function tools are served; built-in tools are not: {', '.join(names)}"
                )
        return v

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _function_choice_only(cls, v):
        if isinstance(v, dict) and v.get("type") != "function":
            raise ValueError(
                f"tool_choice of type {v.get('type')!r} is not served: only 'none', 'auto', "
                "'required' or a function"
            )
        return v

    @field_validator("background")
    @classmethod
    def _foreground(cls, v):
        if v:
            raise ValueError("background responses are not supported by this server")
        return v

    def tool_names(self) -> set[str]:
        return {t.name for t in self.tools or []}
