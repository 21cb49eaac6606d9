"""The Messages API's translation, without processes: the request and its blocks to a chat
request, the chat answer to a message, chat chunks to Anthropic's event sequence, errors to
Anthropic's shape."""

from __future__ import annotations

import asyncio
import json

import pytest
from pydantic import ValidationError

from llmq.common.errors import InvalidRequest, ModelNotFound, Unavailable
from llmq.common.serving.messages_api.answer import content_blocks, matched_stop, tool_input
from llmq.common.serving.messages_api.errors import error_body
from llmq.common.serving.messages_api.events import MessageEvents
from llmq.common.serving.messages_api.objects import MessageObject, MessageUsage
from llmq.common.serving.messages_api.request import MessagesPrompt, MessagesRequest
from llmq.common.serving.messages_api.translate import Template, chat_request
from llmq.common.serving.responses import (
    AssistantMessage,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    FunctionCall,
    FunctionCallDelta,
    PromptTokensDetails,
    ToolCall,
    ToolCallDelta,
    Usage,
)

pytestmark = pytest.mark.unit
TAKES_EFFORT = Template(effort=True)
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = {"name": "get_weather", "description": "Weather.", "input_schema": SCHEMA}


def body(**fields) -> MessagesRequest:
    return MessagesRequest.model_validate(
        {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "q"}], **fields}
    )


def test_a_tool_loop_becomes_chat_messages_calls_and_results():
    chat = chat_request(body(
        system=[{"type": "text", "text": "Be "}, {"type": "text", "text": "brief.", "cache_control": {"type": "ephemeral"}}],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "weather?"}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hm", "signature": "s"},
                {"type": "text", "text": "Calling."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sun"}]},
                {"type": "text", "text": "and "}, {"type": "text", "text": "tomorrow?"},
            ]},
        ],
        tools=[TOOL], tool_choice={"type": "auto", "disable_parallel_tool_use": True},
    ), TAKES_EFFORT)  # fmt: skip
    call = {
        "id": "toolu_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Oslo"}},
    }
    assert chat.template_messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "Calling.", "tool_calls": [call]},
        {"role": "tool", "content": "sun", "tool_call_id": "toolu_1"},
        {"role": "user", "content": "and tomorrow?"},
    ]  # fmt: skip
    assert chat.tool_mode() == "auto" and chat.parallel_tool_calls is False
    assert chat.template_tools()[0]["function"]["parameters"] == SCHEMA
    assert chat.max_tokens == 8 and chat.add_generation_prompt


def test_an_error_result_says_so_to_the_model():
    chat = chat_request(body(messages=[
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "get_weather", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "boom", "is_error": True}]},
    ], tools=[TOOL]), TAKES_EFFORT)  # fmt: skip
    assert chat.template_messages()[-1] == {
        "role": "tool",
        "content": "Error: boom",
        "tool_call_id": "t",
    }


