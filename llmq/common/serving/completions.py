"""/v1/completions: one or more prompts (text or token ids), n choices each, OpenAI's
text_completion answer and chunks (echo included)."""

from __future__ import annotations

from llmq.common.engine_client.pipeline import TokenGeneratorPipeline
from llmq.common.engine_client.request_stream import GenerationChunk
from llmq.common.engine_status import EngineStatus
from llmq.common.errors import InvalidRequest
from llmq.common.serving.choices import (
    Choice,
    PromptGroup,
    check_prompt_ids,
    choice_params,
    max_tokens,
    truncated,
)
from llmq.common.serving.logprobs import (
    completion_logprobs,
    echo_logprobs,
    joined,
    vllm_prompt_logprobs,
)
from llmq.common.serving.prompt_limits import prompt_limits
from llmq.common.serving.request_bodies import CompletionRequest
from llmq.common.serving.responses import (
    Completion,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
)
from llmq.common.serving.run import Generation


async def _encoded_prompts(
    pipeline: TokenGeneratorPipeline, engine: EngineStatus, body: CompletionRequest
) -> list[tuple[list[int], str]]:
    """Each prompt's token ids, and its text for echo (truncated as the body asks)."""
    prompts = body.prompts()
    # One token more than truncation keeps: a text longer than that is cut below.
    limits = prompt_limits(body, engine.max_model_len, extra=1)
    encoded: list[tuple[list[int], str]] = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if not p:
                raise InvalidRequest("the prompt is empty", "prompt")
            encoded.append((await pipeline.encode(p, limits=limits), p))
        else:
            check_prompt_ids(p, engine.vocab_size, i if len(prompts) > 1 else None)
            encoded.append((list(p), pipeline.decode(list(p)) if body.echo else ""))
    if body.truncate_prompt_tokens is not None:
        encoded = [
            (kept, text if len(kept) == len(ids) or not body.echo else pipeline.decode(kept))
            for ids, text in encoded
            for kept in [truncated(body, ids, engine.max_model_len)]
        ]
    return encoded


async def completion_choices(
    pipeline: TokenGeneratorPipeline, engine: EngineStatus, body: CompletionRequest
) -> tuple[list[Choice], int]:
    """The request's choices (n per prompt, in prompt order), and its prompt tokens."""
    vocab = engine.vocab_size
    encoded = await _encoded_prompts(pipeline, engine, body)
    logprobs = body.wanted_logprobs()
    choices: list[Choice] = []
    for ids, text in encoded:
        limit = max_tokens(body, len(ids), engine.max_model_len)
        group = PromptGroup(body.n)
        for j in range(body.n):
            params = choice_params(body, limit, logprobs, j, vocab)
            choice = Choice(len(choices), ids, params, group, text)
            choice.text_offset = len(text) if body.echo else 0
            choices.append(choice)
    return choices, sum(len(ids) for ids, _ in encoded)


class CompletionGeneration(Generation):
    id_prefix = "cmpl"
    reports_cached_tokens = False

    def _chunk(self, rows: list[CompletionChoice], **usage) -> CompletionChunk:
        return CompletionChunk(
            id=self.id, created=self.created, model=self.model, choices=rows, **usage
        )

    def opening_chunks(self) -> list[CompletionChunk]:
        if not self.body.echo or self.wants_logprobs:  # echoed with the prompt's logprobs
            return []
        return [
            self._chunk(
                [
                    CompletionChoice(
                        index=c.index, text=c.prompt_text, logprobs=None, finish_reason=None
                    )
                ]
            )
            for c in self.choices
        ]

    def chunk(self, choice: Choice, chunk: GenerationChunk) -> CompletionChunk:
        text, logprobs, prompt = chunk.text, None, None
        if chunk.prompt_logprobs is not None:  # a choice's first chunk
            prompt = self._prompt_logprobs(choice, chunk.prompt_logprobs)
            if self._echoes_logprobs():
                text = choice.prompt_text + text
                logprobs = self._echo(choice, chunk.prompt_logprobs)
        if self.wants_logprobs and chunk.logprobs:
            generated, choice.text_offset = completion_logprobs(
                self.tokenizer,
                chunk.logprobs,
                choice.text_offset,
                self.body.return_tokens_as_token_ids,
            )
            logprobs = joined(logprobs, generated) if logprobs else generated
        row = CompletionChoice(
            index=choice.index,
            text=text,
            logprobs=logprobs,
            finish_reason=chunk.finish_reason,
            prompt_logprobs=prompt,
        )
        return self._chunk([row])

    def usage_chunk(self) -> CompletionChunk:
        return self._chunk([], usage=self.usage())

    def response(self) -> Completion:
        rows = []
        for c in self.choices:
            prefix = c.prompt_text if self.body.echo else ""
            logprobs = None
            if self.wants_logprobs:
                as_ids = self.body.return_tokens_as_token_ids
                logprobs = completion_logprobs(self.tokenizer, c.logprobs, len(prefix), as_ids)[0]
                if self._echoes_logprobs():
                    logprobs = joined(self._echo(c, c.prompt_logprobs), logprobs)
            rows.append(
                CompletionChoice(
                    index=c.index,
                    text=prefix + "".join(c.text),
                    logprobs=logprobs,
                    finish_reason=c.finish_reason,
                    prompt_logprobs=self._prompt_logprobs(c, c.prompt_logprobs),
                )
            )
        return Completion(
            id=self.id, created=self.created, model=self.model, choices=rows, usage=self.usage()
        )

    def _echoes_logprobs(self) -> bool:
        return self.body.echo_logprobs() is not None

    def _echo(self, choice: Choice, entries: list[dict | None] | None) -> CompletionLogprobs:
        """The prompt's logprobs, first in an echoed choice's."""
        entries = entries or [None] * len(choice.prompt_ids)
        as_ids = self.body.return_tokens_as_token_ids
        return echo_logprobs(self.tokenizer, choice.prompt_ids, entries, self.body.logprobs, as_ids)

    def _prompt_logprobs(self, choice: Choice, entries: list[dict | None] | None):
        k = self.body.prompt_logprobs
        if k is None or entries is None:
            return None
        return vllm_prompt_logprobs(self.tokenizer, entries, k)
