"""Tool calls end to end: the openai client against a real API and worker on a random model
whose chat template renders tools. On random weights only the grammar makes a forced call's
arguments valid, so every call checked here is validated against its tool's schema."""

from __future__ import annotations

import json
from dataclasses import dataclass

import httpx
import jsonschema
import openai
import pytest

from tests.api.conftest import TOOLS_KEY

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city over some days",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 9},
                "metric": {"type": "boolean"},
            },
            "required": ["city", "days", "metric"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@dataclass(frozen=True)
class Served:
    url: str
    model: str
    headers = {"Authorization": f"Bearer {TOOLS_KEY}"}

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.url}/v1", api_key=TOOLS_KEY, max_retries=0, timeout=120
        )

    def create(self, **kwargs):
        return self.client().chat.completions.create(model=self.model, **kwargs)


@pytest.fixture(scope="module")
def base(tools_stack) -> Served:
    """The shared tools-model stack (its API requires TOOLS_KEY)."""
    return Served(tools_stack.base, tools_stack.model)


def valid_call(name: str, arguments: str) -> dict:
    args = json.loads(arguments)
    jsonschema.validate(args, SCHEMAS[name])
    return args


def streamed(base: Served, **kwargs) -> tuple[dict[int, dict], list]:
    """Each choice's content, calls (reassembled from their deltas) and finish reason."""
    choices: dict[int, dict] = {}
    chunks = list(base.create(stream=True, **kwargs))
    for chunk in chunks:
        for c in chunk.choices:
            got = choices.setdefault(c.index, {"content": "", "calls": {}, "finish": None})
            got["content"] += c.delta.content or ""
            for call in c.delta.tool_calls or []:
                if call.index not in got["calls"]:  # its first delta: id, type, name, ""
                    assert call.id.startswith("call_") and call.type == "function"
                    assert call.function.arguments == ""
                    got["calls"][call.index] = [call.function.name, ""]
                else:
                    assert call.id is None and call.function.name is None
                    got["calls"][call.index][1] += call.function.arguments
            if c.finish_reason is not None:
                got["finish"] = c.finish_reason
    return choices, chunks


def whole_calls(message) -> list[tuple[str, str]]:
    for call in message.tool_calls:
        assert call.id.startswith("call_") and call.type == "function"
    return [(c.function.name, c.function.arguments) for c in message.tool_calls]


@pytest.mark.parametrize("choice", ["required", NAMED], ids=["required", "named"])
def test_forced_calls_are_valid_and_streamed_alike(base, choice):
    kwargs = dict(
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice=choice,
        temperature=0,
        max_tokens=200,
        parallel_tool_calls=False,
    )
    r = base.create(**kwargs)
    message, reason = r.choices[0].message, r.choices[0].finish_reason
    calls = whole_calls(message)
    assert len(calls) == 1 and message.content is None
    if choice == "required":
        assert reason == "tool_calls"
    else:
        assert reason == "stop" and calls[0][0] == "get_weather"
    for name, arguments in calls:
        valid_call(name, arguments)
    choices, _ = streamed(base, **kwargs)
    got = choices[0]
    assert [tuple(c) for c in got["calls"].values()] == calls  # greedy: the same calls
    assert got["content"] == "" and got["finish"] == reason


def test_required_with_parallel_calls_and_sampling(base):
    kwargs = dict(
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        temperature=1.0,
        seed=7,
        n=3,
        max_tokens=400,
    )
    r = base.create(**kwargs)
    choices, _ = streamed(base, **kwargs)
    assert any(c.finish_reason == "tool_calls" for c in r.choices)
    for c in r.choices:
        if c.finish_reason == "length":  # random weights may go on adding calls
            continue
        assert c.finish_reason == "tool_calls"
        calls = whole_calls(c.message)
        assert calls and all(valid_call(n, a) is not None for n, a in calls)
        assert [tuple(x) for x in choices[c.index]["calls"].values()] == calls  # same seed
        assert choices[c.index]["finish"] == "tool_calls"


