"""ToolCallParser: a model's output, fed in pieces, as text and tool calls in the order they can
be sent. The concatenated events are the same however the output is split: text that may be
the start of a call marker is held back (as stop strings are), a call's name is sent once its
``"name"`` and the start of its arguments have arrived, its arguments as they arrive."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from llmq.common.serving.tool_parsers.formats import ToolCallFormat
from llmq.common.serving.tool_parsers.json_extent import JsonExtent


@dataclass(slots=True)
class ContentText:
    text: str


@dataclass(slots=True)
class CallOpened:
    index: int
    name: str


@dataclass(slots=True)
class ArgumentsText:
    index: int
    text: str


Event = ContentText | CallOpened | ArgumentsText


@dataclass(slots=True)
class _CallObject:
    """One JSON object in the calls part of the output, being scanned."""

    start: int  # offset of its "{" in the output
    extent: JsonExtent = field(default_factory=JsonExtent)
    index: int | None = None  # set once its name was sent
    args_start: int = 0
    args_sent: int = 0
    args: JsonExtent | None = None


def _header_pattern(args_keys: tuple[str, ...]) -> re.Pattern[str]:
    keys = "|".join(re.escape(k) for k in args_keys)
    # Up to the first character of the arguments' object, so that a split cannot move it.
    return re.compile(
        r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:' + keys + r')"\s*:\s*(?=\{)'
    )


def _valid_call(text: str, args_keys: tuple[str, ...]) -> tuple[str, dict] | None:
    """(name, arguments) when ``text`` is one call object, else None."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in args_keys if k in obj), None)
    return (obj["name"], args) if isinstance(args, dict) else None


