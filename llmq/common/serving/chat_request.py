"""The body of POST /v1/chat/completions: messages (rendered by the model's chat template) and
what only chat takes."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic.json_schema import SkipJsonSchema, WithJsonSchema

from llmq.common.serving.request_bodies import MAX_TOP_LOGPROBS, SamplingFields, refuse
from llmq.common.serving.tool_request import (
    AssistantToolCall,
    FunctionTool,
    ToolChoice,
    check_tool_history,
    forced_tool_name,
)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    model_config = ConfigDict(extra="allow")
    url: str  # a data URL (data:image/png;base64,...) or an http(s) link
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["image_url"]
    image_url: ImageURL

    @field_validator("image_url", mode="before")
    @classmethod
    def _bare_url(cls, v):
        return {"url": v} if isinstance(v, str) else v  # vLLM takes the URL as a string too


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class ChatMessage(BaseModel):
    # The schema asks for content: only an assistant turn may leave it out.
    model_config = ConfigDict(extra="allow", json_schema_extra={"required": ["role", "content"]})
    # A tool message answers an assistant turn's tool_calls, which the OpenAPI schema leaves
    # out (as it does tools): the schema leaves the "tool" role out with them.
    role: Annotated[
        Literal["system", "user", "assistant", "tool", "developer"],
        WithJsonSchema({"enum": ["system", "user", "assistant", "developer"], "type": "string"}),
    ]
    content: str | list[ContentPart] | SkipJsonSchema[None] = Field(None, validate_default=True)
    name: str | None = None
    # Out of the OpenAPI schema, as the tools are (see ChatCompletionRequest).
    tool_calls: SkipJsonSchema[list[AssistantToolCall] | None] = None  # an assistant's calls
    tool_call_id: SkipJsonSchema[str | None] = None  # a tool message: the call it answers

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
        return "".join(p.text for p in self.content if isinstance(p, TextPart))

    def images(self) -> list[ImagePart]:
        if not isinstance(self.content, list):
            return []
        return [p for p in self.content if isinstance(p, ImagePart)]

    def template_content(self) -> str | list[dict[str, str]]:
        """The text, or with images the parts as vision chat templates read them, in order."""
        if not self.images():
            return self.text()
        return [
            {"type": "text", "text": p.text} if isinstance(p, TextPart) else {"type": "image"}
            for p in self.content or ()
        ]

    def template_dict(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": self.role, "content": self.template_content()}
        if self.tool_calls:
            message["tool_calls"] = [c.template_dict() for c in self.tool_calls]
        if self.role == "tool":
            if self.tool_call_id is not None:
                message["tool_call_id"] = self.tool_call_id
            if self.name is not None:
                message["name"] = self.name
        return message


# Chat fields refused when set, with what they would ask for.
_CHAT_REFUSED = {
    "functions": "function calling",
    "audio": "audio output",
    "echo": "echo on chat completions",
}


# apply_chat_template's own arguments, which chat_template_kwargs must not set: the body's
# fields set them.
_TEMPLATE_CALL_ARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "tokenize",
        "return_dict",
        "return_tensors",
        "padding",
        "truncation",
        "max_length",
        "tokenizer_kwargs",
        "return_assistant_tokens_mask",
        "add_generation_prompt",
        "continue_final_message",
    }
)

# Structured-output fields (on SamplingFields) besides response_format: each constrains the
# output, which a forced tool call constrains already.
_CONSTRAINT_FIELDS = (
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    return_tokens_as_token_ids: SkipJsonSchema[bool] = Field(
        False, description="Logprobs' tokens as 'token_id:{id}' (vLLM's option)."
    )
    # Tools stay out of the OpenAPI schema, as before they were served: requests generated
    # from it would mostly be 400s (random schemas and names).
    tools: SkipJsonSchema[list[FunctionTool] | None] = None  # before tool_choice: read there
    tool_choice: SkipJsonSchema[ToolChoice | None] = None  # unset: auto with tools, else none
    parallel_tool_calls: SkipJsonSchema[bool] = True
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

    chat_template_kwargs: SkipJsonSchema[dict[str, Any] | None] = Field(
        None, description="Variables for the chat template, e.g. enable_thinking (vLLM's option)."
    )
    # Out of the OpenAPI schema, as the tools: most models' templates refuse it (400s).
    reasoning_effort: SkipJsonSchema[Literal["none", "minimal", "low", "medium", "high"] | None] = (
        Field(
            None,
            description="How much a reasoning model thinks: passed to a chat template that reads "
            "reasoning_effort, refused (400) by one that does not.",
        )
    )
    include_reasoning: SkipJsonSchema[bool] = Field(
        True, description="false: the thinking is left out of the answer (vLLM's option)."
    )
    thinking_budget: SkipJsonSchema[int | None] = Field(
        None,
        ge=1,
        description="Most tokens a reasoning model thinks before it must close its think block "
        "(Anthropic's thinking.budget_tokens); enforced by constrained decoding.",
    )

    @field_validator("chat_template_kwargs")
    @classmethod
    def _own_template_kwargs(cls, v: dict[str, Any] | None):
        taken = sorted(set(v or ()) & _TEMPLATE_CALL_ARGS)
        if taken:
            raise ValueError(f"chat_template_kwargs cannot set {', '.join(taken)}")
        return v

    @field_validator("messages")
    @classmethod
    def _tool_history(cls, v: list[ChatMessage]) -> list[ChatMessage]:
        check_tool_history(v)
        return v

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v, info: ValidationInfo):
        if v in (None, "none", "auto"):
            return v
        tools = info.data.get("tools") or []
        if not tools:
            raise ValueError("tool_choice 'required' or a named function needs tools")
        name = forced_tool_name(v)
        if name is not None and name not in {t.function.name for t in tools}:
            raise ValueError(f"tool_choice names the function {name!r}, which is not in tools")
        constrained = [f for f in _CONSTRAINT_FIELDS if info.data.get(f) is not None]
        response_format = info.data.get("response_format")
        if response_format is not None and response_format.type != "text":
            constrained.insert(0, "response_format")
        if constrained:
            raise ValueError(
                "tool_choice 'required' or a named function cannot be combined with "
                f"{' or '.join(constrained)}: the calls are the constrained output"
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
    def _distinct_tools(cls, v: list[FunctionTool] | None):
        names = [t.function.name for t in v or []]
        if len(set(names)) < len(names):
            raise ValueError("tools must have distinct function names")
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

    def template_kwargs(self) -> dict[str, Any]:
        return {
            **(self.chat_template_kwargs or {}),
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
        }

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template reads them (OpenAI's shape), or None."""
        if not self.tools:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def tool_mode(self) -> str | None:
        """None (no tools: plain text), "none", "auto", "required" or "named"."""
        if not self.tools:
            return None
        if self.tool_choice is None:
            return "auto"
        return self.tool_choice if isinstance(self.tool_choice, str) else "named"

    def wanted_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.template_dict() for m in self.messages]
