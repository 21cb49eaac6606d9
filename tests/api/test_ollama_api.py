"""Ollama's API (/api/...) end to end: the `ollama` client against a real API (with an API key)
and worker on a random model whose chat template renders tools. Free text is noise on random
weights: it is checked against the chat and completions routes' greedy answers for the same
input, and the raw prompt against the in-process reference engine; structured output against
its schema. The embeddings: tests/api/test_embeddings.py (its stack serves an embedding model)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import ollama
import pytest

from llmq.common.model_files import load_tokenizer
from tests.api.api_stack import client
from tests.api.conftest import TOOLS_KEY as KEY

AUTH = {"Authorization": f"Bearer {KEY}"}
GREEDY = {"temperature": 0, "num_predict": 8}
USER = [{"role": "user", "content": "What does XREADGROUP do?"}]
FORECAST = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
WEATHER_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "description": "The weather", "parameters": FORECAST},
}


@pytest.fixture(scope="module")
def served(tools_stack):
    return tools_stack


@pytest.fixture(scope="module")
def oc(served) -> ollama.Client:
    return ollama.Client(host=served.base, headers=AUTH, timeout=120)


def _openai(served):
    return client(served.base, KEY, timeout=120)


def _chat_route(served, messages, max_tokens=8):
    r = _openai(served).chat.completions.create(
        model=served.model, messages=messages, temperature=0, max_tokens=max_tokens
    )
    return r.choices[0].message.content, r.choices[0].finish_reason, r.usage


def _post(served, path: str, body, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    kind = {"content": body} if isinstance(body, str) else {"json": body}
    return httpx.post(f"{served.base}{path}", headers=headers, timeout=60, **kind)


def _assert_ollama_error(resp: httpx.Response, status: int) -> str:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    body = resp.json()
    assert set(body) == {"error"} and isinstance(body["error"], str) and body["error"], body
    return body["error"]


def test_chat_streamed_and_whole_equals_the_chat_routes_greedy_answer(served, oc):
    text, finish, usage = _chat_route(served, USER)
    whole = oc.chat(model=served.model, messages=USER, options=GREEDY, stream=False)
    assert whole.message.role == "assistant" and whole.message.content == text
    assert whole.done and whole.done_reason == ("length" if finish == "length" else "stop")
    assert (whole.prompt_eval_count, whole.eval_count) == (usage.prompt_tokens, usage.completion_tokens)  # fmt: skip
    parts = list(oc.chat(model=served.model, messages=USER, options=GREEDY, stream=True))
    assert "".join(p.message.content or "" for p in parts) == text
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    last = parts[-1]
    assert last.done_reason == whole.done_reason and last.eval_count == usage.completion_tokens
    assert last.total_duration >= last.load_duration + last.prompt_eval_duration + last.eval_duration  # fmt: skip


def test_generate_templated_and_raw_equal_the_chat_and_completions_routes(served, oc, ref):
    text, _, _ = _chat_route(served, USER)
    prompt = USER[0]["content"]
    assert oc.generate(model=served.model, prompt=prompt, options=GREEDY).response == text
    streamed = list(oc.generate(model=served.model, prompt=prompt, options=GREEDY, stream=True))
    assert "".join(p.response for p in streamed) == text and streamed[-1].done

    raw = "def fibonacci(n):"
    completion = _openai(served).completions.create(
        model=served.model, prompt=raw, temperature=0, max_tokens=8
    )
    got = oc.generate(model=served.model, prompt=raw, raw=True, options=GREEDY)
    assert got.response == completion.choices[0].text
    assert got.prompt_eval_count == len(ref.ids(raw)) == completion.usage.prompt_tokens
    assert got.done_reason == "length"  # this model's 8 greedy tokens hold no end token
    assert got.response == ref.text(ref.greedy([ref.ids(raw)], 8)[0])


def test_ndjson_lines_and_the_done_line(served):
    body = {"model": served.model, "messages": USER, "options": GREEDY}
    with httpx.stream("POST", f"{served.base}/api/chat", json=body, headers=AUTH) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in resp.iter_lines() if line]
    last = lines[-1]
    assert last["done"] is True and last["done_reason"] in ("stop", "length")
    for key in ("total_duration", "load_duration", "prompt_eval_duration", "eval_duration"):
        assert isinstance(last[key], int) and last[key] >= 0, key
    assert all(line["done"] is False and "eval_count" not in line for line in lines[:-1])


def test_format_schema_answers_json_valid_under_it(served, oc):
    r = oc.chat(
        model=served.model,
        messages=[{"role": "user", "content": "Weather in Oslo for 3 days?"}],
        format=FORECAST,
        options={"temperature": 0, "num_predict": 60},
    )
    assert r.done_reason == "stop", r
    jsonschema.validate(json.loads(r.message.content), FORECAST)
    r = oc.generate(model=served.model, prompt="JSON please", format="json", options={"num_predict": 60, "seed": 3})  # fmt: skip
    assert r.done_reason == "stop" and isinstance(json.loads(r.response), dict)


def test_tools_are_offered_and_the_answer_is_a_message(served, oc):
    """Ollama has no tool_choice: the random model answers text (or a call, in Ollama's
    shape); the request with tools must serve either."""
    weather = {"role": "user", "content": "Weather in Paris?"}
    r = oc.chat(model=served.model, messages=[weather], tools=[WEATHER_TOOL], options=GREEDY)
    assert r.done and isinstance(r.message.content, str)
    for call in r.message.tool_calls or []:
        assert isinstance(call.function.arguments, dict)
    history = [
        weather,
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}}]},
        {"role": "tool", "content": "18C and sunny", "tool_name": "get_weather"},
    ]  # fmt: skip
    streamed = list(oc.chat(model=served.model, messages=history, tools=[WEATHER_TOOL], options=GREEDY, stream=True))  # fmt: skip
    assert streamed[-1].done


def test_list_show_ps_version(served, oc):
    tokenizer = load_tokenizer(served.model)
    (listed,) = oc.list().models
    assert listed.model == served.model and listed.details.family == "llama"
    assert listed.details.parameter_size and listed.details.quantization_level == "F32"
    shown = oc.show(served.model)
    assert shown.template == tokenizer.chat_template
    assert shown.capabilities == ["completion", "tools"]  # no reasoning parser: no thinking
    assert shown.modelinfo["general.architecture"] == "llama"
    context = shown.modelinfo["llama.context_length"]
    assert context > 0 and f"num_ctx {context}" in shown.parameters
    assert shown.details.family == "llama" and "FROM " in shown.modelfile
    (loaded,) = oc.ps().models
    assert loaded.model == served.model and loaded.context_length == context
    version = httpx.get(f"{served.base}/api/version", headers=AUTH).json()["version"]
    assert [int(p) for p in version.split(".")] >= [0, 9, 0]
    assert oc.show(f"{served.model}:latest").template == tokenizer.chat_template


def test_an_empty_prompt_or_conversation_loads_the_model(served, oc):
    r = oc.generate(model=served.model, prompt="")
    assert r.done and r.done_reason == "load" and r.response == ""
    r = oc.chat(model=served.model, messages=[])
    assert r.done and r.done_reason == "load"


def test_errors_come_in_ollamas_shape(served, oc):
    with pytest.raises(ollama.ResponseError) as err:
        oc.chat(model="no-such-model", messages=USER)
    assert err.value.status_code == 404 and "no-such-model" in err.value.error
    with pytest.raises(ollama.ResponseError) as err:
        oc.chat(model=served.model, messages=USER, think=True)
    assert err.value.status_code == 400 and "thinking" in err.value.error
    model = served.model
    bad = [
        ("/api/chat", {"model": model, "messages": "hi"}),
        ("/api/chat", {"model": model, "messages": [{"role": "robot", "content": "x"}]}),
        ("/api/chat", {"model": model, "messages": USER, "options": {"temperature": "hot"}}),
        ("/api/chat", {"model": model, "messages": USER, "options": {"mirostat": 2}}),
        ("/api/chat", {"model": model, "messages": USER, "format": "yaml"}),
        (
            "/api/chat",
            {
                "model": model,
                "messages": USER,
                "format": {"type": "object", "uniqueItems": True, "not": {}},
            },
        ),  # fmt: skip
        (
            "/api/chat",
            {"model": model, "messages": [{"role": "user", "content": "x", "images": ["aGk="]}]},
        ),  # fmt: skip
        ("/api/generate", {"model": model, "prompt": "x", "suffix": "y"}),
        ("/api/generate", {"model": model, "prompt": "x", "template": "{{ .Prompt }}"}),
        ("/api/generate", {"model": model, "prompt": "x", "context": [1, 2]}),
        ("/api/generate", {"model": model, "prompt": "x", "raw": True, "system": "s"}),
        ("/api/generate", {"model": model, "prompt": "x", "options": {"num_predict": 10**6}}),
        ("/api/generate", "{not json"),
        ("/api/embed", {"model": model, "input": 5}),
        ("/api/embed", {"model": model, "input": "x"}),  # a generation model
        ("/api/embeddings", {"model": model, "prompt": ["x"]}),
        ("/api/show", {}),
        ("/api/show", {"model": 3}),
    ]
    for path, body in bad:
        _assert_ollama_error(_post(served, path, body), 400)
    _assert_ollama_error(_post(served, "/api/show", {"model": "nope"}), 404)
    _assert_ollama_error(_post(served, "/api/nothing-here", {}), 404)
    _assert_ollama_error(_post(served, "/api/tags", {"model": model}), 405)
    for path in ("/api/pull", "/api/push", "/api/create", "/api/copy"):
        assert "operator" in _assert_ollama_error(_post(served, path, {"model": model}), 403)
    deleted = httpx.request("DELETE", f"{served.base}/api/delete", json={"model": model}, headers=AUTH)  # fmt: skip
    _assert_ollama_error(deleted, 403)
    _assert_ollama_error(_post(served, "/api/chat", {"model": model, "messages": USER}, None), 401)
    _assert_ollama_error(httpx.get(f"{served.base}/api/tags", headers={"Authorization": "Bearer x"}), 401)  # fmt: skip
