"""Batch jobs (the OpenAI Batch API) as Celery tasks on queue ``llmq.batch``.

A task runs one batch: it validates the input file, then feeds its lines with bounded
concurrency through the same API code and pipeline as interactive requests (an in-process
instance of the API app), at batch priority, so batches fill idle capacity while interactive
requests go first. Each line's result is checkpointed in Redis as it finishes; a lease (renewed
while the task runs) keeps a second copy of the task from running the same batch, and a re-run
after a crash continues with the lines not yet recorded, attaching to the requests its first
run had started. Task arguments are ids only.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
import uuid

from llmq.common.errors import InvalidRequest, LLMQError
from llmq.common.pipeline import SubmitContext, submit_context
from llmq.common.protocol import PRIORITY_BATCH
from llmq.common.redis_clients import async_client
from llmq.common.settings import get_settings
from llmq.common.store import FINAL_STATES, Store
from llmq.common.transport import Keys
from llmq.worker.celery_app import BATCH_QUEUE, app

log = logging.getLogger("llmq.batch")
logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per batch line is noise

TASK_NAME = "llmq.batch.run"
LEASE_TTL = 10.0


@app.task(name=TASK_NAME, bind=True, acks_late=True, reject_on_worker_lost=True)
def run_batch(self, batch_id: str) -> dict:
    return asyncio.run(BatchRun(batch_id, self).run())


def dispatch(batch_id: str) -> None:
    """Queue the task that runs a batch (from the API, or a worker re-dispatching)."""
    app.send_task(TASK_NAME, args=[batch_id], queue=BATCH_QUEUE)


class BatchRun:
    def __init__(self, batch_id: str, task=None):
        self.batch_id = batch_id
        self.task = task
        self.settings = get_settings()
        self.owner = f"{getattr(getattr(task, 'request', None), 'id', None) or 'local'}:{uuid.uuid4().hex[:8]}"
        self.total = 0
        self.expires_at: float | None = None
        self._last_progress = 0.0

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
        self.total = len(lines)
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

    async def _lines(self, batch: dict, quiet: bool = False) -> list[tuple[int, str]] | None:
        """The input file's non-empty lines; None (and, unless ``quiet``, the batch failed)
        when it is not JSONL."""
        content = await self.store.file_content(batch["input_file_id"])
        errors = []
        if content is None:
            errors.append(
                {
                    "code": "file_not_found",
                    "message": "the input file no longer exists",
                    "line": None,
                }
            )
            lines = []
        else:
            text = content.decode("utf-8-sig", errors="replace")  # a BOM is no part of line 1
            lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
            if not lines:
                errors.append(
                    {"code": "empty_file", "message": "the input file has no lines", "line": None}
                )
            parsed = 0
            seen: dict[str, int] = {}
            for n, line in lines:
                try:
                    obj = json.loads(line)
                except ValueError:
                    continue
                parsed += 1
                cid = obj.get("custom_id") if isinstance(obj, dict) else None
                if isinstance(cid, str):
                    if cid in seen:
                        errors.append(
                            {
                                "code": "duplicate_custom_id",
                                "message": f"custom_id {cid!r} appears on lines {seen[cid]} and {n}",
                                "line": n,
                            }
                        )
                    seen[cid] = n
            if lines and parsed == 0:
                errors.append(
                    {
                        "code": "invalid_json_line",
                        "message": "the input file is not JSONL: no line is a JSON object",
                        "line": lines[0][0],
                    }
                )
        if errors:
            if not quiet:
                await self.store.update_batch(
                    self.batch_id, errors={"object": "list", "data": errors[:100]}
                )
                await self._finalize("failed", ("validating",))
            return None
        return lines

    async def _run_lines(self, batch: dict, lines: list[tuple[int, str]]) -> None:
        import httpx

        from llmq.api.app import create_app

        api = create_app(self.settings)
        done = await self.store.done_lines(self.batch_id)
        todo = [(n, line) for n, line in lines if n not in done]
        log.info("batch %s: %d lines, %d to run", self.batch_id, len(lines), len(todo))
        limit = asyncio.Semaphore(self.settings.batch_concurrency)
        async with api.router.lifespan_context(api):
            transport = httpx.ASGITransport(app=api)
            # The lines run as the batch's owner: the key that created the batch is the API's.
            key = self.settings.api_key
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            async with httpx.AsyncClient(
                transport=transport, base_url="http://llmq-batch", timeout=None, headers=headers
            ) as http:
                cancelled = asyncio.Event()
                lines_over = asyncio.Event()
                watcher = asyncio.create_task(self._watch_cancel(cancelled, lines_over))
                tasks = [
                    asyncio.create_task(
                        self._line(http, batch["endpoint"], n, line, limit, cancelled)
                    )
                    for n, line in todo
                ]
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

    async def _line(self, http, endpoint: str, n: int, line: str, limit, cancelled) -> None:
        async with limit:
            if cancelled.is_set():
                return
            custom_id = None
            try:
                obj = json.loads(line)
                if not isinstance(obj, dict):
                    raise ValueError("the line is not a JSON object")
                custom_id = obj.get("custom_id")
                if not isinstance(custom_id, str):
                    raise ValueError("custom_id must be a string")
                url = obj.get("url")
                if url != endpoint:
                    raise ValueError(f"url must be {endpoint!r}, the batch's endpoint; got {url!r}")
                if str(obj.get("method", "POST")).upper() != "POST":
                    raise ValueError("method must be POST")
                body = obj.get("body")
                if not isinstance(body, dict):
                    raise ValueError("body must be a JSON object")
            except ValueError as exc:
                await self._record_error(
                    n, custom_id, InvalidRequest(f"line {n}: {exc}", code="invalid_line")
                )
                return
            body = {**body, "stream": False}
            token = submit_context.set(SubmitContext(PRIORITY_BATCH, f"{self.batch_id}-{n}"))
            try:
                response = await http.post(endpoint, json=body)
            except Exception as exc:  # every line ends in one file or the other
                if isinstance(exc, UnicodeEncodeError):
                    error = InvalidRequest(
                        f"line {n}: the body is not valid Unicode text", code="invalid_line"
                    )
                else:
                    log.exception("batch %s: line %d failed", self.batch_id, n)
                    error = LLMQError(f"line {n}: internal error: {exc}")
                await self._record_error(n, custom_id, error)
                return
            finally:
                submit_context.reset(token)
            try:
                payload = response.json()
            except ValueError:
                payload = {
                    "error": {
                        "message": response.text[:500],
                        "type": "server_error",
                        "param": None,
                        "code": None,
                    }
                }
            await self._record(
                n, custom_id, response.status_code, payload, ok=response.status_code == 200
            )

    async def _record_error(self, n: int, custom_id: str | None, error: LLMQError) -> None:
        await self._record(n, custom_id, error.status, error.to_dict(), ok=False)

    async def _record(
        self, n: int, custom_id: str | None, status: int, body: dict, ok: bool
    ) -> None:
        out = {
            "id": f"batch_req_{uuid.uuid4().hex}",
            "custom_id": custom_id,
            "response": {"status_code": status, "request_id": f"{self.batch_id}-{n}", "body": body},
            "error": None,
        }
        await self.store.record_line(self.batch_id, n, out, ok)

    def _unrun(self, line: str, final: str) -> dict:
        """The error-file row of a line that never ran: no response, OpenAI's error code."""
        why = "cancelled" if final == "cancelled" else "past its completion window"
        return {
            "id": f"batch_req_{uuid.uuid4().hex}",
            "custom_id": _custom_id(line),
            "response": None,
            "error": {
                "code": f"batch_{final}",
                "message": f"the batch was {why} before this request ran",
            },
        }

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
        self, final: str, allowed_from: tuple[str, ...], lines: list[tuple[int, str]] = ()
    ) -> None:
        store = self.store
        if final != "failed":
            moved = await store.transition(self.batch_id, "finalizing", ("in_progress",))
            # A cancel that landed after the last line: end the batch cancelled (with every
            # line), not stuck in "cancelling" until a re-dispatched task finalizes it again.
            if (
                moved is None
                and final == "completed"
                and await store.status(self.batch_id) == "cancelling"
            ):
                final, allowed_from = "cancelled", ("cancelling",)
            results = await store.results(self.batch_id)
            ok = [
                results[n] for n in sorted(results) if results[n]["response"]["status_code"] == 200
            ]
            bad = [
                results[n] for n in sorted(results) if results[n]["response"]["status_code"] != 200
            ]
            if final in ("cancelled", "expired"):  # as OpenAI: every custom_id in one file
                bad += [self._unrun(line, final) for n, line in lines if n not in results]
            fields = {}
            if ok:
                f = await store.create_file(
                    f"{self.batch_id}_output.jsonl", "batch_output", _jsonl(ok)
                )
                fields["output_file_id"] = f["id"]
            if bad:
                f = await store.create_file(
                    f"{self.batch_id}_error.jsonl", "batch_output", _jsonl(bad)
                )
                fields["error_file_id"] = f["id"]
            if fields:
                await store.update_batch(self.batch_id, **fields)
            allowed_from = (*allowed_from, "finalizing")
        await store.transition(self.batch_id, final, allowed_from)
        await self._progress(force=True)
        log.info("batch %s %s", self.batch_id, final)


def _custom_id(line: str) -> str | None:
    with contextlib.suppress(ValueError, AttributeError):
        cid = json.loads(line).get("custom_id")
        return cid if isinstance(cid, str) else None
    return None


def _jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows).encode()


async def redispatch_orphans(store: Store, queued_grace: float = 60.0) -> list[str]:
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
            await asyncio.to_thread(dispatch, batch_id)
            sent.append(batch_id)
    return sent


def supervise(stop: threading.Event, interval: float = 5.0) -> None:
    """Worker thread: re-dispatch batches whose task died with its worker."""

    async def loop() -> None:
        settings = get_settings()
        client = async_client(settings.redis_url_or_default())
        store = Store(client, Keys(settings.key_prefix))
        try:
            while not stop.is_set():
                try:
                    await redispatch_orphans(store)
                except Exception as exc:  # Redis away: try again next round
                    log.debug("batch supervisor: %s", exc)
                await asyncio.to_thread(stop.wait, interval)
        finally:
            await client.aclose()

    asyncio.run(loop())