def _loads(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return None


@dataclass(slots=True)
class ParsedOutput:
    """A whole output: the text before the calls, and each call's name and arguments (the
    JSON text of an object). ``broken``: a call whose name was sent closed as no valid call;
    ``cut``: the output ended inside a call (its arguments as far as they got)."""

    content: str
    calls: list[tuple[str, str]]
    broken: bool
    cut: bool = False


def collect(events: list[Event], broken: bool, cut: bool = False) -> ParsedOutput:
    content = "".join(e.text for e in events if isinstance(e, ContentText))
    names = {e.index: e.name for e in events if isinstance(e, CallOpened)}
    args = {i: "" for i in names}
    for e in events:
        if isinstance(e, ArgumentsText):
            args[e.index] += e.text
    return ParsedOutput(content, [(names[i], args[i]) for i in sorted(names)], broken, cut)


def output_events(fmt: ToolCallFormat, text: str) -> tuple[list[Event], ToolCallParser]:
    """The events of a whole output (the same as those of any split of it, concatenated), and
    the parser that read it."""
    parser = ToolCallParser(fmt)
    return parser.feed(text) + parser.finish(), parser


def parse_output(fmt: ToolCallFormat, text: str) -> ParsedOutput:
    """The calls in a whole output."""
    events, parser = output_events(fmt, text)
    return collect(events, parser.broken, parser.cut)


class ToolCallParser:
    def __init__(self, fmt: ToolCallFormat):
        self.fmt = fmt
        self.header = _header_pattern(fmt.args_keys)
        self.text = ""
        self.pos = 0  # what is before it has been sent or skipped
        self.in_calls = fmt.starts_with_calls
        self.plain = False  # no calls can follow: the rest is text
        self.calls_from = 0  # where the calls part starts (its marker included)
        self.obj: _CallObject | None = None
        self.calls = 0
        self.broken = False  # a call whose name was sent closed as no valid call
        self.cut = False  # the output ended inside a call whose name was sent

    def feed(self, text: str) -> list[Event]:
        self.text += text
        return self._run(final=False)

    def finish(self) -> list[Event]:
        """The rest, at the end of the output."""
        events = self._run(final=True)
        if self.obj is not None and self.obj.index is not None:
            self.cut = True
        # No call in it after all: it was text, unless a grammar forced the calls (then it is
        # a first call cut before its name, never text).
        if self.in_calls and not self.calls and not self.fmt.starts_with_calls:
            events.append(ContentText(self.text[self.calls_from :]))
            self.pos = len(self.text)
        return [e for e in events if not isinstance(e, ContentText) or e.text]

    def _run(self, final: bool) -> list[Event]:
        events: list[Event] = []
        while self.pos < len(self.text):
            if self.plain:
                events.append(ContentText(self.text[self.pos :]))
                self.pos = len(self.text)
            elif not self.in_calls:
                if not self._text(events, final):
                    break
            elif self.obj is None:
                at = self.text.find("{", self.pos)
                if at < 0:
                    self.pos = len(self.text)  # between calls: closing tags, separators
                    break
                self.obj, self.pos = _CallObject(at), at
            elif not self._scan(events):
                break
        return events

    # ---- text before the calls ---------------------------------------------------------------
    def _text(self, events: list[Event], final: bool) -> bool:
        """Send text up to a marker (True: the calls start there) or what cannot start one."""
        if self.fmt.at_start_only:
            return self._at_start(final)
        found = [
            (at, -len(m), m) for m in self.fmt.markers if (at := self.text.find(m, self.pos)) >= 0
        ]
        if found:
            at, _, marker = min(found)
            events.append(ContentText(self.text[self.pos : at]))
            self._open_calls(at, marker)
            return True
        hold = 0 if final else self._partial_marker()
        end = len(self.text) - hold
        events.append(ContentText(self.text[self.pos : end]))
        self.pos = end
        return False

    def _at_start(self, final: bool) -> bool:
        rest = self.text[self.pos :]
        body = rest.lstrip()
        for marker in self.fmt.markers:
            if body.startswith(marker):
                self._open_calls(self.pos + len(rest) - len(body), marker)
                self.calls_from = 0
                return True
        if not final and (not body or any(m.startswith(body) for m in self.fmt.markers)):
            return False  # may still become a marker
        self.plain = True
        return True

    def _open_calls(self, at: int, marker: str) -> None:
        self.in_calls = True
        self.calls_from = at
        self.pos = at if marker in self.fmt.keep_markers else at + len(marker)

    def _partial_marker(self) -> int:
        """How many characters at the end may be the start of a marker."""
        tail = self.text[self.pos :]
        for k in range(min(len(tail), max(map(len, self.fmt.markers)) - 1), 0, -1):
            if any(m.startswith(tail[-k:]) for m in self.fmt.markers):
                return k
        return 0

    # ---- calls -------------------------------------------------------------------------------
    def _scan(self, events: list[Event]) -> bool:
        """Scan the current object as far as the output goes (True: it closed)."""
        obj = self.obj
        assert obj is not None
        self.pos += obj.extent.feed(self.text[self.pos :])
        if obj.index is None and obj.args is None:
            self._find_header(obj, events)
        if obj.args is not None and obj.index is not None:
            scanned = obj.args_start + obj.args.scanned
            obj.args.feed(self.text[scanned : self.pos])
            end = self.pos if obj.args.end is None else obj.args_start + obj.args.end
            if end > obj.args_sent:
                events.append(ArgumentsText(obj.index, self.text[obj.args_sent : end]))
                obj.args_sent = end
        if obj.extent.end is None:
            return False
        self._close(obj, events)
        self.obj = None
        return True

    def _find_header(self, obj: _CallObject, events: list[Event]) -> None:
        match = self.header.match(self.text, obj.start, self.pos)
        if match is None:
            return
        try:
            name = json.loads(f'"{match.group(1)}"')
        except ValueError:
            return
        obj.index, self.calls = self.calls, self.calls + 1
        obj.args_start = obj.args_sent = match.end()
        obj.args = JsonExtent()
        events.append(CallOpened(obj.index, name))

    def _close(self, obj: _CallObject, events: list[Event]) -> None:
        assert obj.extent.end is not None
        text = self.text[obj.start : obj.start + obj.extent.end]
        call = _valid_call(text, self.fmt.args_keys)
        if obj.index is not None:
            sent = self.text[obj.args_start : obj.args_sent]
            if call is None or obj.args is None or obj.args.end is None or _loads(sent) != call[1]:
                self.broken = True
            return
        if call is None:
            return  # not a call (and nothing of it sent): skipped
        index, self.calls = self.calls, self.calls + 1
        events.append(CallOpened(index, call[0]))
        events.append(ArgumentsText(index, json.dumps(call[1], ensure_ascii=False)))
