"""An answer's grammar after the thinking, run by llguidance over a real tokenizer (</think> as
one added token and as several ordinary ones): free text, the closing tag, then only the
answer's grammar; no closing tag spelled inside the thinking."""

from __future__ import annotations

import copy
import json

import llguidance.hf
import pytest
from llguidance import LLMatcher

from llmq.common.errors import InvalidRequest
from llmq.common.serving.reasoning import FORMATS, after_thinking
from llmq.common.serving.reasoning.chat import FREE_TEXT
from llmq.common.serving.reasoning.tokens import single_token
from llmq.common.serving.structured_output import Constraint, build_grammar
from llmq.common.serving.tool_grammar import tool_grammar
from llmq.common.serving.tool_request import FunctionTool

pytestmark = pytest.mark.unit

THINK = FORMATS["qwen3"]
SCHEMA = {
    "type": "object",
    "properties": {"a": {"enum": [1, 2]}},
    "required": ["a"],
    "additionalProperties": False,
}
JSON_GRAMMAR = build_grammar(Constraint("response_format", "json_schema", json.dumps(SCHEMA)))


class Matcher:
    def __init__(self, tokenizer):
        self.tokenizer = copy.deepcopy(tokenizer)
        self.tokenizer.add_special_tokens({"eos_token": "<eos>"})
        self.ll = llguidance.hf.from_tokenizer(
            self.tokenizer, n_vocab=len(self.tokenizer), eos_token=self.tokenizer.eos_token_id
        )

    def accepts(self, grammar: str, *texts: str) -> bool:
        """Whether the texts (each encoded on its own) are a whole sentence of ``grammar``."""
        matcher = LLMatcher(self.ll, grammar, log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        ids = [i for t in texts for i in self.tokenizer.encode(t, add_special_tokens=False)]
        return matcher.consume_tokens(ids) and matcher.is_accepting() and not matcher.is_error()


@pytest.fixture(scope="module", params=["plain", "tagged"])
def matcher(request) -> Matcher:
    return Matcher(request.getfixturevalue(request.param))


def test_open_block_thinks_then_answers_in_json(matcher):
    grammar = after_thinking(matcher.tokenizer, THINK, True, JSON_GRAMMAR)
    assert matcher.accepts(grammar, "some thinking,\n then", THINK.end, '{"a": 1}')
    assert matcher.accepts(grammar, THINK.end, '{"a": 2}')  # no thinking at all
    assert not matcher.accepts(grammar, '{"a": 1}')  # the block must close first
    assert not matcher.accepts(grammar, "some thinking", THINK.end, '{"a": 3}')
    assert not matcher.accepts(grammar, "some thinking", THINK.end, "the answer")
    assert not matcher.accepts(grammar, "some", THINK.end, "more", THINK.end, '{"a": 1}')


def test_thinking_never_spells_the_closing_tag(matcher):
    """Where </think> is a token, its text in pieces is refused too: the splitter would end
    the thinking there and read the rest as the answer."""
    grammar = after_thinking(matcher.tokenizer, THINK, True, JSON_GRAMMAR)
    text = "some </think> thinking"
    assert not matcher.accepts(grammar, *text, THINK.end, '{"a": 1}')
    assert matcher.accepts(grammar, *"some <think> thinking", THINK.end, '{"a": 1}')


def test_unopened_block_is_optional(matcher):
    grammar = after_thinking(matcher.tokenizer, THINK, False, JSON_GRAMMAR)
    assert matcher.accepts(grammar, '{"a": 1}')
    assert matcher.accepts(grammar, THINK.start, "some thinking", THINK.end, '{"a": 2}')
    assert not matcher.accepts(grammar, "some thinking", THINK.end, '{"a": 2}')
    assert not matcher.accepts(grammar, THINK.start, "some thinking", '{"a": 2}')


def test_forced_tool_calls_follow_the_thinking(matcher):
    tools = [FunctionTool.model_validate({"type": "function", "function": {"name": "f"}})]
    tools[0].function.parameters = SCHEMA
    named = after_thinking(matcher.tokenizer, THINK, True, tool_grammar(tools, "f", False))
    assert matcher.accepts(named, "hmm", THINK.end, '{"a":1}')
    assert not matcher.accepts(named, '{"a":1}')
    required = after_thinking(matcher.tokenizer, THINK, True, tool_grammar(tools, None, False))
    call = '[{"name":"f","parameters":{"a":2}}]'
    assert matcher.accepts(required, "hmm", THINK.end, call)
    assert not matcher.accepts(required, "hmm", THINK.end, '[{"name":"g","parameters":{}}]')


def test_a_lark_answer_is_wrapped_too(matcher):
    grammar = after_thinking(matcher.tokenizer, THINK, True, 'start: "yes" | "no"')
    assert matcher.accepts(grammar, "hmm", THINK.end, "yes")
    assert not matcher.accepts(grammar, "hmm", THINK.end, "maybe")


def _ids(tokenizer, texts) -> list[int]:
    return [i for t in texts for i in tokenizer.encode(t, add_special_tokens=False)]


def test_a_budget_bounds_the_thinking_then_forces_the_closing_tag(matcher):
    budget = 6
    if single_token(matcher.tokenizer, THINK.end) is None:  # the bound would cut the tag
        with pytest.raises(InvalidRequest, match="one token"):
            after_thinking(matcher.tokenizer, THINK, True, FREE_TEXT, budget)
        return
    grammar = after_thinking(matcher.tokenizer, THINK, True, FREE_TEXT, budget)
    words = [" a", " b", " c", " d", " e", " f", " g", " h"]
    assert len(_ids(matcher.tokenizer, words)) > budget
    within = next(
        words[:n]
        for n in range(len(words), 0, -1)
        if len(_ids(matcher.tokenizer, words[:n])) <= budget
    )
    assert matcher.accepts(grammar, *within, THINK.end, "the answer")
    assert not matcher.accepts(grammar, *words, THINK.end, "the answer")
    # After the budget's tokens of thinking, the closing tag is the only token allowed.
    m = LLMatcher(matcher.ll, grammar, log_level=0)
    assert m.consume_tokens(_ids(matcher.tokenizer, words)[:budget]), m.get_error()
    allowed = [i for i in range(len(matcher.tokenizer)) if m.validate_tokens([i]) == 1]
    assert allowed == _ids(matcher.tokenizer, [THINK.end]), allowed
    # Without a budget the same thinking goes on.
    unbounded = after_thinking(matcher.tokenizer, THINK, True, FREE_TEXT)
    assert matcher.accepts(unbounded, *words, THINK.end, "the answer")
