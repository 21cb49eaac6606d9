"""Every error leaves the API in OpenAI's shape: {"error": {message, type, param, code}}."""

from __future__ import annotations

import logging

import redis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from llmq.common.errors import LLMQError, redis_failure
from llmq.common.validation import validation_error

log = logging.getLogger(__name__)


def error_response(exc: LLMQError) -> JSONResponse:
    headers = {}
    retry_after = getattr(exc, "retry_after", None)
    if retry_after is not None:
        headers["Retry-After"] = str(retry_after)
    if getattr(exc, "should_retry", None) is False:
        headers["x-should-retry"] = "false"
    if exc.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse(exc.to_dict(), status_code=exc.status, headers=headers)


def _plain(status: int, message: str, type_: str, param=None, code=None) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(LLMQError)
    async def _llmq(request: Request, exc: LLMQError):
        if exc.status >= 500:
            log.warning("%s %s: %s", request.method, request.url.path, exc.message)
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        return error_response(validation_error(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        code = "request_too_large" if exc.status_code == 413 else None
        return _plain(exc.status_code, str(exc.detail), type_, code=code)

    @app.exception_handler(redis.RedisError)
    async def _redis(request: Request, exc: redis.RedisError):
        log.warning("redis failed %s %s: %s", request.method, request.url.path, exc)
        return error_response(redis_failure(exc))

    @app.exception_handler(Exception)
    async def _any(request: Request, exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return _plain(500, "internal error; see the server log", "server_error")
