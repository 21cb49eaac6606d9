"""A request body that failed validation, as one message and the field it names: the same 400
for the HTTP routes (FastAPI's validation errors) and batch lines (pydantic's)."""

from __future__ import annotations

from llmq.common.errors import InvalidRequest


def _param(loc: tuple) -> str | None:
    # FastAPI's locations start with where the value was ("body", or "query" / "path" and a
    # parameter's name); a batch line's start with the field (which may be named "query").
    if loc and (loc[0] == "body" or (loc[0] in ("query", "path") and len(loc) > 1)):
        loc = loc[1:]
    return ".".join(str(p) for p in loc) or None


# What pydantic names the members of a union in an error's location, in words.
_UNION_MEMBERS = {
    "str": "a string",
    "list[str]": "an array of strings",
    "list[constrained-int]": "an array of token ids",
    "list[list[constrained-int]]": "an array of arrays of token ids",
    "list[TextPart]": "an array of text parts",
    "list[tagged-union[TextPart,ImagePart]]": "an array of content parts",
    "dict[str,any]": "a JSON schema object",
    "RerankDocument": 'an object with "text"',
}


def _union_at(loc: tuple) -> int | None:
    """Where a union member's name sits in ``loc`` (pydantic puts one there for each member it
    tried), or None."""
    for i, part in enumerate(loc):
        if isinstance(part, str) and (part in _UNION_MEMBERS or "[" in part or "-" in part):
            return i
    return None


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """One message and its ``param`` for a request that failed validation: the first error, or,
    for a field of several accepted shapes (a union), the shapes it accepts."""
    first = errors[0] if errors else {}
    loc = tuple(first.get("loc", ()))
    if first.get("type") == "json_invalid":
        return "the body is not valid JSON", None
    at = _union_at(loc)
    if at is None:
        param = _param(loc)
        msg = first.get("msg", "invalid request").removeprefix("Value error, ")
        if not param or msg.startswith(param.split(".")[0]):  # the message names it already
            return msg, param
        return f"{param}: {msg}", param
    field, param = loc[:at], _param(loc[:at])
    tried = [e for e in errors if tuple(e.get("loc", ()))[:at] == field]
    empty = [e for e in tried if e.get("type") == "too_short" and len(e["loc"]) == at + 1]
    if empty:
        return f"{param} must not be empty", param
    shapes = list(dict.fromkeys(_UNION_MEMBERS.get(str(e["loc"][at]), "") for e in tried))
    shapes = [s for s in shapes if s]
    if len(shapes) < 2:
        msg = first.get("msg", "invalid request").removeprefix("Value error, ")
        return f"{param}: {msg}", param
    return f"{param} must be {', '.join(shapes[:-1])} or {shapes[-1]}", param


def validation_error(errors: list[dict]) -> InvalidRequest:
    """The 400 answered for a body that failed validation."""
    message, param = validation_message(errors)
    return InvalidRequest(message, param, "invalid_value")
