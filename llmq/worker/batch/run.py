"""One run of a batch: its lease, the walk through its states (validating, in_progress,
finalizing, then completed, failed, cancelled or expired), and its progress as Celery sees it.

A run that loses its lease (another run holds it, or it could not renew it in time) stops: it
cancels its lines in flight and finalizes nothing; the run holding the lease finishes the
batch."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid

from celery import Task

from llmq.common.settings import get_settings
from llmq.common.storage.batch_checkpoint import LineCheckpoint
from llmq.common.storage.store import FINAL_STATES, Store
from llmq.common.tenants import current_owner
from llmq.common.transport.redis_clients import async_client, keys_for
from llmq.common.webhooks import announce
from llmq.worker.batch.executor import open_executor
from llmq.worker.batch.feed import run_lines
from llmq.worker.batch.finalize import finalize
from llmq.worker.batch.input_lines import input_lines, validate_input
from llmq.worker.batch.lines import LineRunner, RetryPolicy
from llmq.worker.batch.retry import Backoff

log = logging.getLogger("llmq.batch")


class BatchRun:
    def __init__(self, batch_id: str, task: Task | None = None):
        self.batch_id = batch_id
        self.task = task
        self.settings = get_settings()
        task_id = getattr(getattr(task, "request", None), "id", None) or "local"
        self.owner = f"{task_id}:{uuid.uuid4().hex[:8]}"
        self.expires_at: float | None = None
        self._last_progress = 0.0
        self.stop = asyncio.Event()  # cancelled, expired or the lease lost: no line starts
        self.lease_lost = False
        self.store: Store

    def use(self, store: Store) -> None:
        self.store = store
        ttl = store.retention + 168 * 3600  # outlives the longest window
        self.checkpoint = LineCheckpoint(store.r, store.keys, self.batch_id, ttl)

    async def run(self) -> dict:
        settings = self.settings
        client = async_client(
            settings.redis_url_or_default(), sentinel_master=settings.redis_sentinel_master
        )
        self.use(Store(client, keys_for(settings), settings.file_retention))
        try:
            if not await self.store.acquire_lease(
                self.batch_id, self.owner, settings.batch_lease_ttl
            ):
                log.info("batch %s is already running elsewhere", self.batch_id)
                return {"batch": self.batch_id, "skipped": "running elsewhere"}
            done = asyncio.Event()
            renew = asyncio.create_task(self._renew_lease(done))
            try:
                return await self._run()
            finally:
                done.set()
                renew.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await renew
                await self.store.release_lease(self.batch_id, self.owner)
        finally:
            await client.aclose()

    async def _renew_lease(self, done: asyncio.Event) -> None:
        # Loops end on ``done``, not on cancel() alone: on Python 3.11 redis-py can swallow a
        # cancellation that lands while it opens a connection (asyncio.wait_for, gh-86296),
        # and a loop that missed its cancel would renew the lease of a finished run forever.
        renewed, ttl = time.monotonic(), self.settings.batch_lease_ttl
        while not done.is_set():
            await asyncio.sleep(ttl / 3)
            if done.is_set():
                return
            try:
                held = await self.store.renew_lease(self.batch_id, self.owner, ttl)
            except Exception as exc:  # Redis away: the lease may lapse meanwhile
                log.warning("batch %s: renewing its lease failed: %s", self.batch_id, exc)
                held = time.monotonic() - renewed < ttl
            else:
                renewed = time.monotonic()
            if not held:
                log.warning("batch %s: this run lost its lease; stopping", self.batch_id)
                self.lease_lost = True
                self.stop.set()
                return

    # ---- the batch -----------------------------------------------------------------------
    async def _run(self) -> dict:
        store = self.store
        batch = await store.get_batch(self.batch_id)
        if batch is None:
            return {"batch": self.batch_id, "skipped": "no such batch"}
        if batch["status"] in FINAL_STATES:
            return {"batch": self.batch_id, "status": batch["status"]}
        self.expires_at = batch["expires_at"]
        # Its lines see what its tenant owns (LoRA adapters), as that tenant's requests do.
        current_owner.set(await store.batch_owner(self.batch_id))
        if self._expired():
            await self._finalize(batch, "expired", ("validating", "in_progress", "finalizing"))
            return self._result(await store.get_batch(self.batch_id))
        # Its input stays while it may still be read (a re-dispatch may come late).
        await store.keep_file(batch["input_file_id"], int(self.expires_at - time.time()) + 3600)
        if batch["status"] == "validating" and not await self._validate(batch):
            return self._result(await store.get_batch(self.batch_id))
        if await store.status(self.batch_id) == "in_progress":
            await self._run_lines(batch)
        if self.lease_lost:
            return {"batch": self.batch_id, "skipped": "lease lost"}
        status = await store.status(self.batch_id)
        if status == "cancelling":
            await self._finalize(batch, "cancelled", ("cancelling",))
        elif status in ("in_progress", "finalizing") and self._expired():
            await self._finalize(batch, "expired", ("in_progress", "finalizing"))
        elif status in ("in_progress", "finalizing"):
            await self._finalize(batch, "completed", ("in_progress", "finalizing"))
        return self._result(await store.get_batch(self.batch_id))

    def _result(self, batch: dict | None) -> dict:
        if self.lease_lost or batch is None:
            return {"batch": self.batch_id, "skipped": "lease lost"}
        return {"batch": self.batch_id, "status": batch["status"], **batch["request_counts"]}

    def _expired(self) -> bool:
        return bool(self.expires_at) and time.time() > self.expires_at

    async def _validate(self, batch: dict) -> bool:
        """One pass over the input file; a file that is not JSONL fails the batch."""
        total, errors = await validate_input(self.store, batch["input_file_id"])
        if errors:
            data = [e.to_dict() for e in errors]
            await self.store.update_batch(self.batch_id, errors={"object": "list", "data": data})
            await self._finalize(batch, "failed", ("validating",))
            return False
        await self.store.update_batch(self.batch_id, total=total)
        await self.store.transition(self.batch_id, "in_progress", ("validating",), self.owner)
        return True

    async def _run_lines(self, batch: dict) -> None:
        done = await self.checkpoint.done()
        total = (await self.store.get_batch(self.batch_id))["request_counts"]["total"]
        log.info("batch %s: %d lines, %d to run", self.batch_id, total, total - len(done))
        settings = self.settings
        retry = RetryPolicy(
            Backoff(settings.batch_retry_initial, settings.batch_retry_max), self.expires_at or 0
        )
        async with open_executor(settings) as executor:
            runner = LineRunner(
                self.checkpoint,
                self.batch_id,
                batch["endpoint"],
                executor,
                retry,
                attempts=await self.checkpoint.attempts(),
                rerun=batch["in_progress_at"] is not None,
            )
            lines_over = asyncio.Event()
            watcher = asyncio.create_task(self._watch_cancel(lines_over))
            try:
                lines = input_lines(self.store, batch["input_file_id"])
                await run_lines(lines, done, runner.run, settings.batch_concurrency, self.stop)
            finally:
                lines_over.set()
                watcher.cancel()
                await asyncio.gather(watcher, return_exceptions=True)
        await self._progress(force=True)

    async def _watch_cancel(self, lines_over: asyncio.Event) -> None:
        while not lines_over.is_set():  # see _renew_lease: cancel() alone may be lost
            await asyncio.sleep(0.5)
            if lines_over.is_set():
                return
            with contextlib.suppress(Exception):
                if await self.store.status(self.batch_id) != "in_progress" or self._expired():
                    self.stop.set()  # the lines not started yet stay unrun
                    return
            await self._progress()

    async def _progress(self, force: bool = False) -> None:
        """Report (done, failed, total) to Celery: Flower shows it, as does the batch object."""
        now = time.monotonic()
        if not force and now - self._last_progress < 1.0:
            return
        self._last_progress = now
        batch = await self.store.get_batch(self.batch_id)
        if batch is None or self.task is None or getattr(self.task.request, "id", None) is None:
            return
        counts = batch["request_counts"]
        meta = {
            "batch_id": self.batch_id,
            "done": counts["completed"],
            "failed": counts["failed"],
            "total": counts["total"],
        }
        with contextlib.suppress(Exception):
            self.task.update_state(state="PROGRESS", meta=meta)
            self.task.send_event("task-progress", **meta)

    async def _finalize(self, batch: dict, final: str, allowed_from: tuple[str, ...]) -> None:
        moved = await finalize(self.store, self.checkpoint, batch, final, allowed_from, self.owner)
        if moved is None:
            log.warning("batch %s: this run lost its lease; not finalizing", self.batch_id)
            self.lease_lost = True
            return
        await self._progress(force=True)
        log.info("batch %s %s", self.batch_id, moved)
        if moved in ("completed", "failed", "expired", "cancelled"):
            await asyncio.to_thread(announce, self.settings, f"batch.{moved}", self.batch_id)
