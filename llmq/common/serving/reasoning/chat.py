"""One chat request's reasoning: its format, whether the prompt opened the think block, and a
splitter per choice for the streamed answer."""

from __future__ import annotations

from typing import Any

from llmq.common.serving.chat_request import ChatCompletionRequest
from llmq.common.serving.reasoning.formats import ReasoningFormat, choose_reasoning
from llmq.common.serving.reasoning.grammar import after_thinking
from llmq.common.serving.reasoning.splitter import ReasoningSplitter, split_reasoning
from llmq.common.serving.reasoning.tokens import prompt_opens_block, reasoning_tokens
from llmq.common.settings import get_settings


class ChatReasoning:
    def __init__(
        self, tokenizer, fmt: ReasoningFormat, prompt_ids: list[int], include: bool
    ) -> None:
        self.tokenizer = tokenizer
        self.fmt = fmt
        self.inside = prompt_opens_block(tokenizer, fmt, prompt_ids)
        self.include = include  # include_reasoning: false leaves the thinking out
        self.splitters: dict[int, ReasoningSplitter] = {}

    def feed(self, index: int, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) of a streamed chunk's text of choice ``index``."""
        splitter = self.splitters.setdefault(index, ReasoningSplitter(self.fmt, self.inside))
        reasoning, content = splitter.feed(text)
        if final:
            more, rest = splitter.finish()
            reasoning, content = reasoning + more, content + rest
        return reasoning, content

    def split(self, text: str) -> tuple[str | None, str]:
        """A whole output's reasoning (None: none) and content."""
        return split_reasoning(self.fmt, self.inside, text)

    def fields(self, reasoning: str | None) -> dict[str, Any]:
        """The reasoning fields of a message or delta (none when there is nothing to show)."""
        if not reasoning or not self.include:
            return {}
        return {"reasoning_content": reasoning, "reasoning": reasoning}

    def tokens(self, text: str, token_ids: list[int]) -> int:
        """The reasoning tokens of a choice's output (``text``: its text)."""
        if not (self.inside or text.lstrip().startswith(self.fmt.start)):
            return 0
        return reasoning_tokens(self.tokenizer, self.fmt, token_ids)


def chat_format(tokenizer) -> ReasoningFormat | None:
    """The served model's reasoning format (None: no reasoning parser applies)."""
    template = getattr(tokenizer, "chat_template", None)
    return choose_reasoning(
        get_settings().reasoning_parser, template if isinstance(template, str) else None
    )


def chat_reasoning(
    tokenizer, body: ChatCompletionRequest, prompt_ids: list[int]
) -> ChatReasoning | None:
    """The request's reasoning, or None where no reasoning parser applies."""
    fmt = chat_format(tokenizer)
    return (
        None if fmt is None else ChatReasoning(tokenizer, fmt, prompt_ids, body.include_reasoning)
    )


# The answer after a bounded thinking where nothing else constrains it.
FREE_TEXT = "%llguidance {}\nstart: /(?s:.*)/"


def answer_grammar(
    tokenizer, prompt_ids: list[int], grammar: str | None, budget: int | None = None
) -> str | None:
    """An answer's grammar (JSON, a forced tool call; None: free text) held back until the
    thinking is over, which ``budget`` bounds, where the model reasons; unchanged where it does
    not (it never thinks: any budget holds)."""
    fmt = chat_format(tokenizer)
    if fmt is None:
        return grammar
    if grammar is None and budget is None:
        return None
    inside = prompt_opens_block(tokenizer, fmt, prompt_ids)
    return after_thinking(tokenizer, fmt, inside, grammar or FREE_TEXT, budget)
