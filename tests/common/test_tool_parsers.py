"""Tool-call parsers on text: each format parsed whole, and streamed in every split (one and two
cut points) reassembling to the same text and calls."""

from __future__ import annotations

import json

import pytest

from llmq.common.serving.tool_calls import ChoiceToolCalls
from llmq.common.serving.tool_parsers import (
    FORCED_ARRAY,
    FORMATS,
    ArgumentsText,
    CallOpened,
    ContentText,
    ParsedOutput,
    ToolCallParser,
    choose_format,
    collect,
    format_for_template,
    parse_output,
)

pytestmark = pytest.mark.unit

HERMES, LLAMA3, MISTRAL = FORMATS["hermes"], FORMATS["llama3_json"], FORMATS["mistral"]

WEATHER = '{"city": "Paris", "days": [1, {"note": "a } and \\" and ]"}]}'

# (format, output, content, calls)
EXAMPLES = [
    (
        HERMES,
        f'Let me look.\n<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
        "Let me look.\n",
        [("get_weather", WEATHER), ("get_time", "{}")],
    ),
    (
        HERMES,  # arguments before the name: sent whole when the object closes
        '<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>',
        "",
        [("f", '{"a": 1}')],
    ),
    (
        HERMES,  # cut short at the end of the output, as vLLM also accepts
        '<tool_call>\n{"name": "f", "arguments": {"x": "<tool_call>"}}',
        "",
        [("f", '{"x": "<tool_call>"}')],
    ),
    (HERMES, "No call here, only < and <tool and {braces}.", None, []),
    (
        LLAMA3,
        '<|python_tag|>{"name": "f", "parameters": {"q": "a;b"}}; {"name": "g", "parameters": {}}',
        "",
        [("f", '{"q": "a;b"}'), ("g", "{}")],
    ),
    (LLAMA3, ' \n{"name": "search", "parameters": {"q": "x"}}', "", [("search", '{"q": "x"}')]),
    (LLAMA3, 'The answer is {"name": "f", "parameters": {}}', None, []),
    (LLAMA3, '{"answer": 42}', None, []),
    (
        MISTRAL,
        'Sure. [TOOL_CALLS][{"name": "f", "arguments": {"a": [1, 2]}}, '
        '{"name": "g", "arguments": {"b": null}}]',
        "Sure. ",
        [("f", '{"a": [1, 2]}'), ("g", '{"b": null}')],
    ),
    (
        FORCED_ARRAY,
        '[{"name":"f","parameters":{"a":1}},{"name":"g","parameters":{"s":"}]"}}]',
        "",
        [("f", '{"a":1}'), ("g", '{"s":"}]"}')],
    ),
]


def _streamed(fmt, pieces: list[str]) -> ParsedOutput:
    parser = ToolCallParser(fmt)
    events = [e for p in pieces for e in parser.feed(p)] + parser.finish()
    return collect(events, parser.broken)


@pytest.mark.parametrize("fmt,text,content,calls", EXAMPLES)
def test_whole_output_parses_to_its_calls(fmt, text, content, calls):
    parsed = parse_output(fmt, text)
    assert parsed.calls == calls
    assert parsed.content == (text if content is None else content)
    assert not parsed.broken
    for _, args in parsed.calls:
        assert isinstance(json.loads(args), dict)


