"""The Responses API (/v1/responses) end to end: the openai client against a real API (two
tenants' keys) and worker on a random model whose chat template renders tools. Free text is
noise on random weights: it is checked against the chat route's greedy text for the same
messages; structured output and forced calls are checked against their schemas."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

KEY, OTHER_KEY = "sk-responses-a", "sk-responses-b"
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "name": "get_weather", "parameters": WEATHER_SCHEMA, "strict": True}
FORCED = {"type": "function", "name": "get_weather"}
QUESTION = "What is the weather in Paris?"
STREAM_TYPES = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


class Forecast(BaseModel):
    model_config = ConfigDict(extra="forbid")
    city: Literal["Paris", "Oslo", "Lima"]
    days: int = Field(ge=1, le=9)


@dataclass(frozen=True)
class Served:
    url: str
    model: str

    def client(self, key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def served(tools_stack) -> Served:
    """The shared tools-model stack's worker, behind an API of its own that knows two
    tenants' keys."""
    url = tools_stack.api("responses", api_key=f"{KEY},{OTHER_KEY}")
    yield Served(url, tools_stack.model)
    tools_stack.apis.pop("responses")[0].terminate()


def test_create_answers_the_chat_routes_greedy_text(served):
    """String input and instructions: the same prompt, text and usage as chat's system + user
    messages; cut at max_output_tokens, the response is incomplete as chat's is 'length'."""
    c = served.client()
    r = c.responses.create(
        model=served.model, input=QUESTION, instructions="Be brief.", temperature=0,
        max_output_tokens=12, metadata={"run": "1"},
    )  # fmt: skip
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}]
    chat = c.chat.completions.create(
        model=served.model, messages=messages, temperature=0, max_tokens=12
    )
    assert r.id.startswith("resp_") and r.object == "response" and r.model == served.model
    assert r.output_text == chat.choices[0].message.content
    assert [item.type for item in r.output] == ["message"]
    assert r.output[0].content[0].type == "output_text" and r.output[0].id.startswith("msg_")
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    if chat.choices[0].finish_reason == "length":
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    else:
        assert r.status == "completed" and r.incomplete_details is None
    assert r.instructions == "Be brief." and r.max_output_tokens == 12
    assert r.metadata == {"run": "1"} and r.temperature == 0 and r.store is True


def test_stream_sends_every_event_in_order(served):
    c = served.client()
    with c.responses.stream(
        model=served.model, input=QUESTION, temperature=0, max_output_tokens=10
    ) as stream:
        events = list(stream)
    final = events[-1].response  # cut at max_output_tokens: response.incomplete, most likely
    types = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert list(dict.fromkeys(types)) == STREAM_TYPES + [f"response.{final.status}"]
    assert types.count("response.output_text.delta") == len(deltas) >= 1
    assert "".join(deltas) == final.output_text
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == final.output_text
    whole = c.responses.create(
        model=served.model, input=QUESTION, temperature=0, max_output_tokens=10
    )
    assert final.output_text == whole.output_text
    for field in ("input_tokens", "output_tokens", "total_tokens"):
        assert getattr(final.usage, field) == getattr(whole.usage, field)
    # The same prompt a second time may meet the prefix cache: never its last token.
    for usage in (final.usage, whole.usage):
        assert 0 <= usage.input_tokens_details.cached_tokens < usage.input_tokens
    assert c.responses.retrieve(final.id).output_text == final.output_text


def test_parse_gives_a_valid_instance_of_the_model(served):
    """text.format json_schema through the structured-output grammar: on random weights only
    the grammar makes the output parse."""
    r = served.client().responses.parse(
        model=served.model, input=QUESTION, text_format=Forecast, max_output_tokens=100
    )
    assert r.status == "completed"
    assert isinstance(r.output_parsed, Forecast)
    assert Forecast.model_validate_json(r.output_text) == r.output_parsed
    assert r.text.format.type == "json_schema"


