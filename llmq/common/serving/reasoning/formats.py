"""The reasoning formats of model families: the tags around a model's thinking, and which one
a chat template or LLMQ_REASONING_PARSER selects."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    name: str
    start: str
    end: str


# DeepSeek-R1 (and its distills), Qwen3, SmolLM3, QwQ: <think>...</think> before the answer;
# their templates may open the block in the prompt (the generation prompt ends with <think>).
DEEPSEEK_R1 = ReasoningFormat("deepseek_r1", "<think>", "</think>")
QWEN3 = ReasoningFormat("qwen3", "<think>", "</think>")

FORMATS: dict[str, ReasoningFormat] = {f.name: f for f in (DEEPSEEK_R1, QWEN3)}
PARSER_NAMES = (*FORMATS, "none")


def choose_reasoning(configured: str | None, template: str | None) -> ReasoningFormat | None:
    """The configured parser (LLMQ_REASONING_PARSER; "none": off) when set, else the
    <think> format when the chat template's text names its closing tag."""
    if configured == "none":
        return None
    if configured:
        return FORMATS[configured]
    if template and DEEPSEEK_R1.end in template:
        return DEEPSEEK_R1
    return None
