"""Tokenizing a prompt no further than its answer needs: every route's tokenizing comes here
(through the pipeline), on the bounded pool (``tokenize_pool.py``).

A prompt that cannot fit the context is refused from its length alone where the tokenizer
proves a bound (``prompt_bounds.py``), else from the tokens of a prefix cut at a safe boundary,
grown twofold until it holds more tokens than the context or is the whole text. A prompt
truncated to its last (or first) tokens is tokenized from a piece of the text long enough to
hold them, grown the same way."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llmq.common.engine_client.prompt_bounds import (
    TokenizerProfile,
    cut_at_or_after,
    cut_at_or_before,
    tokenizer_profile,
)
from llmq.common.engine_client.tokenize_pool import TokenizePool, shared_pool, utf8_size
from llmq.common.errors import InvalidRequest
from llmq.common.settings import get_settings

# Texts up to this many characters are tokenized whole at once: cutting them saves nothing.
FIRST_PIECE = 16 * 1024


class TooManyTokens(Exception):
    """The text has more tokens than allowed: at least ``at_least``."""

    def __init__(self, at_least: int):
        super().__init__(at_least)
        self.at_least = at_least


@dataclass(frozen=True, slots=True)
class PromptLimits:
    """What a generation's prompt may be: fewer than ``context`` tokens (room for one generated
    token), or, with ``keep_last``, its last tokens only (truncate_prompt_tokens)."""

    context: int
    keep_last: int | None = None


def context_exceeded(context: int, at_least: int, param: str) -> InvalidRequest:
    return InvalidRequest(
        f"this model's maximum context length is {context} tokens; the prompt has at least "
        f"{at_least} tokens",
        param,
        "context_length_exceeded",
    )


class PromptEncoder:
    def __init__(self, tokenizer, pool: TokenizePool | None = None):
        self.tokenizer = tokenizer
        self._pool = pool
        self._profile: TokenizerProfile | None = None
        self._specials: dict[bool, int] = {}

    @property
    def pool(self) -> TokenizePool:
        if self._pool is None:
            self._pool = shared_pool()
        return self._pool

    async def profile(self) -> TokenizerProfile:
        if self._profile is None:  # reads the whole vocabulary once: off the event loop
            self._profile = await self.pool.run(0, lambda: tokenizer_profile(self.tokenizer))
        return self._profile

    async def tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        """The whole text's tokens, on the pool."""
        return await self.pool.run(
            utf8_size(text),
            lambda: self.tokenizer.encode(text, add_special_tokens=add_special_tokens),
        )

    async def encode(
        self,
        text: str,
        add_special_tokens: bool = True,
        *,
        most: int | None = None,
        keep_last: int | None = None,
        keep_first: int | None = None,
    ) -> list[int]:
        """The text's tokens; with ``most``: TooManyTokens past that many; with ``keep_last``:
        its last tokens only; with ``keep_first``: its first tokens (at least that many plus
        the special tokens, or all of them), as the caller cuts them."""
        if keep_last is not None and keep_last > 0:
            return await self._tail(text, add_special_tokens, keep_last)
        if keep_first is not None and keep_first > 0:
            need = keep_first + await self._special_count(add_special_tokens)
            return await self._prefix(text, add_special_tokens, need, lambda ids: len(ids) >= need)
        if most is None:
            return await self.tokenize(text, add_special_tokens)
        profile = await self.profile()
        if (least := profile.least_tokens(text)) > most:
            raise TooManyTokens(least)
        ids = await self._prefix(text, add_special_tokens, most + 1, lambda ids: len(ids) > most)
        if len(ids) > most:
            raise TooManyTokens(len(ids))
        return ids

    async def _prefix(
        self, text: str, add: bool, need: int, enough: Callable[[list[int]], bool]
    ) -> list[int]:
        """The tokens of the shortest prefix tried (cut safely, twice as long each time) that
        is ``enough``, or of the whole text."""
        size = max(FIRST_PIECE, 8 * need)
        if len(text) > size and (await self.profile()).prefix_cuts:
            while size < len(text):
                cut = cut_at_or_before(text, size, size // 2)
                if cut is None:
                    break
                ids = await self.tokenize(text[:cut], add)
                if enough(ids):
                    return ids
                size = 2 * max(size, cut)
        return await self.tokenize(text, add)

    async def _tail(self, text: str, add: bool, keep: int) -> list[int]:
        """The last ``keep`` tokens of the text, from a suffix that holds them."""
        need = keep + await self._special_count(add)
        size = max(FIRST_PIECE, 8 * need)
        if len(text) > size and (await self.profile()).tail_cuts:
            while size < len(text):
                cut = cut_at_or_after(text, len(text) - size)
                if cut is None:
                    break
                ids = await self.tokenize(text[cut:], add)
                if len(ids) >= need:  # its leading special tokens are not among the kept
                    return ids[-keep:]
                size *= 2
        return (await self.tokenize(text, add))[-keep:]

    async def _special_count(self, add: bool) -> int:
        """Tokens the tokenizer adds around a text (BOS, [CLS] and [SEP])."""
        if not add:
            return 0
        if add not in self._specials:
            with_specials = await self.tokenize("a", True)
            self._specials[add] = len(with_specials) - len(await self.tokenize("a", False))
        return self._specials[add]

    async def render_chat(
        self, messages: list[dict], tools: list[dict] | None, template_kwargs: dict[str, Any]
    ) -> str:
        """``messages`` (and the ``tools`` offered) through the chat template, as text, on the
        pool (the render is linear in its input)."""
        check_counts(messages, tools)
        if not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequest("this model has no chat template; use /v1/completions")

        def render() -> str:
            try:
                return self.tokenizer.apply_chat_template(
                    messages,
                    tools=tools,
                    tokenize=False,
                    **{"add_generation_prompt": True, **template_kwargs},
                )
            except Exception as exc:  # a template that rejects these messages
                raise InvalidRequest(
                    f"the chat template rejected the messages: {exc}", "messages"
                ) from exc

        return await self.pool.run(text_size(messages) + text_size(tools), render)


def check_counts(messages: list[dict], tools: list[dict] | None) -> None:
    settings = get_settings()
    if len(messages) > settings.max_messages:
        raise InvalidRequest(
            f"messages holds {len(messages)} items; at most {settings.max_messages} per request",
            "messages",
        )
    if tools and len(tools) > settings.max_tools:
        raise InvalidRequest(
            f"tools holds {len(tools)} items; at most {settings.max_tools} per request", "tools"
        )


def text_size(value: Any) -> int:
    """Characters of the strings in a JSON value: what rendering it costs."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(text_size(v) for v in value.values())
    if isinstance(value, list):
        return sum(text_size(v) for v in value)
    return 0
