"""Ollama's API translation, without processes: options to sampling fields, bodies to chat and
completion requests, chat and completion answers and chunks to Ollama's lines."""

from __future__ import annotations

import asyncio
import json

import pytest
from pydantic import ValidationError

from llmq.common.errors import DeadlineExceeded, InvalidRequest
from llmq.common.serving.chat_request import ChatCompletionRequest
from llmq.common.serving.ollama_api.chunks import OllamaLines
from llmq.common.serving.ollama_api.objects import Timings
from llmq.common.serving.ollama_api.options import IGNORED_OPTIONS, sampling_fields
from llmq.common.serving.ollama_api.request import ChatBody, GenerateBody, OllamaOptions
from llmq.common.serving.ollama_api.run import OllamaRun
from llmq.common.serving.ollama_api.translate import chat_request, generate_request
from llmq.common.serving.request_bodies import CompletionRequest
from llmq.common.serving.responses import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    CompletionChoice,
    CompletionChunk,
    FunctionCall,
    FunctionCallDelta,
    ToolCall,
    ToolCallDelta,
    Usage,
)

pytestmark = pytest.mark.unit
USER = [{"role": "user", "content": "Hi"}]


def _fields(**options) -> dict:
    return sampling_fields(OllamaOptions.model_validate(options))


def test_options_map_onto_the_sampling_fields():
    fields = _fields(
        temperature=0.2,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        seed=7,
        num_predict=12,
        stop="END",
        repeat_penalty=1.1,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        num_ctx=4096,
    )
    assert fields == {
        "temperature": 0.2,
        "top_p": 0.9,
        "top_k": 40,
        "min_p": 0.05,
        "seed": 7,
        "max_tokens": 12,
        "stop": ["END"],
        "repetition_penalty": 1.1,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
    }
    assert sampling_fields(None) == {} and _fields() == {}


@pytest.mark.parametrize("num_predict", [-1, -2, 0])
def test_num_predict_of_zero_or_less_runs_up_to_the_context(num_predict):
    assert "max_tokens" not in _fields(num_predict=num_predict)


def test_ollamas_off_values_mean_off():
    """top_k 0 (no top-k), a negative seed (random), repeat_last_n 0 (no penalties)."""
    assert _fields(top_k=0, seed=-1) == {"top_k": -1}
    assert _fields(repeat_last_n=0, repeat_penalty=1.3) == {}
    assert _fields(repeat_last_n=-1, repeat_penalty=1.3) == {"repetition_penalty": 1.3}
    assert _fields(repeat_last_n=64) == {}  # no penalty in use: the window changes nothing


def test_runner_options_are_accepted_and_ignored():
    values = {
        name: (1 if name.startswith(("num", "main", "mirostat_")) else True)
        for name in IGNORED_OPTIONS
    }
    values |= {"mirostat": 0, "tfs_z": 1.0, "typical_p": 1.0, "an_option_ollama_lacks": 3}
    assert _fields(**values) == {}


@pytest.mark.parametrize(
    "options",
    [
        {"mirostat": 2},
        {"tfs_z": 0.9},
        {"typical_p": 0.5},
        {"temperature": "hot"},
        {"temperature": 3},
        {"num_thread": "many"},
        {"num_ctx": 0},
    ],
)
def test_options_that_would_change_the_answer_or_are_malformed_are_refused(options):
    with pytest.raises(ValidationError):
        OllamaOptions.model_validate(options)


def test_a_penalty_window_other_than_the_context_is_a_400():
    body = ChatBody(messages=USER, options={"repeat_last_n": 64, "repeat_penalty": 1.2})
    with pytest.raises(InvalidRequest, match="repeat_last_n") as err:
        chat_request(body, reasons=False)
    assert err.value.status == 400 and err.value.param == "options"


