"""The Responses API's translation, without processes: items to chat messages, the request to
a chat request, chat chunks to typed events."""

from __future__ import annotations

import asyncio
import logging

import pytest
from pydantic import ValidationError

from llmq.common.errors import InvalidRequest
from llmq.common.serving.responses import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    FunctionCallDelta,
    ToolCallDelta,
    Usage,
)
from llmq.common.serving.responses_api.answer import chat_request, echoed_fields
from llmq.common.serving.responses_api.events import ResponseEvents
from llmq.common.serving.responses_api.items import chat_messages
from llmq.common.serving.responses_api.objects import new_response
from llmq.common.serving.responses_api.request import ResponsesRequest
from llmq.common.storage.responses_store import is_response_id

pytestmark = pytest.mark.unit
TOOL = {"type": "function", "name": "f", "parameters": {"type": "object"}}


def test_items_become_chat_messages_calls_joining_their_assistant_turn():
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "t"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{\"x\": 1}"},
        {"type": "function_call_output", "call_id": "c1", "output": "r1"},
        {"type": "reasoning", "summary": []},
    ]  # fmt: skip
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    second = {"id": "c2", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    assert chat_messages(items) == [
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "t", "tool_calls": [call, second]},
        {"role": "tool", "content": "r1", "tool_call_id": "c1"},
    ]


