"""The bodies of Ollama's routes: what llmq serves of them, and the 400 for what it does not
(a Go template of one's own, a suffix, the deprecated token context, logprobs)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic.json_schema import SkipJsonSchema

from llmq.common.serving.ollama_api.options import OllamaOptions
from llmq.common.serving.request_bodies import MAX_INPUTS
from llmq.common.serving.tool_request import FunctionTool

ThinkLevel = Literal["low", "medium", "high"]
# "json", or a JSON schema the output follows ("" or null: free text).
Format = Literal["", "json"] | dict[str, Any]
KeepAlive = str | float | None  # accepted: workers keep their model loaded while they run


def refuse(value, message: str):
    """Refused, not ignored: a caller relying on the field must not get an answer without it."""
    if value:
        raise ValueError(message)
    return value


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)


class OllamaToolCall(BaseModel):
    """A call of an earlier assistant turn: its arguments an object, as Ollama sends them."""

    model_config = ConfigDict(extra="allow")
    id: str | None = None
    function: ToolCallFunction


class OllamaMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = ""  # null: empty (an assistant turn of calls alone)
    thinking: str | None = None  # an earlier turn's thinking: not shown to the template again
    images: list[str] | None = None  # base64, each an image shown after the content
    tool_calls: SkipJsonSchema[list[OllamaToolCall] | None] = None
    tool_name: str | None = None  # a tool message: the function whose result it is


class GenerationBody(BaseModel):
    """What /api/chat and /api/generate share. Unknown fields are accepted and ignored."""

    model_config = ConfigDict(extra="allow")

    model: str | None = Field(None, description="Model to use; default: the one served.")
    stream: bool = True
    options: OllamaOptions | None = None
    # Out of the OpenAPI schema, as chat's response_format: a generated schema is mostly a 400.
    format: SkipJsonSchema[Format | None] = None
    keep_alive: KeepAlive = None
    think: bool | ThinkLevel | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v):
        return refuse(v, "logprobs are not served on Ollama's API: use /v1/chat/completions")


class ChatBody(GenerationBody):
    messages: list[OllamaMessage] = Field(default_factory=list)  # none: load the model
    # Ollama's tool shape is OpenAI's (``function`` with name, description, parameters).
    tools: SkipJsonSchema[list[FunctionTool] | None] = None


class GenerateBody(GenerationBody):
    prompt: str = ""  # empty: load the model
    system: str | None = None
    raw: bool = False
    suffix: str | None = None
    template: str | None = None
    context: list[int] | None = None
    images: list[str] | None = None  # base64, each an image shown after the prompt

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v):
        return refuse(v, "suffix (fill-in-the-middle) is not supported by this server")

    @field_validator("template")
    @classmethod
    def _no_template(cls, v):
        return refuse(
            v,
            "template is not supported: prompts are rendered with the model's own chat "
            "template; send raw: true with a prompt of your own instead",
        )

    @field_validator("context")
    @classmethod
    def _no_context(cls, v):
        return refuse(
            v, "context (deprecated) is not supported: send the conversation to /api/chat"
        )


class EmbedBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = Field(None, description="Model to use; default: the one served.")
    input: str | Annotated[list[str], Field(max_length=MAX_INPUTS)] = ""
    truncate: bool = True  # false: an input over the model's limit is a 400
    dimensions: Annotated[int, Field(ge=1)] | None = None
    options: OllamaOptions | None = None
    keep_alive: KeepAlive = None


class LegacyEmbeddingsBody(BaseModel):
    """/api/embeddings: one prompt, one vector."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str = ""
    options: OllamaOptions | None = None
    keep_alive: KeepAlive = None


class ShowBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = Field(None, description="The model (``name`` in older clients).")
    name: SkipJsonSchema[str | None] = None
    verbose: bool = False

    def model_name(self) -> str | None:
        return self.model or self.name
