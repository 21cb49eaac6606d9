"""Every error leaves the API in the shape of the API surface its route belongs to: OpenAI's
{"error": {message, type, param, code}} unless a surface (Anthropic's, Ollama's) registered
its own for its paths with ``register_error_shape``."""

from __future__ import annotations

import logging
from collections.abc import Callable

import redis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from llmq.common.errors import LLMQError, redis_failure
from llmq.common.validation import validation_error

log = logging.getLogger(__name__)

# An API surface's error body from the error (its status, type, code, message, param).
ErrorShape = Callable[[LLMQError], dict]
_SHAPES: list[tuple[str, ErrorShape]] = []


def register_error_shape(path_prefix: str, shape: ErrorShape) -> None:
    """Errors on paths under ``path_prefix`` leave in ``shape`` instead of OpenAI's."""
    _SHAPES.append((path_prefix, shape))


def shape_for(path: str) -> ErrorShape | None:
    for prefix, shape in _SHAPES:
        if path.startswith(prefix):
            return shape
    return None


def error_response(exc: LLMQError, path: str = "") -> JSONResponse:
    headers = {}
    retry_after = getattr(exc, "retry_after", None)
    if retry_after is not None:
        headers["Retry-After"] = str(retry_after)
    if getattr(exc, "should_retry", None) is False:
        headers["x-should-retry"] = "false"
    if exc.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    shape = shape_for(path)
    body = shape(exc) if shape else exc.to_dict()
    return JSONResponse(body, status_code=exc.status, headers=headers)


def _plain(path: str, status: int, message: str, type_: str, param=None, code=None) -> JSONResponse:
    error = LLMQError(message, param, code)
    error.status, error.type = status, type_
    return error_response(error, path)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(LLMQError)
    async def _llmq(request: Request, exc: LLMQError):
        if exc.status >= 500:
            log.warning("%s %s: %s", request.method, request.url.path, exc.message)
        return error_response(exc, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        return error_response(validation_error(list(exc.errors())), request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        code = "request_too_large" if exc.status_code == 413 else None
        return _plain(request.url.path, exc.status_code, str(exc.detail), type_, code=code)

    @app.exception_handler(redis.RedisError)
    async def _redis(request: Request, exc: redis.RedisError):
        log.warning("redis failed %s %s: %s", request.method, request.url.path, exc)
        return error_response(redis_failure(exc), request.url.path)

    @app.exception_handler(Exception)
    async def _any(request: Request, exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return _plain(request.url.path, 500, "internal error; see the server log", "server_error")