@pytest.mark.parametrize(
    ("choice", "mode", "parallel"),
    [({"type": "any"}, "required", True), ({"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}, "named", False),
     ({"type": "none"}, "none", True), ({"type": "auto"}, "auto", True)],
)  # fmt: skip
def test_tool_choice_maps_onto_chats(choice, mode, parallel):
    chat = chat_request(body(tools=[TOOL], tool_choice=choice), TAKES_EFFORT)
    assert chat.tool_mode() == mode and chat.parallel_tool_calls is parallel


def test_sampling_format_thinking_and_prefill_fields():
    fmt = {"format": {"type": "json_schema", "schema": SCHEMA}, "effort": "max"}
    chat = chat_request(body(
        max_tokens=2000, temperature=0, top_p=0.5, top_k=3, stop_sequences=["\n\n"], stream=True,
        metadata={"user_id": "u1"}, output_config=fmt, thinking={"type": "enabled", "budget_tokens": 1024},
        messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": "The answer is"}],
        service_tier="auto", cache_control={"type": "ephemeral"},
    ), TAKES_EFFORT)  # fmt: skip
    assert (chat.temperature, chat.top_p, chat.top_k, chat.stop, chat.user) == (
        0,
        0.5,
        3,
        ["\n\n"],
        "u1",
    )
    assert chat.stream and chat.stream_options.include_usage
    assert chat.response_format.json_schema.json_schema == SCHEMA
    assert chat.reasoning_effort == "high" and chat.chat_template_kwargs == {
        "enable_thinking": True
    }
    assert chat.continue_final_message and not chat.add_generation_prompt
    off = chat_request(body(thinking={"type": "disabled"}), TAKES_EFFORT)
    assert off.chat_template_kwargs == {"enable_thinking": False} and not off.include_reasoning
    forced = chat_request(
        body(tools=[TOOL], tool_choice={"type": "any"}, output_config=fmt), TAKES_EFFORT
    )
    assert forced.response_format is None  # the forced call is the constrained output


def test_count_tokens_body_renders_the_same_prompt():
    fields = {"messages": [{"role": "user", "content": "q"}], "system": "s", "tools": [TOOL]}
    prompt = chat_request(MessagesPrompt.model_validate(fields), TAKES_EFFORT)
    whole = chat_request(body(**fields), TAKES_EFFORT)
    assert prompt.template_messages() == whole.template_messages()
    assert prompt.template_tools() == whole.template_tools()
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        MessagesPrompt.model_validate({**fields, "max_tokens": 5})


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"surprise": 1}, "Extra inputs are not permitted"),
        ({"max_tokens": None}, "max_tokens"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "source"),
        ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "document content blocks"),
        ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image"}]}]}]}, "'image' are not supported in a tool_result"),
        ({"messages": [{"role": "user", "content": [{"type": "search_result"}]}]}, "'search_result' are not supported"),
        ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]}, "a user turn cannot hold"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "server tools are not supported by this server: web_search_20250305"),
        ({"tools": [TOOL, {"type": "bash_20250124", "name": "bash"}]}, "bash_20250124"),
        ({"tool_choice": {"type": "any"}}, "needs tools"),
        ({"tools": [TOOL], "tool_choice": {"type": "tool", "name": "other"}}, "not in tools"),
        ({"thinking": {"type": "enabled", "budget_tokens": 512}}, "greater than or equal to 1024"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "less than max_tokens"),
        ({"container": "c1"}, "containers"),
        ({"mcp_servers": [{"type": "url", "url": "u", "name": "n"}]}, "MCP servers"),
        ({"service_tier": "priority"}, "service_tier"),
        ({"temperature": 1.5}, "temperature"),
    ],
)  # fmt: skip
def test_what_is_not_served_is_a_clear_400(fields, says):
    with pytest.raises(ValidationError, match=says):
        body(**fields)


def test_chat_answer_becomes_blocks_calls_with_object_inputs():
    call = ToolCall(
        id="call_abc", function=FunctionCall(name="get_weather", arguments='{"city": "Oslo"}')
    )
    message = AssistantMessage(content="Sure.", reasoning_content="think", tool_calls=[call])
    blocks = [b.model_dump() for b in content_blocks(message, text_allowed=True)]
    assert [b["type"] for b in blocks] == ["thinking", "text", "tool_use"]
    assert blocks[2] == {
        "type": "tool_use",
        "id": "toolu_abc",
        "name": "get_weather",
        "input": {"city": "Oslo"},
    }
    assert blocks[0]["signature"]
    forced = content_blocks(AssistantMessage(content='[{"name": "get_weather", "param'), False)
    assert forced == []  # a forced turn's text is never a text block
    assert tool_input('{"city": "Oslo", "da') == {"city": "Oslo"} and tool_input("[1]") == {}
    # fmt: skip


class _Tokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def test_the_stop_sequence_is_the_first_in_the_output_and_the_longest_there():
    ids = [ord(c) for c in "abc END xyz"]
    assert matched_stop(_Tokenizer(), ids, ["xyz", "END", "EN"]) == "END"
    assert matched_stop(_Tokenizer(), ids, ["nope"]) is None
    assert matched_stop(_Tokenizer(), ids, None) is None


def _chunk(delta=None, finish=None, usage=None) -> ChatCompletionChunk:
    rows = (
        []
        if delta is None
        else [ChatChunkChoice(index=0, delta=delta, logprobs=None, finish_reason=finish)]
    )
    return ChatCompletionChunk(id="c", created=0, model="m", choices=rows, usage=usage)  # fmt: skip


def _events(chunks, text_allowed=True, stop=None) -> list[dict]:
    message = MessageObject(
        id="msg_1", model="m", usage=MessageUsage(input_tokens=7, output_tokens=0)
    )
    builder = MessageEvents(message, text_allowed, lambda: stop)

    async def run():
        async def gen():
            for c in chunks:
                if isinstance(c, Exception):
                    raise c
                yield c

        return [e async for e in builder.events(gen())]

    return json.loads(json.dumps(asyncio.run(run())))  # as sent: JSON


def _call_delta(index, call_id=None, name=None, arguments=None) -> ChatDelta:
    fn = FunctionCallDelta(name=name, arguments=arguments)
    return ChatDelta(
        tool_calls=[
            ToolCallDelta(
                index=index, id=call_id, type="function" if call_id else None, function=fn
            )
        ]
    )


