"""The body of POST /v1/chat/completions: messages (rendered by the model's chat template) and
what only chat takes."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic.json_schema import SkipJsonSchema

from llmq.common.generation.request_bodies import MAX_TOP_LOGPROBS, SamplingFields, refuse


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    # The schema asks for content: only an assistant turn may leave it out.
    model_config = ConfigDict(extra="allow", json_schema_extra={"required": ["role", "content"]})
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | SkipJsonSchema[None] = Field(None, validate_default=True)
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _content(cls, v, info: ValidationInfo):
        # Only an assistant turn may come without content (OpenAI: one that called tools).
        if v is None and info.data.get("role") not in (None, "assistant"):
            raise ValueError(f"a {info.data['role']} message needs content")
        return v

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


# Chat fields refused when set, with what they would ask for.
_CHAT_REFUSED = {
    "functions": "function calling",
    "audio": "audio output",
    "echo": "echo on chat completions",
}


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    # Refused, not ignored: a caller relying on tool calls must not get free text back as if it
    # were that. Left out of the OpenAPI schema: nothing they describe is served.
    tool_choice: SkipJsonSchema[str | dict[str, Any] | None] = None  # before tools: read there
    tools: SkipJsonSchema[list[dict[str, Any]] | None] = None
    functions: SkipJsonSchema[list[dict[str, Any]] | None] = None
    modalities: SkipJsonSchema[list[str] | None] = None
    audio: SkipJsonSchema[dict[str, Any] | None] = None
    echo: SkipJsonSchema[bool] = False
    add_generation_prompt: SkipJsonSchema[bool] = Field(
        True, description="End the prompt with the assistant turn's opening (vLLM's option)."
    )
    continue_final_message: SkipJsonSchema[bool] = Field(
        False,
        description="Continue the final (assistant) message instead of starting a new one; "
        "needs add_generation_prompt: false (vLLM's option).",
    )

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v):
        if v not in (None, "none", "auto"):
            raise ValueError(
                "tool calling is not supported by this server; tool_choice may be 'none' or 'auto'"
            )
        return v

    @field_validator("modalities")
    @classmethod
    def _text_modality(cls, v):
        if v and any(m != "text" for m in v):
            raise ValueError("only the 'text' modality is served")
        return v

    @field_validator("continue_final_message")
    @classmethod
    def _continue(cls, v, info: ValidationInfo):
        if v and info.data.get("add_generation_prompt", True):
            raise ValueError("continue_final_message needs add_generation_prompt: false")
        if v and info.data.get("messages") and info.data["messages"][-1].role != "assistant":
            raise ValueError("continue_final_message needs an assistant message last")
        return v

    @field_validator("tools")
    @classmethod
    def _no_tool_calls(cls, v, info: ValidationInfo):
        if v and info.data.get("tool_choice") != "none":
            raise ValueError(
                "tool calling is not supported by this server; send no tools, or tool_choice "
                "'none' for a text answer"
            )
        return v

    @field_validator(*_CHAT_REFUSED)
    @classmethod
    def _refused(cls, v, info: ValidationInfo):
        return refuse(v, _CHAT_REFUSED[info.field_name])

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, v, info: ValidationInfo):
        # A field validator (not a model one), so the error names the field: param "top_logprobs".
        if v is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs requires logprobs: true")
        return v

    def wanted_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens else "max_tokens"

    def template_kwargs(self) -> dict[str, bool]:
        return {
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
        }

    def wanted_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_messages(self) -> list[dict[str, Any]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]
