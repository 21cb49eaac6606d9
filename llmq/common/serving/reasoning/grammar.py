"""Structured output after the thinking: an answer grammar (a JSON schema, a forced tool call)
wrapped so that the model first thinks freely, closes its think block, and only then is held to
the answer's grammar, as vLLM enables the grammar once the reasoning ends.

The thinking may not spell the closing tag as text: the first closing tag is where the
reasoning splitter ends the thinking, so the grammar ends it there too."""

from __future__ import annotations

import json
import re
from typing import Any

from llmq.common.errors import InvalidRequest
from llmq.common.serving.reasoning.formats import ReasoningFormat
from llmq.common.serving.reasoning.tokens import single_token

_WRAPPER = "thinking_then_answer"
_ANSWER = "answer"  # the answer's start grammar, where it has no name of its own


def _regex(text: str) -> str:
    """``text`` as a Lark /regex/ that matches it literally."""
    return re.escape(text).replace("/", "\\/")


def _thinking(tokenizer, fmt: ReasoningFormat) -> str:
    """The Lark of the thinking up to and with its closing tag: the tag's token where it is
    one token (text never matches it), else text that ends at the first closing tag."""
    end = _regex(fmt.end)
    end_id = single_token(tokenizer, fmt.end)
    if end_id is not None:
        return f"THINK <[{end_id}]>\nTHINK: /(?s:.*)/ & ~/(?s:.*{end}.*)/"
    return f"THINK\nTHINK: /(?s:.*{end})/ & ~/(?s:.*{end}.+)/"


def _opening(tokenizer, fmt: ReasoningFormat) -> str:
    start_id = single_token(tokenizer, fmt.start)
    return f"<[{start_id}]>" if start_id is not None else json.dumps(fmt.start)


def _answer_grammars(grammar: str) -> list[dict[str, Any]]:
    """The answer's grammars (a TopLevelGrammar's list; Lark text: one grammar), the start one
    first and named."""
    if grammar.lstrip().startswith("{"):
        grammars = [dict(g) for g in json.loads(grammar)["grammars"]]
    else:
        grammars = [{"lark_grammar": grammar}]
    grammars[0].setdefault("name", None)
    if not grammars[0]["name"]:
        grammars[0]["name"] = _ANSWER
    return grammars


def after_thinking(
    tokenizer, fmt: ReasoningFormat, inside: bool, grammar: str, budget: int | None = None
) -> str:
    """``grammar`` preceded by a think block: required and already open when the prompt opened
    it (``inside``), else optional, opened by the model's own start tag. A ``budget`` bounds the
    thinking's tokens: past it the closing tag is the only token allowed."""
    grammars = _answer_grammars(grammar)
    answer = "@" + grammars[0]["name"]
    think_rule, think_terminal = _thinking(tokenizer, fmt).split("\n")
    if budget is not None:
        if single_token(tokenizer, fmt.end) is None:  # the tag would be cut by the bound
            raise InvalidRequest(
                f"a thinking budget needs {fmt.end} to be one token of the model's vocabulary; "
                "it is not here",
                "thinking_budget",
            )
        # llguidance ends a rule's lexeme once it took max_tokens tokens.
        think_rule = think_rule.replace("THINK", "thinking", 1)
        think_terminal += f"\nthinking[max_tokens={budget}]: THINK"
    if inside:
        start = f"start: {think_rule} {answer}"
    else:
        start = f"start: {answer} | {_opening(tokenizer, fmt)} {think_rule} {answer}"
    wrapper = {"name": _WRAPPER, "lark_grammar": f"{start}\n{think_terminal}"}
    return json.dumps({"grammars": [wrapper, *grammars], "max_tokens": None})