@pytest.mark.parametrize(
    ("item", "param"),
    [
        ({"role": "tool", "content": "x"}, "input[0]"),
        ({"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}, "input[0].content[0]"),
        ({"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}, "input[0].content[0]"),
        ({"type": "function_call", "call_id": "c", "name": "f"}, "input[0].arguments"),
        ({"type": "item_reference", "id": "x"}, "input[0]"),
    ],
)  # fmt: skip
def test_items_not_served_are_400s_naming_them(item, param):
    with pytest.raises(InvalidRequest) as exc:
        chat_messages([item])
    assert exc.value.param == param


def test_request_becomes_the_chat_request_of_the_same_answer():
    body = ResponsesRequest.model_validate({
        "input": "q", "instructions": "sys", "max_output_tokens": 5, "temperature": 0,
        "tools": [TOOL], "tool_choice": {"type": "function", "name": "f"},
        "text": {"format": {"type": "json_schema", "name": "n", "schema": {"type": "object"}}},
    })  # fmt: skip
    chat = chat_request(body, [{"role": "user", "content": "before"}])
    assert chat.template_messages() == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "before"},
        {"role": "user", "content": "q"},
    ]
    assert chat.max_completion_tokens == 5 and chat.temperature == 0
    assert chat.tool_mode() == "named" and chat.tools[0].function.name == "f"
    assert chat.response_format is None  # the forced call is the constrained output
    free = chat_request(body.model_copy(update={"tool_choice": "auto"}), [])
    assert free.response_format.json_schema.json_schema == {"type": "object"}
    echo = echoed_fields(body)
    assert echo["tool_choice"] == {"type": "function", "name": "f"}
    assert echo["text"]["format"]["schema"] == {"type": "object"}


@pytest.mark.parametrize("tool", ["web_search", "file_search", "mcp"])
def test_hosted_tools_are_dropped_unless_forced(tool, caplog):
    caplog.set_level(logging.INFO)
    hosted = {"type": tool, "external_web_access": False}
    body = ResponsesRequest.model_validate({"input": "q", "tools": [TOOL, hosted]})
    assert [t.name for t in body.functions()] == ["f"]
    assert [t.function.name for t in chat_request(body, []).tools] == ["f"]
    assert tool in caplog.text  # the log line names what was dropped
    with pytest.raises(ValidationError, match=f"forces the hosted tool '{tool}'"):
        ResponsesRequest.model_validate(
            {"input": "q", "tools": [TOOL, hosted], "tool_choice": {"type": tool}}
        )
    with pytest.raises(ValidationError, match="'required' needs a function tool"):
        ResponsesRequest.model_validate(
            {"input": "q", "tools": [hosted], "tool_choice": "required"}
        )


def test_tool_types_neither_served_nor_hosted_are_refused_by_name():
    custom = {"type": "custom", "name": "apply_patch"}
    with pytest.raises(ValidationError, match="tools of type custom are not served"):
        ResponsesRequest.model_validate({"input": "q", "tools": [TOOL, custom]})


def test_namespace_tools_are_offered_as_their_functions_and_calls_name_them():
    inner = [{**TOOL, "name": "spawn_agent"}, {**TOOL, "name": "wait_agent"}]
    space = {"type": "namespace", "name": "multi_agent_v1", "description": "d", "tools": inner}
    body = ResponsesRequest.model_validate(
        {
            "input": "q",
            "tools": [TOOL, space],
            "tool_choice": {"type": "function", "name": "wait_agent"},
        }
    )
    chat = chat_request(body, [])
    assert [t.function.name for t in chat.tools] == ["f", "spawn_agent", "wait_agent"]
    assert chat.tool_mode() == "named"
    assert body.namespaces() == {"spawn_agent": "multi_agent_v1", "wait_agent": "multi_agent_v1"}
    assert echoed_fields(body)["tools"][1]["type"] == "namespace"
    # A call item sent back names its namespace: accepted, the call is the function's.
    call = {"type": "function_call", "call_id": "c1", "name": "wait_agent", "arguments": "{}"}
    history = chat_messages([{**call, "namespace": "multi_agent_v1"}])
    assert history == chat_messages([call])
    with pytest.raises(ValidationError, match="distinct names"):
        ResponsesRequest.model_validate({"input": "q", "tools": [inner[0], space]})


def test_response_ids_are_checked_before_a_key_is_built():
    assert is_response_id(new_response("m", {}).id)
    for bad in ("resp_" + "0" * 31, "resp_../x", "file-" + "0" * 32, "resp_" + "A" * 32):
        assert not is_response_id(bad)


def _chunk(delta: ChatDelta | None = None, reason=None, usage=None) -> ChatCompletionChunk:
    rows = (
        []
        if delta is None
        else [ChatChunkChoice(index=0, delta=delta, logprobs=None, finish_reason=reason)]
    )
    return ChatCompletionChunk(id="c", created=0, model="m", choices=rows, usage=usage)


def test_chunks_become_events_text_then_a_call():
    opening = ToolCallDelta(
        index=0, id="call_1", type="function", function=FunctionCallDelta(name="f", arguments="")
    )
    args = ToolCallDelta(index=0, function=FunctionCallDelta(arguments='{"a": 1}'))
    chunks = [
        _chunk(ChatDelta(role="assistant", content="")), _chunk(ChatDelta(content="he")),
        _chunk(ChatDelta(content="y")), _chunk(ChatDelta(tool_calls=[opening])),
        _chunk(ChatDelta(tool_calls=[args]), "tool_calls"),
        _chunk(usage=Usage(prompt_tokens=3, completion_tokens=4, total_tokens=7)),
    ]  # fmt: skip

    async def events():
        async def source():
            for c in chunks:
                yield c

        response = new_response("m", {"store": True})
        namespaces = {"g": "space"}  # another function's namespace: f's call names none
        return [e async for e in ResponseEvents(response, namespaces).events(source())], response

    got, response = asyncio.run(events())
    assert [e["sequence_number"] for e in got] == list(range(len(got)))
    assert [e["type"].removeprefix("response.") for e in got] == [
        "created", "in_progress", "output_item.added", "content_part.added",
        "output_text.delta", "output_text.delta", "output_text.done", "content_part.done",
        "output_item.done", "output_item.added", "function_call_arguments.delta",
        "function_call_arguments.done", "output_item.done", "completed",
    ]  # fmt: skip
    final = got[-1]["response"]
    assert final["status"] == "completed" and final["store"] is True and "echo" not in final
    message, call = final["output"]
    assert message["content"][0]["text"] == "hey" and message["status"] == "completed"
    assert (call["call_id"], call["name"], call["arguments"]) == ("call_1", "f", '{"a": 1}')
    assert "namespace" not in call
    assert [e["output_index"] for e in got if e["type"] == "response.output_item.done"] == [0, 1]
    assert final["usage"]["input_tokens"] == 3 and final["usage"]["total_tokens"] == 7
    assert response.model_dump() == final


def test_a_namespaced_functions_call_names_its_namespace():
    opening = ToolCallDelta(
        index=0,
        id="call_1",
        type="function",
        function=FunctionCallDelta(name="wait", arguments="{}"),
    )
    chunks = [_chunk(ChatDelta(tool_calls=[opening]), "tool_calls")]

    async def events():
        async def source():
            for c in chunks:
                yield c

        response = new_response("m", {})
        found = ResponseEvents(response, {"wait": "multi_agent_v1"}).events(source())
        return [e async for e in found]

    added = [
        e["item"] for e in asyncio.run(events()) if e["type"].startswith("response.output_item")
    ]
    assert [(i["name"], i["namespace"]) for i in added] == [("wait", "multi_agent_v1")] * 2
