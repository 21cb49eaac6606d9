"""Chat requests with tools: what is accepted, the 400s (with the field they name), what the
chat template is given, and the grammars that force calls (checked with llguidance on a
byte-level tokenizer)."""

from __future__ import annotations

import functools
import json

import pytest
from llguidance import LLMatcher, LLTokenizer
from pydantic import ValidationError
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from llmq.common.errors import InvalidRequest
from llmq.common.serving.chat_request import ChatCompletionRequest
from llmq.common.serving.tool_grammar import tool_grammar
from llmq.common.validation import validation_error

pytestmark = pytest.mark.unit

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
USER = [{"role": "user", "content": "weather in Paris?"}]


def body(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": USER, **fields})


def refused(**fields) -> tuple[str, str | None]:
    with pytest.raises(ValidationError) as info:
        body(**fields)
    error = validation_error(list(info.value.errors()))
    return error.message, error.param


def history(arguments: str = '{"city": "Paris", "days": 1}', call_id: str = "call_1"):
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": arguments},
    }
    return [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": "sunny"},
    ]


def test_tool_modes():
    assert body().tool_mode() is None
    assert body(tools=[WEATHER]).tool_mode() == "auto"
    assert body(tools=[WEATHER], tool_choice="none").tool_mode() == "none"
    assert body(tools=[WEATHER], tool_choice="required").tool_mode() == "required"
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert body(tools=[WEATHER], tool_choice=named).tool_mode() == "named"
    assert body(tools=[WEATHER]).parallel_tool_calls is True


def test_forced_choices_need_their_tools():
    message, param = refused(tool_choice="required")
    assert param == "tool_choice" and "needs tools" in message
    named = {"type": "function", "function": {"name": "nope"}}
    message, param = refused(tools=[WEATHER], tool_choice=named)
    assert param == "tool_choice" and "'nope'" in message and "not in tools" in message
    _, param = refused(tools=[WEATHER], tool_choice="sometimes")
    assert param == "tool_choice"
    _, param = refused(tools=[WEATHER, WEATHER])
    assert param == "tools"
    _, param = refused(tools=[{"type": "function", "function": {"name": "bad name!"}}])
    assert param == "tools.0.function.name"


def test_a_tool_history_is_given_to_the_template():
    request = body(messages=history(), tools=[WEATHER, TIME])
    messages = request.template_messages()
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "days": 1}
    assert messages[1]["content"] == ""
    assert messages[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
    tools = request.template_tools()
    assert tools[0]["function"]["parameters"] == WEATHER["function"]["parameters"]
    assert tools[1] == TIME


def test_a_malformed_tool_history_is_refused():
    message, param = refused(messages=[*USER, {"role": "tool", "content": "x"}])
    assert param == "messages" and "no tool call before it" in message
    _, param = refused(messages=history(call_id="call_9"))
    assert param == "messages"
    for arguments in ("{not json", "[1, 2]"):
        message, param = refused(messages=history(arguments=arguments))
        assert param == "messages.1.tool_calls.0.function.arguments", param
        assert "JSON text of an object" in message


@functools.cache
def _byte_tokenizer() -> tuple[LLTokenizer, Tokenizer]:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    vocab["<eos>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<eos>"])
    return LLTokenizer(tok.to_str(), eos_token=vocab["<eos>"]), tok


def _accepts(grammar: str, text: str) -> bool:
    lltok, tok = _byte_tokenizer()
    matcher = LLMatcher(lltok, grammar)
    ids = tok.encode(text).ids
    return matcher.validate_tokens(ids) == len(ids) and (
        matcher.consume_tokens(ids) and matcher.is_accepting()
    )


def test_required_grammar_is_an_array_of_calls_of_the_tools():
    tools = body(tools=[WEATHER, TIME]).tools
    grammar = tool_grammar(tools, None, parallel=True)
    one = {"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}
    two = {"name": "get_time", "parameters": {}}
    assert _accepts(grammar, json.dumps([one, two], separators=(",", ":")))
    assert not _accepts(grammar, "[]")
    assert not _accepts(grammar, json.dumps([{"name": "other", "parameters": {}}]))
    bad = {"name": "get_weather", "parameters": {"city": "Paris"}}
    assert not _accepts(grammar, json.dumps([bad], separators=(",", ":")))
    single = tool_grammar(tools, None, parallel=False)
    assert _accepts(single, json.dumps([one], separators=(",", ":")))
    assert not _accepts(single, json.dumps([one, two], separators=(",", ":")))


def test_named_grammar_is_the_functions_arguments():
    tools = body(tools=[WEATHER, TIME]).tools
    grammar = tool_grammar(tools, "get_weather", parallel=True)
    assert _accepts(grammar, '{"city":"Paris","days":3}')
    assert not _accepts(grammar, '{"city":"Paris"}')
    assert not _accepts(grammar, '{"city":"Paris","days":3,"extra":1}')


def test_an_unusable_schema_is_a_400_naming_tools():
    broken = {"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/nowhere"}}}
    with pytest.raises(InvalidRequest) as info:
        tool_grammar(body(tools=[broken]).tools, "f", parallel=True)
    assert info.value.param == "tools"


@pytest.mark.parametrize(
    "constraint, named",
    [
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"structured_outputs": {"regex": "a+"}}, "structured_outputs"),
        ({"guided_regex": "a+"}, "guided_regex"),
        ({"guided_choice": ["a", "b"]}, "guided_choice"),
    ],
)
@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_a_forced_call_and_another_constraint_are_one_400(constraint, named, choice):
    """The calls are the constrained output: a second constraint cannot hold beside them."""
    with pytest.raises(ValidationError) as caught:
        body(tools=[WEATHER], tool_choice=choice, **constraint)
    error = validation_error(list(caught.value.errors()))
    assert (error.status, error.param) == (400, "tool_choice")
    assert named in error.message and error.message.startswith("tool_choice "), error.message


def test_a_forced_call_with_a_text_response_format_or_auto_with_a_schema_is_served():
    body(tools=[WEATHER], tool_choice="required", response_format={"type": "text"})
    body(tools=[WEATHER], tool_choice="auto", response_format={"type": "json_object"})
