"""Webhooks: events for background responses and batches, sent to the endpoints the operator
configured (LLMQ_WEBHOOKS), never to a URL taken from a request.

An event is OpenAI's shape (``{"id": "evt_...", "object": "event", "created_at", "type",
"data": {"id"}}``), signed per the Standard Webhooks scheme (``webhook-id``,
``webhook-timestamp``, ``webhook-signature: v1,<base64 HMAC-SHA256>``), which the openai SDK's
``client.webhooks.unwrap`` verifies. Each delivery is a Celery task (queue ``llmq.batch``,
worker/webhook_task.py) that retries with exponential backoff up to a limit; the event, and so
its ``webhook-id``, is the task's argument, the same on every attempt. The endpoint's secret
never travels in the broker: the task finds it by URL in its own settings.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, TypeAdapter

from llmq.common.settings import Settings
from llmq.common.transport.celery_client import BATCH_QUEUE, make_celery

if TYPE_CHECKING:
    from celery import Celery

WEBHOOK_TASK = "llmq.webhooks.deliver"
EVENTS = (
    "response.completed",
    "response.failed",
    "response.cancelled",
    "response.incomplete",
    "batch.completed",
    "batch.failed",
    "batch.expired",
    "batch.cancelled",
)
log = logging.getLogger("llmq.webhooks")


class Endpoint(BaseModel):
    """``secret``: ``whsec_`` and base64 (as OpenAI's), or any other string used as is;
    ``events``: the event types it gets (all of them when unset)."""

    url: str
    secret: str
    events: list[str] | None = None

    def wants(self, kind: str) -> bool:
        return self.events is None or kind in self.events


_ENDPOINTS = TypeAdapter(list[Endpoint])


def endpoints(settings: Settings) -> list[Endpoint]:
    """The configured endpoints (LLMQ_WEBHOOKS, a JSON list); a ValueError names what is
    wrong with the setting."""
    if not settings.webhooks:
        return []
    found = _ENDPOINTS.validate_json(settings.webhooks)
    for endpoint in found:
        if not endpoint.url.startswith(("http://", "https://")):
            raise ValueError(f"LLMQ_WEBHOOKS: {endpoint.url!r} is not an http(s) URL")
        unknown = set(endpoint.events or ()) - set(EVENTS)
        if unknown:
            raise ValueError(f"LLMQ_WEBHOOKS: unknown event types {sorted(unknown)}")
    return found


def new_event(kind: str, object_id: str) -> dict[str, Any]:
    return {
        "id": f"evt_{uuid.uuid4().hex}",
        "object": "event",
        "created_at": int(time.time()),
        "type": kind,
        "data": {"id": object_id},
    }


def signed_headers(secret: str, event_id: str, body: bytes, now: int | None = None) -> dict:
    """The Standard Webhooks headers of one delivery attempt of ``body``."""
    key = base64.b64decode(secret[6:]) if secret.startswith("whsec_") else secret.encode()
    timestamp = str(int(time.time()) if now is None else now)
    mac = hmac.new(key, f"{event_id}.{timestamp}.".encode() + body, hashlib.sha256)
    return {
        "content-type": "application/json",
        "webhook-id": event_id,
        "webhook-timestamp": timestamp,
        "webhook-signature": "v1," + base64.b64encode(mac.digest()).decode(),
    }


_senders: dict[tuple[str, str], Celery] = {}
_senders_lock = threading.Lock()


def announce(settings: Settings, kind: str, object_id: str) -> list[str]:
    """Queue one delivery of the event ``kind`` of ``object_id`` to each endpoint that wants
    it (blocking: call it from a thread); returns the URLs. A broker that cannot take the
    task is logged, never raised: an event is not worth failing the work it reports."""
    try:
        targets = [e.url for e in endpoints(settings) if e.wants(kind)]
    except ValueError as exc:
        log.error("no webhook sent for %s %s: %s", kind, object_id, exc)
        return []
    if not targets:
        return []
    event = new_event(kind, object_id)
    key = (settings.redis_url_or_default(), settings.key_prefix)
    with _senders_lock:
        app = _senders.get(key)
        if app is None:
            app = _senders[key] = make_celery(settings)
    for url in targets:
        try:
            app.send_task(WEBHOOK_TASK, args=[url, event], queue=BATCH_QUEUE)
        except Exception as exc:
            log.warning("webhook %s %s to %s not queued: %s", event["id"], kind, url, exc)
    return targets


def deliveries_key(prefix: str) -> str:
    """The list of delivery outcomes, newest first (the newest 1000)."""
    return f"{prefix}:webhooks:deliveries"


def delivery_record(event: dict[str, Any], url: str, attempt: int, outcome: str) -> str:
    """One line of the deliveries list (``llmq:webhooks:deliveries``, newest first)."""
    return json.dumps(
        {
            "webhook_id": event["id"],
            "type": event["type"],
            "url": url,
            "attempt": attempt,
            "outcome": outcome,
            "at": time.time(),
        }
    )
