"""The error a backend raises for a request it cannot run: the engine loop fails that one
request with it (``invalid_request_error``) and goes on."""

from __future__ import annotations


class RequestError(ValueError):
    """A request the engine cannot run (bad token ids, too long): the caller's fault."""
