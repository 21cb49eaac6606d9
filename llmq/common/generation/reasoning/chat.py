"""One chat request's reasoning: its format, whether the prompt opened the think block, and a
splitter per choice for the streamed answer."""

from __future__ import annotations

from typing import Any

from llmq.common.generation.chat_request import ChatCompletionRequest
from llmq.common.generation.reasoning.formats import ReasoningFormat, choose_reasoning
from llmq.common.generation.reasoning.splitter import ReasoningSplitter, split_reasoning
from llmq.common.generation.reasoning.tokens import prompt_opens_block, reasoning_tokens
from llmq.common.generation.structured_output import requested_constraint
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


def _constrained_answer(body: ChatCompletionRequest) -> bool:
    """The output is JSON or tool calls from its first token (a grammar forces them there,
    whatever block the prompt opened): it is the answer, not thinking. A regex or grammar of
    the body's own may write the thinking and its closing tag: that output is split."""
    if body.tool_mode() in ("required", "named"):
        return True
    constraint = requested_constraint(body)
    return constraint is not None and constraint.kind == "json_schema"


def chat_reasoning(
    tokenizer, body: ChatCompletionRequest, prompt_ids: list[int]
) -> ChatReasoning | None:
    """The request's reasoning, or None where no reasoning parser applies (the model's or the
    body's constrained answer)."""
    if _constrained_answer(body):
        return None
    template = getattr(tokenizer, "chat_template", None)
    fmt = choose_reasoning(
        get_settings().reasoning_parser, template if isinstance(template, str) else None
    )
    return (
        None if fmt is None else ChatReasoning(tokenizer, fmt, prompt_ids, body.include_reasoning)
    )
