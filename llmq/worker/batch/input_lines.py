"""The batch's input file: its non-empty lines as they are read, the checks that fail the whole
batch before any line runs (one streaming pass), and the parsing of one line into the request
it carries."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

from llmq.common.errors import InvalidRequest
from llmq.common.storage.file_chunks import FileGone
from llmq.common.storage.jsonl_lines import InputLine, iter_lines
from llmq.common.storage.store import Store

MAX_ERRORS = 100  # of a refused file, as many as its batch object lists


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


@dataclass(frozen=True, slots=True)
class ValidationError:
    """One entry of the batch's ``errors`` list when its input file is refused."""

    code: str
    message: str
    line: int | None = None

    def to_dict(self) -> dict:
        return {"code": self.code, "message": self.message, "line": self.line}


def input_lines(store: Store, input_file_id: str) -> AsyncIterator[InputLine]:
    """The input file's non-blank lines, read a chunk at a time (FileGone if it is deleted
    meanwhile)."""
    return iter_lines(store.file_chunks(input_file_id))


async def validate_input(store: Store, input_file_id: str) -> tuple[int, list[ValidationError]]:
    """In one pass over the file: its number of non-blank lines, and what makes it unusable
    (nothing if it is valid). A file is JSONL if at least one line is JSON (the others fail
    alone when they run); custom_ids must be unique (only the ids are kept, never the lines)."""
    if await store.get_file(input_file_id) is None:
        return 0, [ValidationError("file_not_found", "the input file no longer exists")]
    errors: list[ValidationError] = []
    total = parsed = 0
    first = 0
    seen: dict[str, int] = {}
    try:
        async for n, line in input_lines(store, input_file_id):
            total += 1
            first = first or n
            try:
                obj = loads(line)
            except ValueError:
                continue
            parsed += 1
            cid = obj.get("custom_id") if isinstance(obj, dict) else None
            if isinstance(cid, str):
                if cid in seen and len(errors) < MAX_ERRORS:
                    message = f"custom_id {cid!r} appears on lines {seen[cid]} and {n}"
                    errors.append(ValidationError("duplicate_custom_id", message, n))
                seen.setdefault(cid, n)
    except FileGone:
        return total, [ValidationError("file_not_found", "the input file no longer exists")]
    if total == 0:
        return 0, [ValidationError("empty_file", "the input file has no lines")]
    if parsed == 0:
        message = "the input file is not JSONL: no line is a JSON object"
        errors.append(ValidationError("invalid_json_line", message, first))
    return total, errors


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