def test_events_come_in_anthropics_order_with_block_indexes():
    usage = Usage(
        prompt_tokens=7,
        completion_tokens=5,
        total_tokens=12,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=4),
    )
    events = _events([
        _chunk(ChatDelta(role="assistant", content="")),
        _chunk(ChatDelta(reasoning_content="hm")), _chunk(ChatDelta(reasoning_content="m")),
        _chunk(ChatDelta(content="Hi")), _chunk(ChatDelta(content=" there")),
        _chunk(_call_delta(0, "call_x", "get_weather", "")), _chunk(_call_delta(0, arguments='{"city"')),
        _chunk(_call_delta(0, arguments=': "Oslo"}'), finish="tool_calls"),
        _chunk(usage=usage),
    ])  # fmt: skip
    assert [(e["type"], e.get("index"), e.get("delta", {}).get("type")) for e in events] == [
        ("message_start", None, None), ("ping", None, None),
        ("content_block_start", 0, None), ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "thinking_delta"), ("content_block_delta", 0, "signature_delta"),
        ("content_block_stop", 0, None),
        ("content_block_start", 1, None), ("content_block_delta", 1, "text_delta"),
        ("content_block_delta", 1, "text_delta"), ("content_block_stop", 1, None),
        ("content_block_start", 2, None), ("content_block_delta", 2, "input_json_delta"),
        ("content_block_delta", 2, "input_json_delta"), ("content_block_stop", 2, None),
        ("message_delta", None, None), ("message_stop", None, None),
    ]  # fmt: skip
    start = events[0]["message"]
    assert (
        start["content"] == []
        and start["stop_reason"] is None
        and start["usage"]["input_tokens"] == 7
    )
    assert events[2]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
    assert events[11]["content_block"] == {
        "type": "tool_use",
        "id": "toolu_x",
        "name": "get_weather",
        "input": {},
    }
    assert "".join(e.get("delta", {}).get("partial_json", "") for e in events) == '{"city": "Oslo"}'
    assert events[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert events[-2]["usage"] == {
        "input_tokens": 3,
        "output_tokens": 5,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 4,
    }


def test_a_stop_sequence_or_max_tokens_ends_the_stream_so():
    usage = Usage(prompt_tokens=7, completion_tokens=2, total_tokens=9)
    stopped = _events(
        [_chunk(ChatDelta(content="a")), _chunk(ChatDelta(), finish="stop"), _chunk(usage=usage)],
        stop="END",
    )
    assert stopped[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}
    ended = _events([_chunk(ChatDelta(content="a"), finish="stop")])
    assert ended[-2]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    cut = _events([_chunk(ChatDelta(content='[{"na'), finish="length")], text_allowed=False)
    assert [e["type"] for e in cut] == ["message_start", "ping", "message_delta", "message_stop"]
    assert cut[-2]["delta"]["stop_reason"] == "max_tokens"
    # fmt: skip


def test_a_failure_mid_stream_is_an_error_event():
    events = _events([_chunk(ChatDelta(content="a")), Unavailable("no worker")])
    assert events[-1] == {"type": "error", "error": {"type": "api_error", "message": "no worker"}}


@pytest.mark.parametrize(
    ("error", "status", "kind"),
    [(InvalidRequest("bad", "max_tokens"), 400, "invalid_request_error"), (ModelNotFound("no model"), 404, "not_found_error"),
     (Unavailable("gone"), 503, "api_error")],
)  # fmt: skip
def test_errors_take_anthropics_shape(error, status, kind):
    assert error.status == status
    shaped = error_body(error)
    assert (
        shaped["type"] == "error"
        and shaped["error"]["type"] == kind
        and set(shaped["error"]) == {"type", "message"}
    )


# ---- what Claude Code sends ----------------------------------------------------------------
class TemplateTokenizer:
    """The tokenizer's one seam used here: its template, rendered by jinja2."""

    def __init__(self, source: str):
        import jinja2

        def raise_exception(message):
            raise jinja2.TemplateError(message)

        self.chat_template = source
        env = jinja2.Environment()
        env.globals["raise_exception"] = raise_exception
        self.template = env.from_string(source)

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt)


SYSTEM_FIRST_ONLY = (
    "{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
    "{{ raise_exception('System role only first') }}{% endif %}"
    "[{{ m.role }}]{{ m.content }}{% endfor %}"
)


