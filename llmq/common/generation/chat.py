"""/v1/chat/completions: the messages through the chat template, n choices, OpenAI's chat
answer and chunks."""

from __future__ import annotations

from llmq.common.engine_status import EngineStatus
from llmq.common.generation.chat_request import ChatCompletionRequest
from llmq.common.generation.choices import (
    Choice,
    PromptGroup,
    check_token_ids,
    choice_params,
    max_tokens,
    truncated,
)
from llmq.common.generation.logprobs import chat_logprobs
from llmq.common.generation.responses import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatLogprobs,
)
from llmq.common.generation.run import Generation
from llmq.common.pipeline import TokenGeneratorPipeline
from llmq.common.request_stream import GenerationChunk


async def chat_choices(
    pipeline: TokenGeneratorPipeline, engine: EngineStatus, body: ChatCompletionRequest
) -> tuple[list[Choice], int]:
    """The request's choices, and its prompt tokens."""
    vocab = engine.vocab_size
    check_token_ids(body, vocab)
    await body.prepare_grammar()
    prompt_ids = await pipeline.encode_chat(body.template_messages(), **body.template_kwargs())
    prompt_ids = truncated(body, prompt_ids, engine.max_model_len)
    limit = max_tokens(body, len(prompt_ids), engine.max_model_len)
    logprobs = body.wanted_logprobs()
    group = PromptGroup(body.n)
    choices = [
        Choice(i, prompt_ids, choice_params(body, limit, logprobs, i, vocab), group)
        for i in range(body.n)
    ]
    return choices, len(prompt_ids)


class ChatGeneration(Generation):
    id_prefix = "chatcmpl"

    def _logprobs(self, entries: list[dict]) -> ChatLogprobs:
        return chat_logprobs(self.tokenizer, entries)

    def _chunk(self, rows: list[ChatChunkChoice], **usage) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model, choices=rows, **usage
        )

    def opening_chunks(self) -> list[ChatCompletionChunk]:
        opening = ChatDelta(role="assistant", content="")
        return [
            self._chunk(
                [ChatChunkChoice(index=c.index, delta=opening, logprobs=None, finish_reason=None)]
            )
            for c in self.choices
        ]

    def chunk(self, choice: Choice, chunk: GenerationChunk) -> ChatCompletionChunk:
        has_text = chunk.text or chunk.finish_reason is None
        row = ChatChunkChoice(
            index=choice.index,
            delta=ChatDelta(content=chunk.text) if has_text else ChatDelta(),
            logprobs=self._logprobs(chunk.logprobs)
            if self.wants_logprobs and chunk.logprobs
            else None,
            finish_reason=chunk.finish_reason,
        )
        return self._chunk([row])

    def usage_chunk(self) -> ChatCompletionChunk:
        return self._chunk([], usage=self.usage())

    def response(self) -> ChatCompletion:
        rows = [
            ChatChoice(
                index=c.index,
                message=AssistantMessage(content="".join(c.text)),
                logprobs=self._logprobs(c.logprobs) if self.wants_logprobs else None,
                finish_reason=c.finish_reason,
            )
            for c in self.choices
        ]
        return ChatCompletion(
            id=self.id, created=self.created, model=self.model, choices=rows, usage=self.usage()
        )
