"""One run of a batch: its lease, the walk through its states (validating, in_progress,
finalizing, then completed, failed, cancelled or expired), and its progress as Celery sees it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid

from celery import Task

from llmq.common.redis_clients import async_client
from llmq.common.settings import get_settings
from llmq.common.store import FINAL_STATES, Store
from llmq.common.transport import Keys
from llmq.worker.batch.executor import open_executor
from llmq.worker.batch.input_lines import InputLine, read_input
from llmq.worker.batch.lines import LineRunner
from llmq.worker.batch.results import finalize

log = logging.getLogger("llmq.batch")

LEASE_TTL = 10.0


class BatchRun:
    def __init__(self, batch_id: str, task: Task | None = None):
        self.batch_id = batch_id
        self.task = task
        self.settings = get_settings()
        task_id = getattr(getattr(task, "request", None), "id", None) or "local"
        self.owner = f"{task_id}:{uuid.uuid4().hex[:8]}"
        self.expires_at: float | None = None
        self._last_progress = 0.0
        self.store: Store

    async def run(self) -> dict:
        settings = self.settings
        client = async_client(settings.redis_url_or_default())
        self.store = Store(client, Keys(settings.key_prefix))
        try:
            if not await self.store.acquire_lease(self.batch_id, self.owner, LEASE_TTL):
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
        while not done.is_set():
            await asyncio.sleep(LEASE_TTL / 3)
            if done.is_set():
                return
            with contextlib.suppress(Exception):
                await self.store.renew_lease(self.batch_id, self.owner, LEASE_TTL)

    # ---- the batch -----------------------------------------------------------------------
    async def _run(self) -> dict:
        store = self.store
        batch = await store.get_batch(self.batch_id)
        if batch is None:
            return {"batch": self.batch_id, "skipped": "no such batch"}
        if batch["status"] in FINAL_STATES:
            return {"batch": self.batch_id, "status": batch["status"]}
        self.expires_at = batch["expires_at"]
        if self._expired():
            lines = await self._lines(batch, quiet=True) or []
            await self._finalize("expired", ("validating", "in_progress", "finalizing"), lines)
            return {"batch": self.batch_id, "status": "expired"}
        lines = await self._lines(batch)
        if lines is None:
            return {"batch": self.batch_id, "status": "failed"}
        if batch["status"] == "validating":
            await store.update_batch(self.batch_id, total=len(lines))
            await store.transition(self.batch_id, "in_progress", ("validating",))
        if await store.status(self.batch_id) == "in_progress":
            await self._run_lines(batch, lines)
        status = await store.status(self.batch_id)
        if status == "cancelling":
            await self._finalize("cancelled", ("cancelling",), lines)
        elif status in ("in_progress", "finalizing") and self._expired():
            await self._finalize("expired", ("in_progress", "finalizing"), lines)
        elif status in ("in_progress", "finalizing"):
            await self._finalize("completed", ("in_progress", "finalizing"), lines)
        final = await store.get_batch(self.batch_id)
        return {"batch": self.batch_id, "status": final["status"], **final["request_counts"]}

    def _expired(self) -> bool:
        return bool(self.expires_at) and time.time() > self.expires_at

    async def _lines(self, batch: dict, quiet: bool = False) -> list[InputLine] | None:
        """The input file's non-empty lines; None (and, unless ``quiet``, the batch failed)
        when it is not JSONL."""
        lines, errors = await read_input(self.store, batch["input_file_id"])
        if not errors:
            return lines
        if not quiet:
            data = [e.to_dict() for e in errors[:100]]
            await self.store.update_batch(self.batch_id, errors={"object": "list", "data": data})
            await self._finalize("failed", ("validating",))
        return None

    async def _run_lines(self, batch: dict, lines: list[InputLine]) -> None:
        done = await self.store.done_lines(self.batch_id)
        todo = [line for line in lines if line.number not in done]
        log.info("batch %s: %d lines, %d to run", self.batch_id, len(lines), len(todo))
        async with open_executor(self.settings) as executor:
            runner = LineRunner(
                self.store,
                self.batch_id,
                batch["endpoint"],
                executor,
                self.settings.batch_concurrency,
            )
            cancelled = asyncio.Event()
            lines_over = asyncio.Event()
            watcher = asyncio.create_task(self._watch_cancel(cancelled, lines_over))
            tasks = [asyncio.create_task(runner.run(line, cancelled)) for line in todo]
            try:
                waiter = asyncio.ensure_future(asyncio.gather(*tasks, return_exceptions=True))
                stop = asyncio.ensure_future(cancelled.wait())
                await asyncio.wait([waiter, stop], return_when=asyncio.FIRST_COMPLETED)
            finally:
                for t in tasks:
                    t.cancel()
                lines_over.set()
                watcher.cancel()
                await asyncio.gather(*tasks, watcher, return_exceptions=True)
                stop.cancel()
        await self._progress(force=True)

    async def _watch_cancel(self, cancelled: asyncio.Event, lines_over: asyncio.Event) -> None:
        while not lines_over.is_set():  # see _renew_lease: cancel() alone may be lost
            await asyncio.sleep(0.5)
            if lines_over.is_set():
                return
            with contextlib.suppress(Exception):
                if await self.store.status(self.batch_id) != "in_progress" or self._expired():
                    cancelled.set()  # the lines not started yet stay unrun
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

    async def _finalize(
        self, final: str, allowed_from: tuple[str, ...], lines: list[InputLine] = ()
    ) -> None:
        final = await finalize(self.store, self.batch_id, final, allowed_from, lines)
        await self._progress(force=True)
        log.info("batch %s %s", self.batch_id, final)
