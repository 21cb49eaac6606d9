"""Errors in Anthropic's shape, ``{"type": "error", "error": {"type", "message"}}``, with
Anthropic's type for each status. llmq's 503 (no live worker, Redis away, the server shutting
down) keeps its status with type ``api_error``: the anthropic SDK retries every 5xx alike,
honouring ``Retry-After``, and a 503 tells proxies and monitors the truth (529 is Anthropic's
own overload, which no other HTTP client knows)."""

from __future__ import annotations

from typing import Any

from llmq.common.errors import LLMQError

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def error_type(status: int) -> str:
    if status in _TYPES:
        return _TYPES[status]
    return "invalid_request_error" if 400 <= status < 500 else "api_error"


def error_body(error: LLMQError) -> dict[str, Any]:
    """The error's body (and, streamed, its ``error`` event's data)."""
    message = error.message
    if error.param and error.param not in message:
        message = f"{error.param}: {message}"
    return {"type": "error", "error": {"type": error_type(error.status), "message": message}}
