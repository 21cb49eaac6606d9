"""The Celery task that delivers one webhook event to one endpoint (common/webhooks.py): a
2xx answer delivers it; anything else (another status, no answer within
LLMQ_WEBHOOK_TIMEOUT) tries again after LLMQ_WEBHOOK_RETRY_INITIAL seconds, doubled each time,
up to LLMQ_WEBHOOK_MAX_ATTEMPTS attempts. A retry is a new task message with a countdown, so
no worker thread waits out the backoff, and a slow receiver holds one thread for at most its
timeout, never a generation. Each attempt's outcome is logged and kept in Redis
(``{prefix}:webhooks:deliveries``, the newest 1000, first).
"""

from __future__ import annotations

import json
import logging

import httpx
from celery import Task

from llmq.common.settings import Settings, get_settings
from llmq.common.transport.redis_clients import tool_client
from llmq.common.webhooks import (
    WEBHOOK_TASK,
    deliveries_key,
    delivery_record,
    endpoints,
    signed_headers,
)
from llmq.worker.celery_app import app

log = logging.getLogger("llmq.webhooks")
KEEP_RECORDS = 1000


def attempt(settings: Settings, url: str, event: dict) -> str:
    """One POST of ``event`` to ``url``: "delivered" or what went wrong."""
    endpoint = next((e for e in endpoints(settings) if e.url == url), None)
    if endpoint is None:
        return "endpoint no longer configured"
    body = json.dumps(event, separators=(",", ":")).encode()
    headers = signed_headers(endpoint.secret, event["id"], body)
    try:
        answer = httpx.post(url, content=body, headers=headers, timeout=settings.webhook_timeout)
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "delivered" if answer.is_success else f"HTTP {answer.status_code}"


def record(settings: Settings, line: str) -> None:
    try:
        r = tool_client(settings.redis_url_or_default(), settings.redis_sentinel_master)
        with r.pipeline() as pipe:
            pipe.lpush(deliveries_key(settings.key_prefix), line)
            pipe.ltrim(deliveries_key(settings.key_prefix), 0, KEEP_RECORDS - 1)
            pipe.execute()
        r.close()
    except Exception as exc:  # the outcome is logged in any case
        log.debug("webhook outcome not recorded: %s", exc)


@app.task(name=WEBHOOK_TASK, bind=True, acks_late=True, max_retries=None)
def deliver(self: Task, url: str, event: dict) -> str:
    settings = get_settings()
    number = self.request.retries + 1
    outcome = attempt(settings, url, event)
    record(settings, delivery_record(event, url, number, outcome))
    what = f"webhook {event['id']} {event['type']} to {url}, attempt {number}"
    if outcome == "delivered" or outcome == "endpoint no longer configured":
        log.info("%s: %s", what, outcome)
        return outcome
    if number >= settings.webhook_max_attempts:
        log.warning("%s: %s; given up", what, outcome)
        return f"given up: {outcome}"
    delay = settings.webhook_retry_initial * 2 ** (number - 1)
    log.warning("%s: %s; again in %.1f s", what, outcome, delay)
    raise self.retry(countdown=delay)
