"""Structured output end to end, against real processes (redis-server, `llmq worker`, `llmq api`)
driven by the openai SDK: on the random test model, whose free output is noise, every
constrained output is what its schema, regex, choice list or grammar allows."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pytest
from openai.lib._pydantic import to_strict_json_schema

from tests.harness import wait_for
from tests.structured_schemas import MODELS, Event

MESSAGES = [{"role": "user", "content": "Describe the thing as JSON."}]
ROOM = 1000  # max_tokens: far more than any bounded schema here needs
REGEX = r"[a-z]{3}-[0-9]{2}(,[a-z]{2})?"
CHOICES = ["positive", "negative", "neutral"]
LARK = 'start: "(" num ("," num)* ")"\nnum: /[1-9][0-9]?/'


@pytest.fixture(scope="module")
def base(main) -> str:
    """The base URL of the package's shared stack of the test model."""
    return main.base


@pytest.fixture(scope="module")
def client(base) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def aclient(base) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=300)


def is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def compact(text: str) -> bool:
    """Whether the JSON text has one space after each ':' and ',' and no other whitespace
    outside its strings (as json.dumps writes it)."""
    strings = iter(range(len(text)))  # each string becomes a distinct plain one: keys stay apart
    skeleton = re.sub(r'"(?:[^"\\]|\\.)*"', lambda _: f'"{next(strings)}"', text)
    return skeleton == json.dumps(json.loads(skeleton))


def model_name(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def chat_text(client, stream: bool, **kwargs) -> tuple[str, str]:
    """The first choice's text and finish reason, streamed or not."""
    if not stream:
        r = client.chat.completions.create(model=model_name(client), messages=MESSAGES, **kwargs)
        return r.choices[0].message.content, r.choices[0].finish_reason
    text, finish = "", None
    chunks = client.chat.completions.create(
        model=model_name(client), messages=MESSAGES, stream=True, **kwargs
    )
    for chunk in chunks:
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    return text, finish


def completion_text(client, stream: bool, **kwargs) -> tuple[str, str]:
    if "response_format" in kwargs:  # not a parameter of the SDK's completions
        kwargs["extra_body"] = {"response_format": kwargs.pop("response_format")}
    if not stream:
        r = client.completions.create(model=model_name(client), prompt="Answer:", **kwargs)
        return r.choices[0].text, r.choices[0].finish_reason
    text, finish = "", None
    for chunk in client.completions.create(
        model=model_name(client), prompt="Answer:", stream=True, **kwargs
    ):
        for c in chunk.choices:
            text += c.text
            finish = c.finish_reason or finish
    return text, finish


ENDPOINTS = {"chat": chat_text, "completions": completion_text}


# ---- JSON schemas --------------------------------------------------------------------------
def test_free_output_of_the_test_model_is_noise(client):
    texts = [chat_text(client, False, max_tokens=40, seed=s)[0] for s in range(3)]
    assert not any(is_json(t) for t in texts), texts


def test_parse_returns_a_valid_object_for_every_schema(aclient, client):
    assert len(MODELS) >= 20
    name = model_name(client)

    async def one(i: int, model):
        r = await aclient.chat.completions.parse(
            model=name, messages=MESSAGES, response_format=model, max_tokens=ROOM, seed=i
        )
        return model, r.choices[0]

    async def every():
        return await asyncio.gather(*(one(i, m) for i, m in enumerate(MODELS)))

    for model, choice in asyncio.run(every()):
        assert choice.finish_reason == "stop", (model.__name__, choice.message.content)
        assert isinstance(choice.message.parsed, model), model.__name__
        content = json.loads(choice.message.content)
        jsonschema.validate(content, to_strict_json_schema(model))


@pytest.mark.parametrize("endpoint", ENDPOINTS)
@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_on_both_endpoints_streamed_or_not(client, endpoint, stream):
    schema = to_strict_json_schema(Event)
    fmt = {"type": "json_schema", "json_schema": {"name": "event", "schema": schema}}
    for seed, extra in enumerate(
        ({"response_format": fmt}, {"extra_body": {"guided_json": schema}})
    ):
        text, finish = ENDPOINTS[endpoint](client, stream, max_tokens=ROOM, seed=seed, **extra)
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), schema)
        assert compact(text), text


