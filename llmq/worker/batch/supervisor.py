"""A worker thread that finds batches (and background responses) whose task died with its
worker and queues them again, and deletes files past their retention.

The broker alone brings a killed task back slowly, or twice (see DESIGN.md): a batch's lease in
Redis says whether its task still runs."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from llmq.common.settings import Settings, get_settings
from llmq.common.storage.background_responses import (
    BackgroundResponses,
    dispatch_background,
    is_final,
)
from llmq.common.storage.store import FINAL_STATES, Store
from llmq.common.transport.celery_client import dispatch_batch
from llmq.common.transport.redis_clients import async_client, keys_for

log = logging.getLogger("llmq.batch")


async def redispatch_orphans(
    store: Store, settings: Settings, queued_grace: float = 60.0
) -> list[str]:
    """Batches not finished whose task holds no lease (its worker died): queue their task
    again. A batch never started gets ``queued_grace`` seconds for its first task to come up;
    a short marker lets only one worker re-send."""
    sent = []
    now = time.time()
    for batch_id in await store.active_batches():
        batch = await store.get_batch(batch_id)
        if batch is None or batch["status"] in FINAL_STATES:
            await store.r.srem(store.keys.batches_active, batch_id)
            continue
        if await store.lease_holder(batch_id) is not None:
            continue
        started = batch["in_progress_at"] or batch["cancelling_at"]
        if not started and now - batch["created_at"] < queued_grace:
            continue
        if await store.r.set(store.keys.batch_dispatch(batch_id), "1", nx=True, ex=30):
            log.warning("batch %s has no running task; dispatching it again", batch_id)
            await asyncio.to_thread(dispatch_batch, settings, batch_id)
            sent.append(batch_id)
    return sent


async def redispatch_background(
    store: BackgroundResponses, settings: Settings, queued_grace: float = 60.0
) -> list[str]:
    """Background responses not finished whose run holds no lease (its worker died, or its
    task was never picked up after a crash): queue their task again, one worker sending."""
    sent = []
    for raw in await store.r.smembers(store.active_key()):
        response_id = raw.decode()
        record = await store.load(response_id)
        if record is None or is_final(record):
            await store.r.srem(store.active_key(), response_id)
            continue
        started = record["response"]["status"] != "queued"
        if not started and time.time() - record["response"]["created_at"] < queued_grace:
            continue  # its first task may not be picked up yet
        if await store.r.exists(store.lease_key(response_id)):
            continue
        if await store.r.set(store.lease_key(response_id) + ":sent", "1", nx=True, ex=30):
            log.warning(
                "background response %s has no running task; queueing it again", response_id
            )
            await asyncio.to_thread(dispatch_background, settings, response_id)
            sent.append(response_id)
    return sent


def supervise(stop: threading.Event) -> None:
    """Worker thread: re-dispatch batches whose task died with its worker, looking every half
    lease (at most 5 s)."""
    settings = get_settings()
    interval = min(5.0, settings.batch_lease_ttl / 2)

    async def loop() -> None:
        client = async_client(
            settings.redis_url_or_default(), sentinel_master=settings.redis_sentinel_master
        )
        store = Store(client, keys_for(settings), settings.file_retention)
        background = BackgroundResponses(client, keys_for(settings), settings.background_retention)
        try:
            while not stop.is_set():
                try:
                    await redispatch_orphans(store, settings)
                    await redispatch_background(background, settings)
                    # Files past their retention go as a delete does: bytes given back.
                    await store.sweep_expired()
                except Exception as exc:  # Redis away: try again next round
                    log.debug("batch supervisor: %s", exc)
                await asyncio.to_thread(stop.wait, interval)
        finally:
            await client.aclose()

    asyncio.run(loop())
