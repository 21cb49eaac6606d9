"""The tool calls of one chat choice, as OpenAI answers them: parsed from its output (tool_choice
"auto": the model family's format; "required": the array the grammar forced) or, for a named
function, the output itself as that function's arguments. Streamed, a call's first delta has
its id, type and name with arguments "", the next ones add to its arguments as they are
generated. Whole, the answer is the same parser's events over the whole output, so the two
agree: a call cut short (by max_tokens) is answered with its arguments as far as they got,
streamed or not."""

from __future__ import annotations

import uuid
from typing import Literal

from llmq.common.serving.responses import (
    AssistantMessage,
    ChatDelta,
    FunctionCall,
    FunctionCallDelta,
    ToolCall,
    ToolCallDelta,
)
from llmq.common.serving.tool_parsers import (
    ArgumentsText,
    CallOpened,
    ContentText,
    Event,
    ToolCallFormat,
    ToolCallParser,
    collect,
    output_events,
)

ToolMode = Literal["auto", "required", "named"]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _opening(index: int, name: str) -> ChatDelta:
    function = FunctionCallDelta(name=name, arguments="")
    call = ToolCallDelta(index=index, id=new_call_id(), type="function", function=function)
    return ChatDelta(tool_calls=[call])


def _arguments(index: int, text: str) -> ChatDelta:
    call = ToolCallDelta(index=index, function=FunctionCallDelta(arguments=text))
    return ChatDelta(tool_calls=[call])


def _deltas(events: list[Event]) -> list[ChatDelta]:
    """One delta per event, runs of text (or of one call's arguments) joined."""
    merged: list[Event] = []
    for e in events:
        last = merged[-1] if merged else None
        if isinstance(e, ContentText) and isinstance(last, ContentText):
            merged[-1] = ContentText(last.text + e.text)
        elif (
            isinstance(e, ArgumentsText)
            and isinstance(last, ArgumentsText)
            and last.index == e.index
        ):
            merged[-1] = ArgumentsText(e.index, last.text + e.text)
        else:
            merged.append(e)
    out = []
    for e in merged:
        if isinstance(e, ContentText):
            out.append(ChatDelta(content=e.text))
        elif isinstance(e, CallOpened):
            out.append(_opening(e.index, e.name))
        else:
            out.append(_arguments(e.index, e.text))
    return out


class ChoiceToolCalls:
    """``fmt``: the format parsed (auto, required); ``named``: the function forced."""

    def __init__(
        self, mode: ToolMode, fmt: ToolCallFormat | None, named: str | None, parallel: bool
    ):
        self.mode = mode
        self.fmt = fmt
        self.named = named
        self.parallel = parallel
        self.parser = ToolCallParser(fmt) if fmt is not None else None
        self.called = False  # a call was streamed

    # ---- streamed ----------------------------------------------------------------------------
    def feed(self, text: str) -> list[ChatDelta]:
        if self.parser is None:
            return self._named(text)
        return self._events(self.parser.feed(text))

    def finish(self) -> list[ChatDelta]:
        return [] if self.parser is None else self._events(self.parser.finish())

    def stream_finish_reason(self, reason: str) -> str:
        return "tool_calls" if self.called and reason == "stop" and self.named is None else reason

    def _named(self, text: str) -> list[ChatDelta]:
        assert self.named is not None
        deltas = [] if self.called else [_opening(0, self.named)]
        self.called = True
        return deltas + ([_arguments(0, text)] if text else [])

    def _events(self, events: list[Event]) -> list[ChatDelta]:
        events = self._answered(events)
        self.called = self.called or any(isinstance(e, CallOpened) for e in events)
        return _deltas(events)

    def _answered(self, events: list[Event]) -> list[Event]:
        if not self.parallel:  # only the first call is answered
            return [e for e in events if isinstance(e, ContentText) or e.index == 0]
        return events

    # ---- whole -------------------------------------------------------------------------------
    def message(self, text: str, reason: str) -> tuple[AssistantMessage, str]:
        """The answer to a choice's whole output, and its finish reason: what its stream
        answers. An output of the model's own that holds no call, or a call that closed
        invalid, is answered as text; forced calls never are."""
        if self.named is not None:
            call = ToolCall(
                id=new_call_id(), function=FunctionCall(name=self.named, arguments=text)
            )
            return AssistantMessage(content=None, tool_calls=[call]), reason
        assert self.fmt is not None
        events, parser = output_events(self.fmt, text)
        parsed = collect(self._answered(events), parser.broken, parser.cut)
        forced = self.fmt.starts_with_calls  # (a first call cut before its name: no call)
        if not parsed.calls or (parsed.broken and not forced):
            return AssistantMessage(content=None if forced else text), reason
        calls = [
            ToolCall(id=new_call_id(), function=FunctionCall(name=name, arguments=args))
            for name, args in parsed.calls
        ]
        content = parsed.content or None
        return AssistantMessage(content=content, tool_calls=calls), (
            "tool_calls" if reason == "stop" else reason
        )
