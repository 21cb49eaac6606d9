"""The body of POST /v1/responses: what llmq serves of it, and the 400 for what it does not.
Function tools are served, and so are ``namespace`` tools, as their inner functions (a call of
one names its namespace). Hosted tools, which run on OpenAI's side (``web_search``,
``file_search``, ``code_interpreter``, ...), are dropped from the request with a log line (the
model is not offered them) unless ``tool_choice`` forces one: then a 400 names it. Other tool
types, and tool choices other than a function, are a 400."""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.json_schema import SkipJsonSchema

from llmq.common.serving.tool_request import FunctionName

MAX_METADATA_KEYS = 16
# Tools that run on OpenAI's side, which llmq cannot run: dropped unless forced.
HOSTED_TOOLS = frozenset(
    {
        "web_search",
        "web_search_preview",
        "web_search_2025_08_26",
        "web_search_preview_2025_03_11",
        "file_search",
        "code_interpreter",
        "computer_use",
        "computer_use_preview",
        "image_generation",
        "mcp",
        "tool_search",
    }
)
log = logging.getLogger(__name__)


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


class ResponsesNamespaceTool(BaseModel):
    """A group of function tools under one name (Codex's ``multi_agent_v1``): the model is
    offered the inner functions; a call of one answers with their ``namespace``."""

    model_config = ConfigDict(extra="allow")
    type: Literal["namespace"]
    name: str
    description: str | None = None
    tools: list[ResponsesFunctionTool]


ResponsesTool = Annotated[
    ResponsesFunctionTool | ResponsesNamespaceTool, Field(discriminator="type")
]


def _served_tools(value: list) -> list:
    """The tools without the hosted ones (logged); a 400 for any other type not served."""
    hosted = sorted({_tool_type(t) for t in value if _tool_type(t) in HOSTED_TOOLS})
    if hosted:
        log.info("tools: hosted tools dropped (this server cannot run them): %s", hosted)
    served = [t for t in value if _tool_type(t) not in HOSTED_TOOLS]
    other = sorted({_tool_type(t) for t in served} - {"function", "namespace"})
    if other:
        raise ValueError(
            f"tools of type {', '.join(other)} are not served: only function and namespace "
            "tools (hosted tools such as web_search are dropped unless tool_choice forces one)"
        )
    return served


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


def _functions(tool: ResponsesFunctionTool | ResponsesNamespaceTool) -> list[ResponsesFunctionTool]:
    return tool.tools if isinstance(tool, ResponsesNamespaceTool) else [tool]


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
    tools: SkipJsonSchema[list[ResponsesTool] | None] = None
    tool_choice: SkipJsonSchema[Literal["none", "auto", "required"] | NamedFunctionChoice] = "auto"
    parallel_tool_calls: SkipJsonSchema[bool] = True
    text: SkipJsonSchema[TextConfig | None] = None
    background: SkipJsonSchema[bool] = False
    # llmq's own, as on chat (the SDK's extra_body): false turns speculative decoding off.
    speculative: SkipJsonSchema[bool] = True

    @field_validator("tools", mode="before")
    @classmethod
    def _served_tools_only(cls, v):
        return _served_tools(v) if isinstance(v, list) else v

    @field_validator("tools")
    @classmethod
    def _distinct_functions(cls, v):
        names = [f.name for t in v or [] for f in _functions(t)]
        if len(set(names)) < len(names):
            raise ValueError(
                "the functions of tools (namespaces' included) must have distinct names"
            )
        return v

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _function_choice_only(cls, v):
        kind = v.get("type") if isinstance(v, dict) else None
        if kind in HOSTED_TOOLS:
            raise ValueError(
                f"tool_choice forces the hosted tool {kind!r}, which this server cannot run"
            )
        if isinstance(v, dict) and kind != "function":
            raise ValueError(
                f"tool_choice of type {kind!r} is not served: only 'none', 'auto', "
                "'required' or a function"
            )
        return v

    @model_validator(mode="after")
    def _tools_left_to_force(self):
        if self.tool_choice == "required" and not self.functions():
            raise ValueError(
                "tool_choice 'required' needs a function tool; hosted tools are not served"
            )
        return self

    def functions(self) -> list[ResponsesFunctionTool]:
        """The functions offered to the model (namespaces' inner ones in their place)."""
        return [f for t in self.tools or [] for f in _functions(t)]

    def namespaces(self) -> dict[str, str]:
        """Each namespaced function's namespace, by the function's name."""
        return {
            f.name: t.name
            for t in self.tools or []
            if isinstance(t, ResponsesNamespaceTool)
            for f in t.tools
        }

    @model_validator(mode="after")
    def _background_stored(self):
        # A background response is polled and resumed from its stored copy (OpenAI's rule).
        if self.background and not self.store:
            raise ValueError("background responses need store=true")
        return self

    def tool_names(self) -> set[str]:
        return {f.name for f in self.functions()}
