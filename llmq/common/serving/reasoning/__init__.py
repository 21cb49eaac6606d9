"""Reasoning models' thinking (<think>...</think>) apart from their answer: the format per
family, the streamed split, the reasoning tokens, reasoning_effort as a template variable, an
answer's grammar held back until the thinking is over."""

from llmq.common.serving.reasoning.chat import (
    ChatReasoning,
    answer_grammar,
    chat_format,
    chat_reasoning,
)
from llmq.common.serving.reasoning.formats import (
    FORMATS,
    PARSER_NAMES,
    ReasoningFormat,
    choose_reasoning,
)
from llmq.common.serving.reasoning.grammar import after_thinking
from llmq.common.serving.reasoning.splitter import ReasoningSplitter, split_reasoning
from llmq.common.serving.reasoning.template import reasoning_template_kwargs
from llmq.common.serving.reasoning.tokens import prompt_opens_block, reasoning_tokens

__all__ = [
    "ChatReasoning",
    "FORMATS",
    "PARSER_NAMES",
    "ReasoningFormat",
    "ReasoningSplitter",
    "after_thinking",
    "answer_grammar",
    "chat_format",
    "chat_reasoning",
    "choose_reasoning",
    "prompt_opens_block",
    "reasoning_template_kwargs",
    "reasoning_tokens",
    "split_reasoning",
]
