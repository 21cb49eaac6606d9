"""Logprobs as the engines send them (``{"token_id", "logprob", "top": [[id, logprob], ...]}``
per token) in OpenAI's two shapes, chat's and completions' (echo: the prompt's first), and the
prompt's in vLLM's ``prompt_logprobs`` shape."""

from __future__ import annotations

from llmq.common.serving.responses import (
    ChatLogprobs,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
    TokenLogprob,
    TopLogprob,
)


def token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def chat_logprobs(tokenizer, entries: list[dict], as_ids: bool = False) -> ChatLogprobs:
    """``as_ids``: each token as ``token_id:{id}`` (vLLM's ``return_tokens_as_token_ids``), which
    tells apart the tokens whose own text does not (a byte of a character, each U+FFFD)."""

    def text_of(token_id: int) -> str:
        return f"token_id:{token_id}" if as_ids else token_text(tokenizer, token_id)

    def top(token_id: int, logprob: float) -> TopLogprob:
        text = text_of(token_id)
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode("utf-8")))

    content = []
    for e in entries:
        text = text_of(e["token_id"])
        content.append(
            TokenLogprob(
                token=text,
                logprob=e["logprob"],
                bytes=list(text.encode("utf-8")),
                top_logprobs=[top(t, lp) for t, lp in e.get("top", [])],
            )
        )
    return ChatLogprobs(content=content)


def _named(tokenizer, as_ids: bool):
    """How completions' logprobs name a token: its text, or ``token_id:{id}`` (``as_ids``)."""
    if as_ids:
        return lambda token_id: f"token_id:{token_id}"
    return lambda token_id: token_text(tokenizer, token_id)


def completion_logprobs(
    tokenizer, entries: list[dict], offset: int, as_ids: bool = False
) -> tuple[CompletionLogprobs, int]:
    """The logprobs object, and the text offset after its last token: offsets count each
    token's own text, streamed or not (a token that ends inside a character counts U+FFFD),
    also where ``as_ids`` names the tokens by id (vLLM's ``return_tokens_as_token_ids``)."""
    name = _named(tokenizer, as_ids)
    tokens, token_logprobs, top, offsets = [], [], [], []
    for e in entries:
        text = token_text(tokenizer, e["token_id"])
        tokens.append(name(e["token_id"]))
        token_logprobs.append(e["logprob"])
        top.append({name(t): lp for t, lp in e.get("top", [])})
        offsets.append(offset)
        offset += len(text)
    body = CompletionLogprobs(
        tokens=tokens, token_logprobs=token_logprobs, top_logprobs=top, text_offset=offsets
    )
    return body, offset


def echo_logprobs(
    tokenizer, prompt_ids: list[int], entries: list[dict | None], k: int, as_ids: bool = False
) -> CompletionLogprobs:
    """The prompt's part of completions' logprobs (echo): the first token has none (null), each
    other its logprob and its top ``k``; offsets count each token's own text from 0."""
    name = _named(tokenizer, as_ids)
    tokens, token_logprobs, top, offsets = [], [], [], []
    offset = 0
    for token_id, e in zip(prompt_ids, entries, strict=True):
        text = token_text(tokenizer, token_id)
        tokens.append(name(token_id))
        token_logprobs.append(e["logprob"] if e else None)
        top.append({name(t): lp for t, lp in e["top"][:k]} if e else None)
        offsets.append(offset)
        offset += len(text)
    return CompletionLogprobs(
        tokens=tokens, token_logprobs=token_logprobs, top_logprobs=top, text_offset=offsets
    )


def joined(first: CompletionLogprobs, then: CompletionLogprobs | None) -> CompletionLogprobs:
    if then is None:
        return first
    return CompletionLogprobs(
        tokens=first.tokens + then.tokens,
        token_logprobs=first.token_logprobs + then.token_logprobs,
        top_logprobs=first.top_logprobs + then.top_logprobs,
        text_offset=first.text_offset + then.text_offset,
    )


def vllm_prompt_logprobs(tokenizer, entries: list[dict | None], k: int) -> PromptLogprobs:
    """vLLM's shape: None for the first token, then {token id: {logprob, rank, decoded_token}}
    holding the prompt token and the top ``k`` (ranked 1..k)."""
    out: PromptLogprobs = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        row = {
            str(e["token_id"]): PromptLogprob(
                logprob=e["logprob"],
                rank=e.get("rank"),
                decoded_token=token_text(tokenizer, e["token_id"]),
            )
        }
        for rank, (t, lp) in enumerate(e["top"][:k], start=1):
            row.setdefault(
                str(t), PromptLogprob(logprob=lp, rank=rank, decoded_token=token_text(tokenizer, t))
            )
        out.append(row)
    return out
