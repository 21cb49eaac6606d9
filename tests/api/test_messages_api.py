"""Anthropic's Messages API (/v1/messages) end to end: the anthropic SDK against a real API
(with a key) and worker on a random model whose chat template renders tools. Free text is noise
on random weights: it is checked against the reference engine's greedy tokens and the chat
route's text for the same messages; structured output and forced calls against their
schemas."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest

from llmq.common.model_files import load_tokenizer
from tests.api.api_stack import Reference, Stack, batch_results
from tests.api.conftest import TOOLS_KEY as KEY

QUESTION = "What is the weather in Paris?"
SYSTEM = "You answer questions about the weather, briefly and precisely."
WEATHER_SCHEMA = {
    "type": "object",
    "$defs": {"City": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]}},
    "properties": {
        "city": {"$ref": "#/$defs/City"},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
WEATHER = {"name": "get_weather", "description": "The forecast.", "input_schema": WEATHER_SCHEMA}
# The SDK has no typed temperature (raw HTTP and older clients send it): greedy via extra_body.
GREEDY = {"extra_body": {"temperature": 0}}
STREAM_TYPES = [
    "message_start",
    "ping",
    "content_block_start",
    "content_block_delta",
    "content_block_stop",
    "message_delta",
    "message_stop",
]


@pytest.fixture(scope="module")
def served(tools_stack):
    return tools_stack


@pytest.fixture(scope="module")
def greedy(served: Stack, ref: Reference) -> Reference:
    """The reference engine with the served copy's tokenizer (its tools template)."""
    return Reference(load_tokenizer(served.model), ref.engine)


def sdk(served: Stack, **kwargs) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=served.base, max_retries=0, timeout=120, **({"api_key": KEY} | kwargs)
    )


def chat_client(served: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.base}/v1", api_key=KEY, max_retries=0, timeout=120)