def test_chat_body_becomes_a_chat_request():
    body = ChatBody.model_validate(
        {
            "model": "m",
            "messages": [
                {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "w", "arguments": {"city": "Oslo"}}}]},
                {"role": "tool", "content": "12C", "tool_name": "w"},
            ],
            "tools": [{"type": "function", "function": {"name": "w", "parameters": {"type": "object"}}}],
            "format": {"type": "object", "properties": {"a": {"type": "integer"}}},
            "options": {"temperature": 0, "num_predict": 5},
        }
    )  # fmt: skip
    request = chat_request(body, reasons=False)
    assert isinstance(request, ChatCompletionRequest)
    assert request.stream and request.stream_options.include_usage  # Ollama streams by default
    assert (request.temperature, request.max_tokens, request.model) == (0.0, 5, "m")
    call = request.messages[1].tool_calls[0]
    assert json.loads(call.function.arguments) == {"city": "Oslo"} and call.id
    assert request.messages[2].role == "tool" and request.messages[2].name == "w"
    assert request.tool_mode() == "auto"  # Ollama has no tool_choice
    assert request.response_format.type == "json_schema"
    json_body = chat_request(ChatBody(messages=USER, format="json", stream=False), False)
    assert json_body.response_format.type == "json_object" and not json_body.stream


def test_think_switches_the_template_or_is_refused_without_a_reasoning_parser():
    on = chat_request(ChatBody(messages=USER, think=True), reasons=True)
    assert on.chat_template_kwargs == {"enable_thinking": True}
    off = chat_request(ChatBody(messages=USER, think=False), reasons=False)
    assert off.chat_template_kwargs == {"enable_thinking": False}
    assert chat_request(ChatBody(messages=USER, think="high"), True).reasoning_effort == "high"
    with pytest.raises(InvalidRequest, match="does not support thinking"):
        chat_request(ChatBody(model="m", messages=USER, think=True), reasons=False)


def test_generate_is_one_templated_user_turn_or_a_raw_completion():
    templated = generate_request(GenerateBody(prompt="Hi", system="Be brief."), reasons=False)
    assert isinstance(templated, ChatCompletionRequest)
    assert [(m.role, m.content) for m in templated.messages] == [
        ("system", "Be brief."),
        ("user", "Hi"),
    ]
    raw = generate_request(GenerateBody(prompt="def f(", raw=True), reasons=False)
    assert isinstance(raw, CompletionRequest) and raw.prompt == "def f("
    assert raw.wanted_max_tokens() is None  # up to the context, not completions' 16
    with pytest.raises(InvalidRequest):
        generate_request(GenerateBody(prompt="x", raw=True, system="s"), reasons=False)


@pytest.mark.parametrize(
    "fields",
    [
        {"suffix": "}"},
        {"template": "{{ .Prompt }}"},
        {"context": [1, 2, 3]},
        {"logprobs": True},
    ],
)
def test_what_generate_does_not_serve_is_refused(fields):
    with pytest.raises(ValidationError):
        GenerateBody.model_validate({"prompt": "x", **fields})


def test_images_become_image_parts_after_the_text():
    body = ChatBody.model_validate(
        {"messages": [{"role": "user", "content": "x", "images": ["aGk=", "aGk="]}]}
    )
    (message,) = chat_request(body, reasons=False).messages
    assert [p.type for p in message.content] == ["text", "image_url", "image_url"]
    assert message.content[1].image_url.url == "data:image/*;base64,aGk="


# ---- answers and lines -----------------------------------------------------------------------
def _chunk(delta: ChatDelta | None = None, finish: str | None = None, usage=None):
    rows = (
        []
        if delta is None
        else [ChatChunkChoice(index=0, delta=delta, logprobs=None, finish_reason=finish)]
    )
    return ChatCompletionChunk(id="c", created=0, model="m", choices=rows, usage=usage)  # fmt: skip


def _call_delta(args: str, name: str | None = None) -> ToolCallDelta:
    opening = {"id": "call_1", "type": "function"} if name else {}
    return ToolCallDelta(index=0, function=FunctionCallDelta(name=name, arguments=args), **opening)


