"""Errors a client can act on, each with its HTTP status and OpenAI error type and code."""

from __future__ import annotations

import redis


class LLMQError(Exception):
    status = 500
    type = "server_error"
    code: str | None = None

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def to_dict(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class InvalidRequest(LLMQError):
    status = 400
    type = "invalid_request_error"


class ModelNotSupported(InvalidRequest):
    """The model's worker refused it: it needs something llmq does not implement."""

    code = "model_not_supported"


class AuthenticationFailed(LLMQError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class NotFound(LLMQError):
    status = 404
    type = "not_found_error"


class ModelNotFound(NotFound):
    type = "invalid_request_error"
    code = "model_not_found"


class BodyTooLarge(LLMQError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class QueueFull(LLMQError):
    status = 429
    type = "rate_limit_error"
    code = "queue_full"
    retry_after = 1


class QuotaExceeded(LLMQError):
    """A tenant's stored bytes would pass its quota. OpenAI's own answer to an account over
    its quota (429 insufficient_quota), which clients already handle as final; told not to
    retry (x-should-retry: false, which the openai clients obey), since waiting frees nothing:
    deleting files does."""

    status = 429
    type = "insufficient_quota"
    code = "insufficient_quota"
    should_retry = False


class Unavailable(LLMQError):
    status = 503
    type = "service_unavailable"
    code = "no_worker"
    retry_after = 5


class ServerShuttingDown(Unavailable):
    code = "server_shutting_down"


class DeadlineExceeded(LLMQError):
    status = 504
    type = "timeout"
    code = "deadline_exceeded"


class EngineFailure(LLMQError):
    status = 500
    type = "server_error"
    code = "engine_error"


def redis_failure(exc: redis.RedisError) -> Unavailable:
    """What a client is told when Redis fails a call: out of memory (maxmemory reached under
    noeviction: it refuses every write) by name, since retrying alone will not mend it; any
    other failure as Redis unavailable."""
    if isinstance(exc, redis.OutOfMemoryError):
        error = Unavailable(
            "Redis is out of memory (its maxmemory is reached) and refuses new requests; "
            "retry shortly",
            code="redis_out_of_memory",
        )
    else:
        error = Unavailable(
            "the queue (Redis) is unavailable; retry shortly", code="redis_unavailable"
        )
    error.retry_after = 2
    return error
