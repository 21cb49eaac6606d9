"""A request's stream entry as a worker holds it, and the reading of an entry's and a
record's fields."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import redis

from llmq.common.protocol import EngineRequest
from llmq.common.transport.keys import GROUP, as_text
from llmq.common.transport.output_log import merge

log = logging.getLogger(__name__)


def ensure_group(client: redis.Redis, stream: str) -> None:
    try:
        client.xgroup_create(stream, GROUP, id="0", mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


@dataclass(slots=True)
class PulledRequest:
    entry_id: str
    request: EngineRequest | None  # None: the entry could not be parsed
    prior_tokens: list[int]  # tokens generated before (a resumed request)
    cancelled: bool = False
    deliveries: int = 1
    raw: dict | None = None
    running: bool = False  # taken into service as it was pulled (PULLED_SCRIPT)


def set_prior_tokens(p: PulledRequest, values: list) -> None:
    """The tokens a request's record holds; a record that is not a list of values (written by
    hand) makes the request malformed: it fails, instead of raising on every restart."""
    try:
        p.prior_tokens = merge([as_text(v) for v in values])[0]
    except ValueError:
        log.warning("request %s: its token record is not token ids; failing it", p.request.id)
        p.request = None


def entry_request_id(hits: list) -> str | None:
    """The request id in an XRANGE reply of one entry (None: deleted, or none)."""
    if not hits or not hits[0][1]:
        return None
    fields = {as_text(k): v for k, v in hits[0][1].items()}
    return as_text(fields["id"]) if "id" in fields else None