def text_of(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def prompt_count(message) -> int:
    usage = message.usage
    assert usage.cache_creation_input_tokens == 0
    return usage.input_tokens + usage.cache_read_input_tokens


def test_create_answers_the_reference_engines_greedy_text(served, greedy):
    """With a system prompt: the reference's greedy tokens of the same rendered prompt; the
    usage counts that prompt (read from the prefix cache on a repeat) and the output."""
    c = sdk(served)
    user = [{"role": "user", "content": QUESTION}]
    r = c.messages.create(model=served.model, max_tokens=12, **GREEDY, system=SYSTEM, messages=user)
    ids = greedy.chat_ids([{"role": "system", "content": SYSTEM}, *user])
    expected = greedy.text(greedy.greedy([ids], 12)[0])
    assert r.id.startswith("msg_") and r.type == "message" and r.role == "assistant"
    assert r.model == served.model and [b.type for b in r.content] == ["text"]
    if r.stop_reason == "max_tokens":
        assert text_of(r) == expected and r.usage.output_tokens == 12
    else:  # the model's EOS: the reference (which ignores EOS) goes on past it
        assert r.stop_reason == "end_turn" and expected.startswith(text_of(r))
    assert r.stop_sequence is None and prompt_count(r) == len(ids)
    again = c.messages.create(
        model=served.model, max_tokens=1, **GREEDY, system=SYSTEM, messages=user
    )
    assert prompt_count(again) == len(ids) and again.usage.cache_read_input_tokens >= 16


def test_claude_codes_request_shape_is_served_as_anthropics_api_serves_it(served, greedy):
    """A system turn inside messages (with its own output_config), context_management, an
    effort the template cannot take, adaptive thinking and cache_control marks: the prompt is
    rendered with the system turn where it stands (the template renders one there), and
    count_tokens counts that prompt."""
    c = sdk(served)
    mark = {"cache_control": {"type": "ephemeral"}}
    messages = [
        {"role": "user", "content": [{"type": "text", "text": QUESTION, **mark}]},
        {"role": "system", "content": "Today is Monday.", "output_config": {"effort": "high"}},
    ]
    fields = {
        "system": [{"type": "text", "text": SYSTEM, **mark}],
        "messages": messages,
        "thinking": {"type": "adaptive"},
        "output_config": {"effort": "medium"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    }
    raw = c.beta.messages.with_raw_response.create(
        model=served.model, max_tokens=4, **GREEDY, **fields
    )
    r = raw.parse()
    assert raw.headers["llmq-effort-ignored"] == "high"  # the last turn's own effort
    ids = greedy.chat_ids(
        [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": QUESTION},
            {"role": "system", "content": "Today is Monday."},
        ]
    )
    usage = r.usage
    cached = usage.cache_read_input_tokens + usage.cache_creation_input_tokens
    assert usage.input_tokens + cached == len(ids)
    assert c.beta.messages.count_tokens(model=served.model, **fields).input_tokens == len(ids)
    head = httpx.head(f"{served.base}/v1/models", headers={"x-api-key": KEY})
    assert head.status_code == 200 and head.content == b""  # GET's status, no body


def test_stop_sequences_end_the_text_before_them(served):
    c = sdk(served)
    user = [{"role": "user", "content": "Tell me a story."}]
    whole = text_of(c.messages.create(model=served.model, max_tokens=16, **GREEDY, messages=user))
    stop = whole[len(whole) // 2 :][:3]
    assert stop.strip(), whole
    r = c.messages.create(
        model=served.model, max_tokens=16, **GREEDY, messages=user,
        stop_sequences=["never-generated-zz", stop],
    )  # fmt: skip
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop
    assert text_of(r) == whole[: whole.find(stop)]


def sse_events(served: Stack, body: dict) -> list[tuple[str, dict]]:
    """The (event, data) pairs of a streamed answer as sent (the SDK drops the pings)."""
    events: list[tuple[str, dict]] = []
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    url = f"{served.base}/v1/messages"
    with httpx.stream("POST", url, json=body, headers=headers, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                data = json.loads(line.removeprefix("data: "))
                assert data["type"] == name
                events.append((name, data))
    return events


def test_stream_sends_every_event_in_order_with_the_greedy_text(served):
    """The events in Anthropic's order, as sent; their text is the non-streamed answer's, the
    SDK's stream helper's and the chat route's for the same messages."""
    c = sdk(served)
    user = [{"role": "user", "content": QUESTION}]
    body = {"model": served.model, "max_tokens": 10, "messages": user}
    events = sse_events(served, {**body, "temperature": 0, "stream": True})
    types = [name for name, _ in events]
    assert list(dict.fromkeys(types)) == STREAM_TYPES
    assert types.count("message_start") == types.count("message_stop") == 1
    start, delta = events[0][1]["message"], events[-2][1]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["input_tokens"] > 0
    text = "".join(data["delta"]["text"] for name, data in events if name == "content_block_delta")
    whole = c.messages.create(**body, **GREEDY)
    chat = chat_client(served).chat.completions.create(
        model=served.model, messages=user, max_tokens=10, temperature=0
    )
    assert text == text_of(whole) == chat.choices[0].message.content
    assert delta["delta"]["stop_reason"] == whole.stop_reason
    assert delta["usage"]["output_tokens"] == whole.usage.output_tokens
    with c.messages.stream(**body, **GREEDY) as stream:
        final = stream.get_final_message()
    assert text_of(final) == text and prompt_count(final) == chat.usage.prompt_tokens


def test_output_config_format_gives_json_valid_under_its_schema(served):
    r = sdk(served).messages.create(
        model=served.model, max_tokens=40, **GREEDY, messages=[{"role": "user", "content": QUESTION}],
        output_config={"format": {"type": "json_schema", "schema": WEATHER_SCHEMA}},
    )  # fmt: skip
    assert r.stop_reason == "end_turn", r
    jsonschema.validate(json.loads(text_of(r)), WEATHER_SCHEMA)


def test_a_tool_loop_forced_call_then_its_result_then_an_answer(served):
    c = sdk(served)
    messages = [{"role": "user", "content": QUESTION}]
    first = c.messages.create(
        model=served.model, max_tokens=60, **GREEDY, messages=messages, tools=[WEATHER],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
    )  # fmt: skip
    assert first.stop_reason == "tool_use", first
    assert [b.type for b in first.content] == ["tool_use"]
    call = first.content[0]
    assert call.id.startswith("toolu_") and call.name == "get_weather"
    jsonschema.validate(call.input, WEATHER_SCHEMA)
    with c.messages.stream(
        model=served.model,
        max_tokens=60,
        **GREEDY,
        messages=messages,
        tools=[WEATHER],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
    ) as stream:  # the arguments as input_json_deltas, put together by the SDK
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in streamed.content] == [(call.name, call.input)]
    result = {"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 24 C."}
    messages += [
        {"role": "assistant", "content": first.content},
        {"role": "user", "content": [result]},
    ]
    second = c.messages.create(
        model=served.model, max_tokens=6, **GREEDY, messages=messages, tools=[WEATHER]
    )
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use")
    # The result reached the prompt as chat's tool message answering the call.
    tool_call = {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": json.dumps(call.input)},
    }
    chat_messages = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": None, "tool_calls": [tool_call]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 C."},
    ]  # fmt: skip
    chat = chat_client(served).chat.completions.create(
        model=served.model, messages=chat_messages, max_tokens=1,
        tools=[{"type": "function", "function": {"name": "get_weather", "description": "The forecast.", "parameters": WEATHER_SCHEMA}}],
    )  # fmt: skip
    assert prompt_count(second) == chat.usage.prompt_tokens


@pytest.mark.parametrize("max_tokens", [9, 23, 41, 57])  # whole, the calls take 62
def test_forced_calls_cut_by_max_tokens_answer_as_they_stream(served, max_tokens):
    """Parallel forced calls cut short: the whole answer's tool_use blocks are the ones the
    stream delivers (the cut one with its input as far as it went), stop_reason max_tokens, and
    no text block ever holds the internal array of calls."""
    c = sdk(served)
    weather = {
        **WEATHER,
        "input_schema": {
            **WEATHER_SCHEMA,
            "properties": {
                **WEATHER_SCHEMA["properties"],
                "note": {"type": "string", "maxLength": 40},
            },
        },
    }
    fields = dict(
        model=served.model, max_tokens=max_tokens, **GREEDY, tools=[weather],
        messages=[{"role": "user", "content": QUESTION}], tool_choice={"type": "any"},
    )  # fmt: skip
    whole = c.messages.create(**fields)
    with c.messages.stream(**fields) as stream:
        streamed = stream.get_final_message()
    assert whole.stop_reason == streamed.stop_reason == "max_tokens", whole
    assert all(b.type == "tool_use" for b in whole.content), whole.content
    assert [(b.name, b.input) for b in whole.content] == [
        (b.name, b.input) for b in streamed.content
    ]
    assert whole.usage.output_tokens == max_tokens


def test_count_tokens_is_the_prompts_token_count(served):
    c = sdk(served)
    user = [{"role": "user", "content": QUESTION}]
    counted = c.messages.count_tokens(
        model=served.model, system=SYSTEM, messages=user, tools=[WEATHER]
    )
    tokenized = httpx.post(
        f"{served.base}/tokenize",
        headers={"Authorization": f"Bearer {KEY}"},
        json={
            "messages": [{"role": "system", "content": SYSTEM}, *user],
            "tools": [{"type": "function", "function": {"name": "get_weather", "description": "The forecast.", "parameters": WEATHER_SCHEMA}}],
        },
    ).json()  # fmt: skip
    assert counted.input_tokens == tokenized["count"] > 0
    r = c.messages.create(
        model=served.model, max_tokens=1, system=SYSTEM, messages=user, tools=[WEATHER]
    )
    assert prompt_count(r) == counted.input_tokens


def test_errors_come_in_anthropics_shape_and_statuses(served):
    c = sdk(served)
    user = [{"role": "user", "content": "hi"}]
    with pytest.raises(anthropic.NotFoundError) as missing:
        c.messages.create(model="no-such-model", max_tokens=4, messages=user)
    assert missing.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as bad:
        c.post(
            "/v1/messages",
            body={"model": served.model, "messages": user},
            cast_to=anthropic.types.Message,
        )
    assert (
        bad.value.body["type"] == "error"
        and bad.value.body["error"]["type"] == "invalid_request_error"
    )
    assert "max_tokens" in bad.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match="Extra inputs are not permitted"):
        c.messages.create(
            model=served.model, max_tokens=4, messages=user, extra_body={"surprise": 1}
        )
    image = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": "AA=="},
    }
    with pytest.raises(anthropic.BadRequestError, match="not an image of a served format"):
        c.messages.create(
            model=served.model, max_tokens=4, messages=[{"role": "user", "content": [image]}]
        )
    # The template has no reasoning_effort: the effort is accepted, not applied, and named.
    raw = c.messages.with_raw_response.create(
        model=served.model, max_tokens=1, messages=user, output_config={"effort": "high"}
    )
    assert raw.headers["llmq-effort-ignored"] == "high" and raw.parse().usage.output_tokens == 1
    with pytest.raises(anthropic.AuthenticationError) as denied:
        sdk(served, api_key="sk-wrong").messages.count_tokens(model=served.model, messages=user)
    assert denied.value.body == {
        "type": "error",
        "error": {"type": "authentication_error", "message": denied.value.body["error"]["message"]},
    }
    bearer = sdk(served, api_key=None, auth_token=KEY)  # Authorization: Bearer
    assert bearer.messages.count_tokens(model=served.model, messages=user).input_tokens > 0
    lost = httpx.post(f"{served.base}/v1/messages/nope", headers={"x-api-key": KEY}, json={})
    assert lost.status_code == 404 and lost.json()["error"]["type"] == "not_found_error"
    # fmt: skip


def test_batch_lines_call_messages(served):
    """A batch of /v1/messages lines: answered as the route answers them, bad input a 400."""
    good = {
        "model": served.model, "max_tokens": 6, "temperature": 0,
        "messages": [{"role": "user", "content": QUESTION}],
    }  # fmt: skip
    lines = [("good", good), ("bad", {k: v for k, v in good.items() if k != "max_tokens"})]
    with chat_client(served) as client:
        results = batch_results(client, "/v1/messages", lines)
    assert results["good"]["status_code"] == 200
    answer = results["good"]["body"]
    direct = sdk(served).messages.create(
        **{k: v for k, v in good.items() if k != "temperature"}, **GREEDY
    )
    assert answer["type"] == "message" and answer["content"] == [
        b.model_dump(exclude_none=True) for b in direct.content
    ]
    assert results["bad"]["status_code"] == 400