def test_chat_stream_lines_text_thinking_whole_calls_and_a_done_line():
    lines = OllamaLines("chat", "m", Timings())
    out = []
    out += lines.feed(_chunk(ChatDelta(role="assistant", content="")))
    out += lines.feed(_chunk(ChatDelta(reasoning_content="hmm", reasoning="hmm")))
    out += lines.feed(_chunk(ChatDelta(content="Sure.")))
    out += lines.feed(_chunk(ChatDelta(tool_calls=[_call_delta("", "weather")])))
    out += lines.feed(_chunk(ChatDelta(tool_calls=[_call_delta('{"city": ')])))
    out += lines.feed(_chunk(ChatDelta(tool_calls=[_call_delta('"Oslo"}')]), finish="tool_calls"))
    out += lines.feed(_chunk(usage=Usage(prompt_tokens=9, completion_tokens=4, total_tokens=13)))
    out += lines.finish()
    dumped = [line.model_dump() for line in out]
    assert [d["message"].get("thinking") for d in dumped[:2]] == ["hmm", None]
    assert dumped[1]["message"]["content"] == "Sure."
    calls = dumped[2]["message"]["tool_calls"]
    assert calls == [{"id": "call_1", "function": {"index": 0, "name": "weather", "arguments": {"city": "Oslo"}}}]  # fmt: skip
    assert not any(d["done"] for d in dumped[:-1])
    last = dumped[-1]
    assert last["done"] and last["done_reason"] == "stop" and last["message"]["content"] == ""
    assert (last["prompt_eval_count"], last["eval_count"]) == (9, 4)
    durations = ["load_duration", "prompt_eval_duration", "eval_duration"]
    assert all(last[k] >= 0 for k in durations)
    assert sum(last[k] for k in durations) <= last["total_duration"]
    for d in dumped:
        assert d["model"] == "m" and d["created_at"].endswith("Z")


def test_generate_stream_lines_from_completion_chunks():
    lines = OllamaLines("generate", "m", Timings())
    chunk = CompletionChunk(
        id="c",
        created=0,
        model="m",
        choices=[CompletionChoice(index=0, text="abc", logprobs=None, finish_reason="length")],
    )
    out = [line.model_dump() for line in lines.feed(chunk) + lines.finish()]
    assert out[0]["response"] == "abc" and "message" not in out[0] and not out[0]["done"]
    assert out[-1]["done_reason"] == "length" and out[-1]["response"] == ""


def _completion(message: AssistantMessage, finish: str) -> ChatCompletion:
    usage = Usage(prompt_tokens=3, completion_tokens=5, total_tokens=8)
    choice = ChatChoice(index=0, message=message, logprobs=None, finish_reason=finish)
    return ChatCompletion(id="c", created=0, model="m", choices=[choice], usage=usage)


def test_whole_answer_gives_calls_with_object_arguments():
    calls = [
        ToolCall(id="call_a", function=FunctionCall(name="f", arguments='{"x": 1}')),
        ToolCall(id="call_b", function=FunctionCall(name="g", arguments="{}")),
    ]
    message = AssistantMessage(content=None, tool_calls=calls, reasoning_content="r", reasoning="r")
    whole = (
        OllamaLines("chat", "m", Timings()).whole(_completion(message, "tool_calls")).model_dump()
    )
    assert whole["message"] == {
        "role": "assistant",
        "content": "",
        "thinking": "r",
        "tool_calls": [
            {"id": "call_a", "function": {"index": 0, "name": "f", "arguments": {"x": 1}}},
            {"id": "call_b", "function": {"index": 1, "name": "g", "arguments": {}}},
        ],
    }
    assert whole["done"] and whole["done_reason"] == "stop"
    assert (whole["prompt_eval_count"], whole["eval_count"]) == (3, 5)


def test_a_call_cut_short_is_answered_as_text():
    calls = [ToolCall(id="call_a", function=FunctionCall(name="f", arguments='{"x": '))]
    message = AssistantMessage(content="Let me see. ", tool_calls=calls)
    whole = OllamaLines("chat", "m", Timings()).whole(_completion(message, "length")).model_dump()
    assert whole["message"] == {"role": "assistant", "content": 'Let me see. {"x": '}
    assert whole["done_reason"] == "length"


def test_a_load_line_and_an_error_line():
    lines = OllamaLines("generate", "m", Timings())
    load = lines.line("", done=True, done_reason="load").model_dump()
    assert load["done_reason"] == "load" and load["response"] == "" and "eval_count" not in load
    assert lines.error("boom") == {"error": "boom"}


class _FailingGeneration:
    """A generation whose stream breaks after its first chunk (as a worker lost mid-answer)."""

    def __init__(self):
        self.closed = False

    async def chunks(self):
        yield _chunk(ChatDelta(content="Hel"))
        raise DeadlineExceeded("the request passed its deadline")

    async def aclose(self):
        self.closed = True


def test_a_stream_that_fails_ends_with_an_error_line():
    generation = _FailingGeneration()
    run = OllamaRun(generation, OllamaLines("chat", "m", Timings()), Timings())

    async def lines():
        return [line async for line in run.stream()]

    got = asyncio.run(lines())
    assert got[0]["message"]["content"] == "Hel" and not got[0]["done"]
    assert got[1:] == [{"error": "the request passed its deadline"}]