def test_auto_text_streams_as_it_answers(base):
    """Auto on a model that writes no call: the text, streamed or not, is the same."""
    kwargs = dict(messages=MESSAGES, tools=TOOLS, temperature=0, max_tokens=30)
    r = base.create(**kwargs)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content
    choices, _ = streamed(base, **kwargs)
    assert choices[0]["content"] == r.choices[0].message.content
    assert choices[0]["finish"] == r.choices[0].finish_reason and not choices[0]["calls"]


def test_named_call_streams_arguments_as_generated(base):
    choices, chunks = streamed(
        base, messages=MESSAGES, tools=TOOLS, tool_choice=NAMED, temperature=0, max_tokens=200
    )
    fragments = [
        call.function.arguments
        for chunk in chunks
        for c in chunk.choices
        for call in c.delta.tool_calls or []
        if call.function.arguments
    ]
    assert len(fragments) > 1  # not one piece at the end
    name, arguments = choices[0]["calls"][0]
    assert name == "get_weather" and valid_call(name, arguments)


def test_a_tool_call_history_is_rendered(base):
    call = {
        "id": "call_abc",
        "type": "function",
        "function": {
            "name": "get_weather",
            "arguments": '{"city": "Paris", "days": 1, "metric": true}',
        },
    }
    history = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_abc", "content": "sunny, 21 C"},
    ]
    with_history = base.create(messages=history, tools=TOOLS, max_tokens=2)
    plain = base.create(messages=MESSAGES, max_tokens=2)
    with_tools = base.create(messages=MESSAGES, tools=TOOLS, max_tokens=2)
    assert plain.usage.prompt_tokens < with_tools.usage.prompt_tokens  # the tools are shown
    assert with_tools.usage.prompt_tokens < with_history.usage.prompt_tokens
    forced = base.create(
        messages=history,
        tools=TOOLS,
        tool_choice="required",
        temperature=0,
        max_tokens=200,
        parallel_tool_calls=False,
    )
    for name, arguments in whole_calls(forced.choices[0].message):
        valid_call(name, arguments)