@pytest.mark.parametrize("endpoint", ENDPOINTS)
@pytest.mark.parametrize("stream", [False, True])
def test_json_object(client, endpoint, stream):
    for seed, extra in enumerate(
        (
            {"response_format": {"type": "json_object"}},
            {"extra_body": {"structured_outputs": {"json_object": True}}},
        )
    ):
        text, finish = ENDPOINTS[endpoint](client, stream, max_tokens=ROOM, seed=seed, **extra)
        assert finish == "stop", text
        assert isinstance(json.loads(text), dict), text


@pytest.mark.parametrize("endpoint", ENDPOINTS)
@pytest.mark.parametrize("stream", [False, True])
def test_regex_choice_and_grammar(client, endpoint, stream):
    get = ENDPOINTS[endpoint]
    for seed in range(3):
        for body in ({"guided_regex": REGEX}, {"structured_outputs": {"regex": REGEX}}):
            text, finish = get(client, stream, max_tokens=ROOM, seed=seed, extra_body=body)
            assert finish == "stop" and re.fullmatch(REGEX, text), text
        for body in ({"guided_choice": CHOICES}, {"structured_outputs": {"choice": CHOICES}}):
            text, finish = get(client, stream, max_tokens=ROOM, seed=seed, extra_body=body)
            assert finish == "stop" and text in CHOICES, text
        for body in ({"guided_grammar": LARK}, {"structured_outputs": {"grammar": LARK}}):
            text, finish = get(client, stream, max_tokens=ROOM, seed=seed, extra_body=body)
            assert finish == "stop" and re.fullmatch(r"\([1-9][0-9]?(,[1-9][0-9]?)*\)", text)


def test_n_choices_each_follow_the_constraint(client):
    r = client.chat.completions.create(
        model=model_name(client),
        messages=MESSAGES,
        n=4,
        max_tokens=ROOM,
        extra_body={"guided_regex": REGEX},
    )
    assert len(r.choices) == 4
    for c in r.choices:
        assert c.finish_reason == "stop" and re.fullmatch(REGEX, c.message.content)


def test_max_tokens_cuts_json_short_with_finish_reason_length(client):
    schema = to_strict_json_schema(Event)
    fmt = {"type": "json_schema", "json_schema": {"name": "event", "schema": schema}}
    for stream in (False, True):
        text, finish = chat_text(client, stream, max_tokens=5, response_format=fmt)
        assert finish == "length" and not is_json(text), text
        assert text.startswith('{"'), text


def test_a_refused_constraint_enqueues_nothing_and_names_its_field(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=model_name(client),
            messages=MESSAGES,
            extra_body={"structured_outputs": {"json": {"type": "array", "uniqueItems": True}}},
        )
    assert caught.value.body["param"] == "structured_outputs.json"


def test_a_batch_line_with_response_format(client):
    schema = to_strict_json_schema(Event)
    fmt = {"type": "json_schema", "json_schema": {"name": "event", "schema": schema}}
    body = {"model": model_name(client), "messages": MESSAGES, "max_tokens": ROOM}
    lines = [
        {"custom_id": "schema", "body": {**body, "response_format": fmt}},
        {"custom_id": "choice", "body": {**body, "guided_choice": CHOICES}},
        {"custom_id": "bad", "body": {**body, "guided_regex": "(a"}},
    ]
    content = "".join(
        json.dumps({**line, "method": "POST", "url": "/v1/chat/completions"}) + "\n"
        for line in lines
    )
    f = client.files.create(file=("so.jsonl", content.encode()), purpose="batch")
    batch = client.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )

    def done():
        b = client.batches.retrieve(batch.id)
        return b if b.status in ("completed", "failed", "cancelled", "expired") else None

    batch = wait_for(done, 300, f"batch {batch.id}", 0.2)
    assert batch.status == "completed", batch
    out = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    if batch.error_file_id:
        out += [json.loads(x) for x in client.files.content(batch.error_file_id).text.splitlines()]
    results = {o["custom_id"]: o["response"] for o in out}
    answer = results["schema"]["body"]["choices"][0]["message"]["content"]
    jsonschema.validate(json.loads(answer), schema)
    assert results["choice"]["body"]["choices"][0]["message"]["content"] in CHOICES
    assert results["bad"]["status_code"] == 400
    assert results["bad"]["body"]["error"]["param"] == "guided_regex"