def test_function_call_round_trip_with_previous_response_id(served):
    """A forced call, its output sent back after the stored response: the second turn's prompt
    holds the first's (more input tokens than the output alone)."""
    c = served.client()
    first = c.responses.create(
        model=served.model, input=QUESTION, tools=[WEATHER], tool_choice=FORCED,
        temperature=0, max_output_tokens=60,
    )  # fmt: skip
    assert first.status == "completed", first
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    args = json.loads(call.arguments)
    jsonschema.validate(args, WEATHER_SCHEMA)
    answer = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    second = c.responses.create(
        model=served.model, input=[answer], previous_response_id=first.id, tools=[WEATHER],
        temperature=0, max_output_tokens=4,
    )  # fmt: skip
    assert second.previous_response_id == first.id
    alone = c.responses.create(
        model=served.model, input="sunny", tools=[WEATHER], temperature=0, max_output_tokens=4
    )
    assert second.usage.input_tokens > alone.usage.input_tokens + first.usage.output_tokens
    # The same conversation sent whole, without the stored response: the same prompt.
    whole = c.responses.create(
        model=served.model, tools=[WEATHER], temperature=0, max_output_tokens=4,
        input=[{"role": "user", "content": QUESTION}, call.model_dump(exclude_none=True), answer],
    )  # fmt: skip
    assert whole.usage.input_tokens == second.usage.input_tokens
    assert whole.output_text == second.output_text


def test_streamed_function_call_arguments(served):
    c = served.client()
    with c.responses.stream(
        model=served.model, input=QUESTION, tools=[WEATHER], tool_choice="required",
        parallel_tool_calls=False, temperature=0, max_output_tokens=60,
    ) as stream:  # fmt: skip
        events = list(stream)
        final = stream.get_final_response()
    types = list(dict.fromkeys(e.type for e in events))
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    [call] = final.output
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert "".join(deltas) == call.arguments
    jsonschema.validate(json.loads(call.arguments), WEATHER_SCHEMA)


def test_stored_response_is_its_tenants_until_deleted(served):
    c, other = served.client(), served.client(OTHER_KEY)
    r = c.responses.create(model=served.model, input=QUESTION, max_output_tokens=3)
    assert c.responses.retrieve(r.id).model_dump() == r.model_dump()
    for call in (other.responses.retrieve, other.responses.delete, c.responses.cancel):
        with pytest.raises((openai.NotFoundError, openai.BadRequestError)) as exc:
            call(r.id)
        assert exc.value.status_code == (400 if call == c.responses.cancel else 404)
    with pytest.raises(openai.NotFoundError):
        other.responses.create(
            model=served.model, input="x", previous_response_id=r.id, max_output_tokens=1
        )
    c.responses.delete(r.id)
    for call in (c.responses.retrieve, c.responses.delete, c.responses.cancel):
        with pytest.raises(openai.NotFoundError):
            call(r.id)
    unstored = c.responses.create(model=served.model, input="x", max_output_tokens=1, store=False)
    headers = {"Authorization": f"Bearer {KEY}"}
    for path in (unstored.id, "resp_../x", "resp_" + "0" * 32, "file-" + "0" * 32):
        got = httpx.get(f"{served.url}/v1/responses/{path}", headers=headers)
        assert got.status_code == 404, (path, got.text)


@pytest.mark.parametrize("tool", ["web_search", "file_search", "code_interpreter"])
def test_hosted_tools_are_dropped_and_refused_by_name_when_forced(served, tool):
    client = served.client()
    r = client.responses.create(
        model=served.model, input=QUESTION, tools=[{"type": tool}], max_output_tokens=1
    )
    assert r.status == "incomplete" and r.usage.output_tokens == 1  # answered without it
    with pytest.raises(openai.BadRequestError) as exc:
        client.responses.create(
            model=served.model,
            input=QUESTION,
            tools=[{"type": tool}],
            tool_choice={"type": tool},
            max_output_tokens=1,
        )
    assert tool in exc.value.message and exc.value.code == "invalid_value"
    assert exc.value.body["param"] == "tool_choice"