def test_tool_requests_refused_with_400(base):
    url = f"{base.url}/v1/chat/completions"
    other = {"type": "function", "function": {"name": "nope"}}
    cases = [
        ({"tools": TOOLS, "tool_choice": other}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": NAMED}, "tool_choice"),
        ({"tools": TOOLS, "messages": [*MESSAGES, {"role": "tool", "content": "x"}]}, "messages"),
    ]
    bad_args = {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{"}}
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [bad_args]}]
    cases.append(({"messages": history}, "messages.1.tool_calls.0.function.arguments"))
    for extra, param in cases:
        body = {"messages": MESSAGES, "model": base.model, **extra}
        r = httpx.post(url, json=body, headers=base.headers, timeout=60)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param, r.text


CLOSED = {"additionalProperties": False}


# Two tools whose parameters are pydantic's shape (a sub-model holding an enum, both in $defs),
# each naming its enum Color, with different values.
def _painted(name: str, colors: list[str]) -> dict:
    color = {"type": "string", "enum": colors}
    paint = {"type": "object", "properties": {"color": {"$ref": "#/$defs/Color"}}}
    parameters = {
        "type": "object",
        "properties": {"paint": {"$ref": "#/$defs/Paint"}, "coats": {"enum": [1, 2]}},
        "required": ["paint", "coats"],
        **CLOSED,
        "$defs": {"Color": color, "Paint": paint | {"required": ["color"], **CLOSED}},
    }
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def test_required_calls_follow_each_tools_defs(base):
    """The required choice's grammar carries both tools' $defs (the shared name Color renamed
    apart): every call is valid under its own tool's schema, references resolved there."""
    tools = [_painted("warm", ["red", "amber"]), _painted("cold", ["blue", "teal"])]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    r = base.create(
        messages=MESSAGES, tools=tools, tool_choice="required", parallel_tool_calls=False,
        temperature=1.0, seed=3, n=6, max_tokens=60,
    )  # fmt: skip
    names = set()
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls", choice
        [(name, arguments)] = whole_calls(choice.message)
        jsonschema.validate(json.loads(arguments), schemas[name])
        names.add(name)
    assert names == set(schemas)  # both tools called, each answered by its own Color


def test_forced_calls_cut_by_max_tokens_answer_as_they_stream(base):
    """Sampled with a seed, the whole answer and the stream are the same tokens: cut at
    max_tokens, both give the complete calls and the cut one's arguments as far as they got,
    finish_reason "length", and never the forced array as text."""
    cut_calls, cut_after_a_call = 0, 0
    for max_tokens, choice in ((25, "required"), (50, "required"), (60, "required"),
                               (70, "required"), (9, NAMED)):  # fmt: skip
        kwargs = dict(
            messages=MESSAGES, tools=TOOLS, tool_choice=choice, temperature=1.0, seed=max_tokens,
            n=3, max_tokens=max_tokens,
        )  # fmt: skip
        r = base.create(**kwargs)
        choices, _ = streamed(base, **kwargs)
        for c in r.choices:
            calls = [(f.function.name, f.function.arguments) for f in c.message.tool_calls or []]
            assert [tuple(x) for x in choices[c.index]["calls"].values()] == calls
            assert c.finish_reason == choices[c.index]["finish"]
            assert not c.message.content and not choices[c.index]["content"]
            if c.finish_reason == "length":
                cut_calls += bool(calls)
                cut_after_a_call += len(calls) > 1
    assert cut_calls >= 6 and cut_after_a_call >= 1


def _assembled_events(events) -> tuple[list[tuple[str, str, str]], str]:
    """The function calls a Responses stream's events build, and the text it sends."""
    calls: dict[str, list[str]] = {}
    for e in events:
        if e.type == "response.output_item.added" and e.item.type == "function_call":
            calls[e.item.id] = [e.item.name, "", ""]
        elif e.type == "response.function_call_arguments.delta":
            calls[e.item_id][1] += e.delta
        elif e.type == "response.output_item.done" and e.item.type == "function_call":
            calls[e.item.id][2] = e.item.status
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    return [tuple(c) for c in calls.values()], text


def test_responses_cut_calls_are_the_same_streamed_and_whole(base):
    """The same on the Responses API (greedy: it takes no seed): function_call items, the last
    one incomplete with its arguments so far (or an empty message, cut before a call's name)."""
    client = base.client()
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    cut_calls = 0
    for limit in (20, 33, 45):
        kwargs = dict(
            model=base.model, input=MESSAGES[0]["content"], tools=tools, tool_choice="required",
            temperature=0, max_output_tokens=limit,
        )  # fmt: skip
        whole = client.responses.create(**kwargs)
        events = list(client.responses.create(stream=True, **kwargs))
        calls, text = _assembled_events(events)
        final = events[-1].response
        assert [
            (o.name, o.arguments, o.status) for o in whole.output if o.type == "function_call"
        ] == calls
        assert [o.model_dump(exclude={"id", "call_id"}) for o in final.output] == [
            o.model_dump(exclude={"id", "call_id"}) for o in whole.output
        ]
        assert whole.status == final.status == "incomplete" and text == whole.output_text == ""
        assert whole.output[-1].status == "incomplete"
        cut_calls += bool(calls)
    assert cut_calls >= 2


def test_reasoning_effort_refused_by_a_template_without_the_knob(base):
    """This template reads no reasoning_effort: a 400 naming it, never dropped silently."""
    body = {"messages": MESSAGES, "model": base.model, "reasoning_effort": "low"}
    r = httpx.post(f"{base.url}/v1/chat/completions", json=body, headers=base.headers, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "reasoning_effort", r.text
