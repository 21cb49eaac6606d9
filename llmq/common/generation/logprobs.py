"""Logprobs as the engines send them (``{"token_id", "logprob", "top": [[id, logprob], ...]}``
per token) in OpenAI's two shapes: chat's and completions'."""

from __future__ import annotations

from llmq.common.generation.responses import (
    ChatLogprobs,
    CompletionLogprobs,
    TokenLogprob,
    TopLogprob,
)


def token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def chat_logprobs(tokenizer, entries: list[dict]) -> ChatLogprobs:
    def top(token_id: int, logprob: float) -> TopLogprob:
        text = token_text(tokenizer, token_id)
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode("utf-8")))

    content = []
    for e in entries:
        text = token_text(tokenizer, e["token_id"])
        content.append(
            TokenLogprob(
                token=text,
                logprob=e["logprob"],
                bytes=list(text.encode("utf-8")),
                top_logprobs=[top(t, lp) for t, lp in e.get("top", [])],
            )
        )
    return ChatLogprobs(content=content)


def completion_logprobs(
    tokenizer, entries: list[dict], offset: int
) -> tuple[CompletionLogprobs, int]:
    """The logprobs object, and the text offset after its last token: offsets count each
    token's own text, streamed or not (a token that ends inside a character counts U+FFFD)."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for e in entries:
        text = token_text(tokenizer, e["token_id"])
        tokens.append(text)
        token_logprobs.append(e["logprob"])
        top.append({token_text(tokenizer, t): lp for t, lp in e.get("top", [])})
        offsets.append(offset)
        offset += len(text)
    body = CompletionLogprobs(
        tokens=tokens, token_logprobs=token_logprobs, top_logprobs=top, text_offset=offsets
    )
    return body, offset
