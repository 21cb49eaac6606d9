"""The batch's input file: its non-empty lines, the checks that fail the whole batch before any
line runs, and the parsing of one line into the request it carries."""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from typing import NamedTuple

from llmq.common.errors import InvalidRequest
from llmq.common.store import Store


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


def loads(text: str):
    """JSON as RFC 8259 has it: NaN and Infinity (which Python's json accepts, and which no
    answer could carry) and nesting too deep to parse are ValueErrors, so the line fails alone
    with a 400 instead of a 500, or a task that dies on the whole file."""
    try:
        return json.loads(text, parse_constant=_refuse_constant)
    except RecursionError:
        raise ValueError("the line is nested too deeply") from None


class InputLine(NamedTuple):
    number: int  # 1-based, counting empty lines too
    text: str


@dataclass(frozen=True, slots=True)
class ValidationError:
    """One entry of the batch's ``errors`` list when its input file is refused."""

    code: str
    message: str
    line: int | None = None

    def to_dict(self) -> dict:
        return {"code": self.code, "message": self.message, "line": self.line}


async def read_input(
    store: Store, input_file_id: str
) -> tuple[list[InputLine], list[ValidationError]]:
    """The input file's non-empty lines and what makes the file unusable (nothing if valid)."""
    content = await store.file_content(input_file_id)
    if content is None:
        return [], [ValidationError("file_not_found", "the input file no longer exists")]
    text = content.decode("utf-8-sig", errors="replace")  # a BOM is no part of line 1
    lines = [InputLine(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not lines:
        return [], [ValidationError("empty_file", "the input file has no lines")]
    return lines, _validate(lines)


def _validate(lines: list[InputLine]) -> list[ValidationError]:
    """A file is JSONL if at least one line is JSON (the others fail alone when they run);
    custom_ids must be unique."""
    errors = []
    parsed = 0
    seen: dict[str, int] = {}
    for n, line in lines:
        try:
            obj = loads(line)
        except ValueError:
            continue
        parsed += 1
        cid = obj.get("custom_id") if isinstance(obj, dict) else None
        if isinstance(cid, str):
            if cid in seen:
                message = f"custom_id {cid!r} appears on lines {seen[cid]} and {n}"
                errors.append(ValidationError("duplicate_custom_id", message, n))
            seen[cid] = n
    if parsed == 0:
        message = "the input file is not JSONL: no line is a JSON object"
        errors.append(ValidationError("invalid_json_line", message, lines[0].number))
    return errors


@dataclass(frozen=True, slots=True)
class LineRequest:
    custom_id: str
    body: dict


class LineRefused(Exception):
    """A line that carries no valid request: it fails alone, with this error."""

    def __init__(self, custom_id: object, error: InvalidRequest):
        super().__init__(error.message)
        self.custom_id = custom_id  # as the line gave it, even when not a string
        self.error = error


def parse_line(line: InputLine, endpoint: str) -> LineRequest:
    """The request on one line, or LineRefused."""
    custom_id = None
    try:
        obj = loads(line.text)
        if not isinstance(obj, dict):
            raise ValueError("the line is not a JSON object")
        custom_id = obj.get("custom_id")
        if not isinstance(custom_id, str):
            raise ValueError("custom_id must be a string")
        url = obj.get("url")
        if url != endpoint:
            raise ValueError(f"url must be {endpoint!r}, the batch's endpoint; got {url!r}")
        if str(obj.get("method", "POST")).upper() != "POST":
            raise ValueError("method must be POST")
        body = obj.get("body")
        if not isinstance(body, dict):
            raise ValueError("body must be a JSON object")
    except ValueError as exc:
        error = InvalidRequest(f"line {line.number}: {exc}", code="invalid_line")
        raise LineRefused(custom_id, error) from exc
    return LineRequest(custom_id, {**body, "stream": False})


def custom_id_of(text: str) -> str | None:
    """The custom_id of a line that may not parse (for the rows of lines that never ran)."""
    with contextlib.suppress(ValueError, AttributeError):
        cid = loads(text).get("custom_id")
        return cid if isinstance(cid, str) else None
    return None
