"""Response bodies of the OpenAI-compatible endpoints, typed. ``model_dump()`` gives the JSON
object answered: OpenAI's keys in OpenAI's order, ``null`` where a value is absent, except for
the keys a model lists in ``omit_if_none``, which are left out instead."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, SerializerFunctionWrapHandler, model_serializer


class WireModel(BaseModel):
    omit_if_none: ClassVar[frozenset[str]] = frozenset()

    @model_serializer(mode="wrap")
    def _omit(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        for key in self.omit_if_none:
            if data.get(key) is None:
                data.pop(key, None)
        return data


# ---- shared ----------------------------------------------------------------------------------
class PromptTokensDetails(WireModel):
    cached_tokens: int


class CompletionTokensDetails(WireModel):
    reasoning_tokens: int


class Usage(WireModel):
    omit_if_none = frozenset({"prompt_tokens_details", "completion_tokens_details"})

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None  # only when tokens were cached
    # Only for a chat answer from a model that reasons (a reasoning parser in use).
    completion_tokens_details: CompletionTokensDetails | None = None


class PromptLogprob(WireModel):
    """vLLM's entry of ``prompt_logprobs``, per token id (the prompt token's and the top k)."""

    logprob: float
    rank: int | None
    decoded_token: str


# vLLM's prompt_logprobs: None for the first prompt token, then token id -> its entry.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


# ---- chat ------------------------------------------------------------------------------------
class TopLogprob(WireModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(WireModel):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(WireModel):
    content: list[TokenLogprob]


class FunctionCall(WireModel):
    name: str
    arguments: str  # the JSON text of an object


class ToolCall(WireModel):
    id: str
    type: str = "function"
    function: FunctionCall


class AssistantMessage(WireModel):
    omit_if_none = frozenset({"reasoning_content", "reasoning", "tool_calls"})

    role: str = "assistant"
    content: str | None  # None: the answer is tool calls alone
    # A reasoning model's thinking, under both names clients read (vLLM and SGLang's
    # reasoning_content, newer vLLM and Ollama's reasoning); left out when there is none.
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(WireModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletion(WireModel):
    omit_if_none = frozenset({"prompt_logprobs"})

    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's, when asked for


class FunctionCallDelta(WireModel):
    omit_if_none = frozenset({"name", "arguments"})

    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(WireModel):
    """A call's first delta has its id, type and name (and arguments ""); the next ones add
    to its arguments."""

    omit_if_none = frozenset({"id", "type"})

    index: int
    id: str | None = None
    type: str | None = None
    function: FunctionCallDelta


class ChatDelta(WireModel):
    omit_if_none = frozenset({"role", "content", "reasoning_content", "reasoning", "tool_calls"})

    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None  # as AssistantMessage's, a piece of the thinking
    reasoning: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(WireModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionChunk(WireModel):
    omit_if_none = frozenset({"usage"})

    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None  # only on the last chunk, with stream_options.include_usage


# ---- completions -----------------------------------------------------------------------------
class CompletionLogprobs(WireModel):
    tokens: list[str]
    token_logprobs: list[float | None]  # None: the first prompt token (echo)
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(WireModel):
    omit_if_none = frozenset({"prompt_logprobs"})

    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's, when asked for


class Completion(WireModel):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunk(WireModel):
    omit_if_none = frozenset({"usage"})

    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None  # only on the last chunk, with stream_options.include_usage


# ---- embeddings ------------------------------------------------------------------------------
class Embedding(WireModel):
    object: str = "embedding"
    index: int
    embedding: list[float] | str  # floats, or base64 of little-endian float32


class EmbeddingUsage(WireModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(WireModel):
    object: str = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


# ---- models ----------------------------------------------------------------------------------
class ModelCard(WireModel):
    omit_if_none = frozenset(
        {"random_weights", "images", "parent", "max_model_len", "kind", "workers"}
    )

    id: str
    object: str = "model"
    created: int
    owned_by: str = "llmq"
    root: str
    # or "loading": a worker loads it, its limits not known yet; or "available": a catalogue
    # model no worker holds, loaded by the first request that names it; or "sleeping": asleep
    # on ``workers``, woken by the first request that names it
    state: str = "ready"
    max_model_len: int | None = None
    kind: str | None = None
    random_weights: bool | None = None  # only for a demo model's random weights
    images: bool | None = None  # only for a model that takes image input
    parent: str | None = None  # a LoRA adapter's base model (vLLM's field)
    workers: list[str] | None = None  # a catalogue model's: the workers holding it (or asleep)


class ModelList(WireModel):
    object: str = "list"
    data: list[ModelCard]