def test_a_system_turn_stands_where_sent_or_joins_the_system_prompt():
    from llmq.tools.model_factory import CHAT_TEMPLATE

    sent = body(
        system=[{"type": "text", "text": "S"}],
        messages=[
            {"role": "user", "content": "q"},
            {"role": "system", "content": [{"type": "text", "text": "env"}]},
            {"role": "assistant", "content": "a"},
            {"role": "system", "content": "late", "output_config": {"effort": "low"}},
            {"role": "user", "content": "r"},
        ],
    )
    chatml = Template.of(TemplateTokenizer(CHAT_TEMPLATE))
    assert chatml.mid_system and not chatml.effort
    roles = [(m.role, m.content) for m in chat_request(sent, chatml).messages]
    assert roles == [
        ("system", "S"),
        ("user", "q"),
        ("system", "env"),
        ("assistant", "a"),
        ("system", "late"),
        ("user", "r"),
    ]
    first_only = Template.of(TemplateTokenizer(SYSTEM_FIRST_ONLY))
    assert not first_only.mid_system
    roles = [(m.role, m.content) for m in chat_request(sent, first_only).messages]
    assert roles == [
        ("system", "S\n\nenv\n\nlate"),
        ("user", "q"),
        ("assistant", "a"),
        ("user", "r"),
    ]
    with pytest.raises(ValidationError, match="text blocks only"):
        body(
            messages=[
                {
                    "role": "system",
                    "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}],
                }
            ]
        )


def test_effort_is_honoured_where_the_template_has_it_else_named_as_ignored():
    from llmq.common.serving.messages_api.translate import ignored_effort

    sent = body(
        output_config={"effort": "max"},
        messages=[
            {"role": "user", "content": "q"},
            {"role": "system", "content": "turn", "output_config": {"effort": "low"}},
        ],
    )
    assert chat_request(sent, TAKES_EFFORT).reasoning_effort == "low"  # the last turn's
    assert ignored_effort(sent, TAKES_EFFORT) is None
    plain = Template(effort=False)
    assert chat_request(sent, plain).reasoning_effort is None
    assert ignored_effort(sent, plain) == "low"
    assert (
        chat_request(body(output_config={"effort": "max"}), TAKES_EFFORT).reasoning_effort == "high"
    )


def _tool_loop(n: int) -> list[dict]:
    turns = [{"role": "user", "content": "go"}]
    for i in range(n):
        use = {"type": "tool_use", "id": f"toolu_{i}", "name": "Read", "input": {"p": str(i)}}
        result = {"type": "tool_result", "tool_use_id": f"toolu_{i}", "content": f"result {i}"}
        turns += [{"role": "assistant", "content": [use]}, {"role": "user", "content": [result]}]
    return turns


def test_context_management_edits_are_taken_and_tool_uses_cleared_oldest_first():
    from llmq.common.serving.messages_api.context_edits import CLEARED, cleared, tool_clearing

    thinking = {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}
    assert tool_clearing(body(context_management=thinking)) is None  # nothing to clear here
    edit = {"type": "clear_tool_uses_20250919", "keep": {"type": "tool_uses", "value": 1}}
    edit["clear_tool_inputs"] = True
    sent = body(messages=_tool_loop(3), context_management={"edits": [edit]})
    after, count = cleared(sent, tool_clearing(sent))
    assert count == 2
    chat = chat_request(after, TAKES_EFFORT)
    results = [m.content for m in chat.messages if m.role == "tool"]
    assert results == [CLEARED, CLEARED, "result 2"]
    inputs = [c.function.arguments for m in chat.messages for c in m.tool_calls or []]
    assert inputs == ["{}", "{}", '{"p": "2"}']
    with pytest.raises(ValidationError, match="clear_everything_1"):
        body(context_management={"edits": [{"type": "clear_everything_1"}]})


def test_usage_counts_the_cache_writes_of_a_request_with_breakpoints():
    from llmq.common.serving.messages_api.objects import message_usage

    usage = Usage(
        prompt_tokens=100,
        completion_tokens=3,
        total_tokens=103,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=32),
    )
    marked = message_usage(usage, cache_block=16)  # 96 in full blocks, 32 of them read
    assert (marked.cache_read_input_tokens, marked.cache_creation_input_tokens) == (32, 64)
    assert marked.input_tokens == 4  # the partial block's, which the cache does not keep
    plain = message_usage(usage)
    assert (plain.input_tokens, plain.cache_creation_input_tokens) == (68, 0)
    block = {"type": "text", "text": "s", "cache_control": {"type": "ephemeral"}}
    assert body(system=[block]).cache_marked() and not body().cache_marked()
    user = {"role": "user", "content": [block]}
    assert body(messages=[user]).cache_marked()
    assert body(tools=[{**TOOL, "cache_control": {"type": "ephemeral"}}]).cache_marked()
