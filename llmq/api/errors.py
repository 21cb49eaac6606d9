"""Every error leaves the API in OpenAI's shape: {"error": {message, type, param, code}}."""

from __future__ import annotations

import logging

import redis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from llmq.common.errors import LLMQError

log = logging.getLogger(__name__)


def error_response(exc: LLMQError) -> JSONResponse:
    headers = {}
    retry_after = getattr(exc, "retry_after", None)
    if retry_after is not None:
        headers["Retry-After"] = str(retry_after)
    if exc.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse(exc.to_dict(), status_code=exc.status, headers=headers)


def _plain(status: int, message: str, type_: str, param=None, code=None) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


def _param(loc: tuple) -> str | None:
    parts = [str(p) for p in loc if p not in ("body", "query", "path")]
    return ".".join(parts) or None


# What pydantic names the members of a union in an error's location, in words.
_UNION_MEMBERS = {
    "str": "a string",
    "list[str]": "an array of strings",
    "list[constrained-int]": "an array of token ids",
    "list[list[constrained-int]]": "an array of arrays of token ids",
    "list[TextPart]": "an array of text parts",
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


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(LLMQError)
    async def _llmq(request: Request, exc: LLMQError):
        if exc.status >= 500:
            log.warning("%s %s: %s", request.method, request.url.path, exc.message)
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        message, param = validation_message(list(exc.errors()))
        return _plain(400, message, "invalid_request_error", param, "invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        code = "request_too_large" if exc.status_code == 413 else None
        return _plain(exc.status_code, str(exc.detail), type_, code=code)

    @app.exception_handler(redis.RedisError)
    async def _redis(request: Request, exc: redis.RedisError):
        log.warning("redis unavailable: %s", exc)
        resp = _plain(
            503,
            "the queue (Redis) is unavailable; retry shortly",
            "service_unavailable",
            code="redis_unavailable",
        )
        resp.headers["Retry-After"] = "2"
        return resp

    @app.exception_handler(Exception)
    async def _any(request: Request, exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return _plain(500, "internal error; see the server log", "server_error")
