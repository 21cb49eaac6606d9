"""The choices of one request (n per prompt) and the checks and limits that shape them before
they are submitted: context length, prompt truncation, token ids within the vocabulary, and a
seed per choice."""

from __future__ import annotations

from dataclasses import dataclass, field

from llmq.common.engine_client.request_stream import GenerationChunk
from llmq.common.errors import InvalidRequest
from llmq.common.sampling_params import SamplingParams
from llmq.common.serving.chat_request import ChatCompletionRequest
from llmq.common.serving.request_bodies import SamplingFields


@dataclass(slots=True)
class PromptGroup:
    """The n choices of one prompt: one request to the metrics, as in vLLM and OpenAI."""

    size: int
    first_token_at: float = 0.0
    finished: int = 0
    completion_tokens: int = 0


@dataclass(slots=True)
class Choice:
    index: int
    prompt_ids: list[int]
    params: SamplingParams
    group: PromptGroup
    prompt_text: str = ""  # for completions' echo
    last_token_at: float = 0.0
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    text_offset: int = 0  # completions' streamed logprobs: where the next token's text starts
    prompt_logprobs: list[dict | None] | None = None  # as the engine sent them, when asked for
    images: list[str] = field(default_factory=list)  # the prompt's images' content hashes

    def add(self, chunk: GenerationChunk) -> None:
        """Gather a chunk of this choice's output (usage from its last chunk)."""
        self.text.append(chunk.text)
        self.token_ids.extend(chunk.token_ids)
        if chunk.logprobs:
            self.logprobs.extend(chunk.logprobs)
        if chunk.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = chunk.prompt_logprobs
        if chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason
            self.prompt_tokens = chunk.prompt_tokens
            self.completion_tokens = chunk.completion_tokens
            self.cached_tokens = chunk.cached_tokens


def max_tokens(body: SamplingFields, prompt_len: int, context: int) -> int:
    """The tokens a choice may generate: what the body asks for, or what the context leaves."""
    wanted = body.wanted_max_tokens()
    if prompt_len >= context:
        raise InvalidRequest(
            f"this model's maximum context length is {context} tokens; the prompt has "
            f"{prompt_len} tokens",
            "messages" if isinstance(body, ChatCompletionRequest) else "prompt",
            "context_length_exceeded",
        )
    room = context - prompt_len
    if wanted is None:
        return room
    if wanted > room:
        raise InvalidRequest(
            f"this model's maximum context length is {context} tokens; you asked for "
            f"{prompt_len + wanted} tokens ({prompt_len} in the prompt, {wanted} to generate)",
            body.max_tokens_field(),
            "context_length_exceeded",
        )
    return wanted


def truncated(body: SamplingFields, prompt_ids: list[int], context: int) -> list[int]:
    """The prompt's last ``truncate_prompt_tokens`` tokens (-1: as many as leave room for
    max_tokens, or for one token)."""
    keep = body.truncate_prompt_tokens
    if keep is None:
        return prompt_ids
    if keep == -1:
        keep = max(1, context - (body.wanted_max_tokens() or 1))
    return prompt_ids[-keep:]


# Choice i of a seeded request samples with its own seed (each reproducible); seeds are taken
# modulo 2**64, the range of torch's generators.
_CHOICE_SEED_STRIDE = 0xD1B54A32D192ED03


def choice_params(
    body: SamplingFields, max_tokens: int, logprobs: int | None, i: int, vocab: int
) -> SamplingParams:
    params = body.sampling_params(max_tokens, logprobs)
    if params.seed is not None:
        params.seed = (params.seed + i * _CHOICE_SEED_STRIDE) % (1 << 64)
    if vocab and params.top_k >= vocab:
        params.top_k = 0  # keeps every token: off (and no int64 overflow in the sampler)
    return params


def check_token_ids(body: SamplingFields, vocab: int) -> None:
    """An id past the vocabulary would fail in the worker's sampler: refuse it here (vocab 0:
    the served model's vocabulary size is not known)."""
    if not vocab:
        return
    if any(t >= vocab for t in body.stop_token_ids or []):
        raise InvalidRequest(
            f"stop_token_ids must be below the vocabulary size {vocab}", "stop_token_ids"
        )
    if any(int(t) >= vocab for t in body.logit_bias or {}):
        raise InvalidRequest(
            f"logit_bias token ids must be below the vocabulary size {vocab}", "logit_bias"
        )


def check_prompt_ids(prompt_ids: list[int], vocab: int | None, index: int | None) -> None:
    if not prompt_ids:
        raise InvalidRequest("the prompt is empty", "prompt")
    if vocab and any(t >= vocab for t in prompt_ids):
        where = f"prompt[{index}]" if index is not None else "prompt"
        raise InvalidRequest(f"token ids must be below the vocabulary size {vocab}", where)
