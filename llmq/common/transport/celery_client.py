"""The Celery configuration shared by the API (which sends batch tasks by name) and the
workers (which run them): Redis broker and result backend under the key prefix, JSON only.

Both sides build their app here, so they agree on the broker, the serializers and where
Celery's keys live; the API never loads the worker's code to queue a task.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from llmq.common.settings import Settings
from llmq.common.transport.redis_cluster import is_cluster_url
from llmq.common.transport.redis_sentinel import is_sentinel_url

if TYPE_CHECKING:
    from celery import Celery

BATCH_TASK = "llmq.batch.run"
BATCH_QUEUE = "llmq.batch"


def broker_url(settings: Settings) -> str:
    """Celery refuses a rediss:// URL without ssl_cert_reqs; default it to verifying the
    server's certificate (redis-py reads the same query parameter), so TLS is configured by the
    URL alone."""
    url = settings.celery_broker_url or settings.redis_url_or_default()
    if is_cluster_url(url):
        raise ValueError(
            "Celery's broker cannot be a Redis Cluster: set LLMQ_CELERY_BROKER_URL to one Redis "
            "node (or a sentinel:// set) for batch tasks"
        )
    if url.startswith("rediss://") and "ssl_cert_reqs" not in url:
        url += ("&" if "?" in url else "?") + "ssl_cert_reqs=required"
    return url


def make_celery(settings: Settings, include: list[str] | None = None) -> Celery:
    """A Celery app on llmq's Redis: what a sender and a worker must agree on."""
    # Imported here: importing Celery (kombu, billiard, cffi) was a fifth of an API's start,
    # which sends a task only when a batch, a background response or a webhook comes.
    from celery import Celery

    url = broker_url(settings)
    app = Celery("llmq", broker=url, backend=url, include=include or [])
    celery_keys: dict = {"global_keyprefix": f"{settings.key_prefix}:celery:"}
    if is_sentinel_url(url):
        # kombu's sentinel transport and Celery's sentinel backend take the same `;` list of
        # sentinels and ask them for this master.
        celery_keys["master_name"] = settings.redis_sentinel_master
    app.conf.update(
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        event_serializer="json",
        task_default_queue=BATCH_QUEUE,
        result_expires=7 * 24 * 3600,
        task_send_sent_event=True,
        broker_transport_options={"visibility_timeout": 60, **celery_keys},
        result_backend_transport_options=celery_keys,
    )
    return app


_senders: dict[tuple[str, str, str], Celery] = {}
_senders_lock = threading.Lock()


def _sender(settings: Settings) -> Celery:
    """One sending app per broker, key prefix and sentinel master, built on first use (dispatch runs in
    threads)."""
    key = (broker_url(settings), settings.key_prefix, settings.redis_sentinel_master)
    with _senders_lock:
        app = _senders.get(key)
        if app is None:
            app = _senders[key] = make_celery(settings)
        return app


def dispatch_batch(settings: Settings, batch_id: str) -> None:
    """Queue the task that runs a batch, by its name (blocking: call it from a thread)."""
    _sender(settings).send_task(BATCH_TASK, args=[batch_id], queue=BATCH_QUEUE)
