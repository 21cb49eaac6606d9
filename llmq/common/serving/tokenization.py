"""vLLM's tokenizer endpoints over a served model's tokenizer: POST /tokenize (a prompt, or chat
messages through the chat template), POST /detokenize and GET /tokenizer_info, in vLLM's shapes
(evaluation harnesses tokenize through them)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from llmq.common.engine_client.pipeline import TokenGeneratorPipeline
from llmq.common.engine_status import EngineStatus
from llmq.common.errors import InvalidRequest
from llmq.common.serving.chat import with_image_tokens
from llmq.common.serving.chat_request import ChatCompletionRequest
from llmq.common.serving.responses import WireModel
from llmq.common.validation import validation_error

# The tokenizer's own settings that /tokenizer_info shows (vLLM shows its tokenizer config).
_SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | None = None
    # Chat messages, checked as chat's are; rendered by the chat template.
    messages: list[dict[str, Any]] | None = None
    # Default (as vLLM): True for a prompt, False for messages (the template has its own).
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self


class TokenizeResponse(WireModel):
    omit_if_none = frozenset({"token_strs"})

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


class DetokenizeResponse(WireModel):
    prompt: str


async def tokenize(
    pipeline: TokenGeneratorPipeline, engine: EngineStatus, body: TokenizeRequest
) -> TokenizeResponse:
    if body.prompt is not None:
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
        ids = await pipeline.encode(body.prompt, add_special_tokens=add_special)
    else:
        chat = _chat_request(body)
        ids = await pipeline.encode_chat(
            chat.template_messages(), tools=chat.template_tools(), **chat.template_kwargs()
        )
        ids = await with_image_tokens(pipeline, engine, chat, ids)
    strs = pipeline.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return TokenizeResponse(
        count=len(ids), max_model_len=engine.max_model_len, tokens=ids, token_strs=strs
    )


def _chat_request(body: TokenizeRequest) -> ChatCompletionRequest:
    """The messages (and tools) checked as chat checks them: the same 400s."""
    fields = {"messages", "tools", "add_generation_prompt", "continue_final_message"}
    try:
        return ChatCompletionRequest.model_validate(body.model_dump(include=fields))
    except ValidationError as exc:
        raise validation_error(list(exc.errors())) from None


def detokenize(
    pipeline: TokenGeneratorPipeline, engine: EngineStatus, body: DetokenizeRequest
) -> DetokenizeResponse:
    vocab = engine.vocab_size or len(pipeline.tokenizer)
    if any(t >= vocab for t in body.tokens):
        raise InvalidRequest(f"token ids must be below the vocabulary size {vocab}", "tokens")
    return DetokenizeResponse(prompt=pipeline.tokenizer.decode(body.tokens))


def tokenizer_info(pipeline: TokenGeneratorPipeline, engine: EngineStatus) -> dict[str, Any]:
    """The tokenizer's class, limits, special tokens and chat template (vLLM's keys)."""
    tok = pipeline.tokenizer
    info: dict[str, Any] = {
        "tokenizer_class": type(tok).__name__,
        "model_max_length": engine.max_model_len,
        "max_model_len": engine.max_model_len,
        "vocab_size": engine.vocab_size or len(tok),
        "chat_template": getattr(tok, "chat_template", None),
        "add_bos_token": getattr(tok, "add_bos_token", None),
    }
    for name in _SPECIAL_TOKENS:
        value = getattr(tok, name, None)
        info[name] = str(value) if value is not None else None
        info[f"{name}_id"] = getattr(tok, f"{name}_id", None)
    return info