@pytest.mark.parametrize("fmt,text,content,calls", EXAMPLES)
def test_every_split_reassembles_to_the_whole_parse(fmt, text, content, calls):
    whole = parse_output(fmt, text)
    for i in range(len(text) + 1):
        assert _streamed(fmt, [text[:i], text[i:]]) == whole, i
    step = max(1, len(text) // 40)  # two cut points: every pair on a grid
    for i in range(0, len(text) + 1, step):
        for j in range(i, len(text) + 1, step):
            assert _streamed(fmt, [text[:i], text[i:j], text[j:]]) == whole, (i, j)
    assert _streamed(fmt, list(text)) == whole


def test_text_that_may_open_a_call_is_held_back_and_then_sent():
    parser = ToolCallParser(HERMES)
    assert parser.feed("Hello <tool") == [ContentText("Hello ")]
    assert parser.feed("box>") == [ContentText("<toolbox>")]
    assert parser.feed(" <tool_call>") == [ContentText(" ")]
    events = parser.feed('{"name": "f", "arguments": {"a"')
    assert events == [CallOpened(0, "f"), ArgumentsText(0, '{"a"')]
    assert parser.feed(": 1}}</tool_call>") == [ArgumentsText(0, ": 1}")]
    assert parser.finish() == []


def test_arguments_stream_as_they_arrive():
    text = '<tool_call>{"name": "f", "arguments": {"long": "abcdefgh"}}</tool_call>'
    parser = ToolCallParser(HERMES)
    args = []
    for ch in text:
        args += [e.text for e in parser.feed(ch) if isinstance(e, ArgumentsText)]
    assert "".join(args) == '{"long": "abcdefgh"}'
    assert len(args) == len('{"long": "abcdefgh"}')  # one fragment per character fed


def test_a_call_cut_short_is_answered_with_its_arguments_so_far():
    text = 'x <tool_call>{"name": "f", "arguments": {"a": '
    assert parse_output(HERMES, text).cut
    message, reason = ChoiceToolCalls("auto", HERMES, None, True).message(text, "length")
    assert message.content == "x " and reason == "length"
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [
        ("f", '{"a": ')
    ]


def test_a_call_that_closes_invalid_is_text_and_forced_calls_never_are():
    text = '<tool_call>{"name": "f", "arguments": {"a": 1,}}</tool_call>'
    assert parse_output(HERMES, text).broken
    message, reason = ChoiceToolCalls("auto", HERMES, None, True).message(text, "stop")
    assert message.content == text and message.tool_calls is None and reason == "stop"
    calls = ChoiceToolCalls("required", FORCED_ARRAY, None, True)
    message, reason = calls.message('[{"name": "get_wea', "length")
    assert message.content is None and message.tool_calls is None and reason == "length"
    assert _stream_deltas(calls, ['[{"name": "get_wea']) == []  # nor streamed


def test_whole_answer_has_openai_fields():
    text = EXAMPLES[0][1]
    message, reason = ChoiceToolCalls("auto", HERMES, None, True).message(text, "stop")
    assert reason == "tool_calls"
    body = message.model_dump()
    assert body["content"] == "Let me look.\n"
    assert [c["function"]["name"] for c in body["tool_calls"]] == ["get_weather", "get_time"]
    for c in body["tool_calls"]:
        assert c["id"].startswith("call_") and c["type"] == "function"
    message, _ = ChoiceToolCalls("auto", HERMES, None, False).message(text, "stop")
    assert len(message.tool_calls) == 1  # parallel_tool_calls false: the first call only
    message, reason = ChoiceToolCalls("auto", HERMES, None, True).message("plain", "stop")
    assert message.model_dump() == {"role": "assistant", "content": "plain"} and reason == "stop"


def _stream_deltas(calls: ChoiceToolCalls, pieces: list[str]) -> list[dict]:
    deltas = [d for p in pieces for d in calls.feed(p)] + calls.finish()
    return [d.model_dump() for d in deltas]


def _assembled(deltas: list[dict]) -> tuple[str, list[tuple[str, str]]]:
    """The content and the calls a client puts together from the deltas."""
    content = "".join(d.get("content") or "" for d in deltas)
    calls: dict[int, dict] = {}
    for d in deltas:
        for c in d.get("tool_calls", []):
            if c["index"] not in calls:
                assert c["function"]["arguments"] == "" and c["id"].startswith("call_")
                assert c["type"] == "function"
                calls[c["index"]] = {"name": c["function"]["name"], "arguments": ""}
            else:
                assert set(c) == {"index", "function"} and set(c["function"]) == {"arguments"}
                calls[c["index"]]["arguments"] += c["function"]["arguments"]
    return content, [(c["name"], c["arguments"]) for c in calls.values()]


def test_streamed_deltas_open_each_call_then_add_arguments():
    text = EXAMPLES[0][1]
    deltas = _stream_deltas(ChoiceToolCalls("auto", HERMES, None, True), list(text))
    assert _assembled(deltas) == ("Let me look.\n", EXAMPLES[0][3])


@pytest.mark.parametrize("parallel", [True, False], ids=["parallel", "one"])
@pytest.mark.parametrize("fmt,text", [(e[0], e[1]) for e in EXAMPLES if len(e[3]) > 1])
def test_an_output_cut_anywhere_answers_whole_as_it_streams(fmt, text, parallel):
    """max_tokens may cut the output at any character: the whole answer is then the content
    and calls its stream gave (the cut call with its arguments so far), never forced calls'
    array as text."""
    mode = "required" if fmt is FORCED_ARRAY else "auto"
    for end in range(len(text) + 1):
        cut = text[:end]
        stream = ChoiceToolCalls(mode, fmt, None, parallel)
        streamed = _assembled(_stream_deltas(stream, [cut[: end // 2], cut[end // 2 :]]))
        message, reason = ChoiceToolCalls(mode, fmt, None, parallel).message(cut, "length")
        calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
        assert (message.content or "", calls) == streamed, cut
        assert reason == stream.stream_finish_reason("length") == "length"
        if mode == "required":
            assert not message.content, cut


def test_named_function_streams_the_output_as_its_arguments():
    calls = ChoiceToolCalls("named", None, "f", True)
    deltas = _stream_deltas(calls, ['{"a"', ":1}"])
    first = deltas[0]["tool_calls"][0]
    assert first["function"] == {"name": "f", "arguments": ""} and first["index"] == 0
    assert "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas[1:]) == '{"a":1}'
    assert calls.stream_finish_reason("stop") == "stop"
    message, reason = ChoiceToolCalls("named", None, "f", True).message('{"a":1}', "stop")
    assert message.content is None and message.tool_calls[0].function.arguments == '{"a":1}'
    assert reason == "stop"


def test_format_is_told_from_the_chat_template_or_configured():
    assert format_for_template("{% if tools %}<tool_call>{% endif %}") is HERMES
    assert format_for_template("[TOOL_CALLS] {{ x }}") is MISTRAL
    assert format_for_template("<|python_tag|>") is LLAMA3
    assert format_for_template("{{ messages }}") is None and format_for_template(None) is None
    assert choose_format("mistral", "<tool_call>") is MISTRAL
    assert choose_format(None, "<tool_call>") is HERMES
