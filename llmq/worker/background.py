"""The Celery task that runs a background response (queue ``llmq.batch``), beside the engine.

It generates through the one generation service with request ids derived from the response
id, so a run queued again after its worker died attaches to the request its first run started
(whose tokens survive in Redis) and replays the same text. Its events go to the response's
event stream (common/storage/background_responses.py); a re-run sends only what its first run had not
(``Resumed``), with the same item ids, so a follower sees one uninterrupted stream. A lease
keeps a second run off a response while one runs; the batch supervisor's round
(batch/supervisor.py) queues again a response whose run holds no lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
import uuid
from typing import Any

from llmq.common.engine_client.model_registry import ModelRegistry
from llmq.common.errors import LLMQError
from llmq.common.serving import GenerationService, SubmitOptions
from llmq.common.serving.responses_api.request import ResponsesRequest
from llmq.common.serving.responses_api.run import ResponsesRun
from llmq.common.settings import Settings, get_settings
from llmq.common.storage.background_responses import (
    BACKGROUND_TASK,
    FINAL_EVENTS,
    FINAL_STATUSES,
    BackgroundResponses,
    is_final,
)
from llmq.common.transport import AsyncTransport
from llmq.common.transport.redis_clients import async_client, keys_for
from llmq.common.webhooks import announce
from llmq.worker.celery_app import app

log = logging.getLogger("llmq.background")
_DELTAS = ("response.output_text.delta", "response.function_call_arguments.delta")


class Resumed:
    """A re-run's events after those its first run stored: structural events (an item added
    or done, ...) already sent are dropped, a delta keeps only the text not sent yet, and the
    rest are numbered on from the last stored."""

    def __init__(self, stored: list[dict[str, Any]]):
        self.sequence = len(stored)
        self.sent = {(e["type"], e.get("output_index")) for e in stored if e["type"] not in _DELTAS}
        self.sent_text: dict[int, int] = {}  # output index -> characters of deltas sent
        for e in stored:
            if e["type"] in _DELTAS:
                index = e["output_index"]
                self.sent_text[index] = self.sent_text.get(index, 0) + len(e["delta"])
        self.made_text: dict[int, int] = {}  # the same, of this run's deltas

    def next(self, event: dict[str, Any]) -> dict[str, Any] | None:
        """The event to send for this run's ``event``, or None."""
        index = event.get("output_index")
        if event["type"] in _DELTAS:
            made = self.made_text.get(index, 0)
            self.made_text[index] = made + len(event["delta"])
            skip = self.sent_text.get(index, 0) - made
            if skip >= len(event["delta"]):
                return None
            event = {**event, "delta": event["delta"][max(skip, 0) :]}
        elif (event["type"], index) in self.sent:
            return None
        event = {**event, "sequence_number": self.sequence}
        self.sequence += 1
        return event


def item_ids(response_id: str):
    """Output item ids derived from the response id and the item's index: a re-run's equal
    its first run's."""

    def item_id(prefix: str, index: int) -> str:
        digest = hashlib.sha256(f"{response_id}:{index}".encode()).hexdigest()[:32]
        return f"{prefix}_{digest}"

    return item_id


class BackgroundRun:
    def __init__(self, response_id: str, settings: Settings | None = None):
        self.id = response_id
        self.settings = settings or get_settings()
        self.holder = uuid.uuid4().hex
        self.store: BackgroundResponses
        self.record: dict[str, Any] = {}

    async def run(self) -> dict:
        s = self.settings
        client = async_client(s.redis_url_or_default(), sentinel_master=s.redis_sentinel_master)
        waiter = async_client(s.redis_url_or_default(), sentinel_master=s.redis_sentinel_master)
        keys = keys_for(s)
        self.store = BackgroundResponses(client, keys, s.background_retention)
        transport = AsyncTransport(client, keys)
        try:
            if not await self.store.take_lease(self.id, self.holder, s.batch_lease_ttl):
                return {"response": self.id, "skipped": "running elsewhere"}
            record = await self.store.load(self.id)
            if record is None or is_final(record):
                return {"response": self.id, "skipped": "finished"}
            self.record = record
            service = GenerationService(ModelRegistry(transport, s))
            waits = BackgroundResponses(waiter, keys, s.background_retention)
            status = await self._leased(self._generate(service), waits.wait_cancel(self.id))
            if status in FINAL_STATUSES:
                await asyncio.to_thread(announce, s, f"response.{status}", self.id)
            return {"response": self.id, "status": status}
        finally:
            await self.store.release_lease(self.id, self.holder)
            await transport.settle()
            await transport.close()
            await waiter.aclose()
            await client.aclose()

    async def _leased(self, generating, cancelled) -> str:
        """Generate until done, cancelled, past the deadline or the lease lost."""
        started = self.record["response"]["created_at"]
        timeout = started + self.settings.background_timeout - time.time()
        if timeout <= 0:  # past it already (queued that long): nothing is submitted
            generating.close()
            cancelled.close()
            return await self._past_deadline()
        tasks = [asyncio.ensure_future(c) for c in (generating, cancelled, self._keep_lease())]
        done, pending = await asyncio.wait(
            tasks, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
        )
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        if tasks[0] in done:
            status = tasks[0].result()
            await self.store.r.srem(self.store.active_key(), self.id)
            return status
        if tasks[1] in done:
            return "cancelled"
        if tasks[2] in done:
            return "lease lost"
        return await self._past_deadline()

    async def _past_deadline(self) -> str:
        limit = self.settings.background_timeout
        await self._fail(f"the response ran past LLMQ_BACKGROUND_TIMEOUT ({limit} s)")
        return "failed"

    async def _keep_lease(self) -> None:
        ttl = self.settings.batch_lease_ttl
        while True:
            await asyncio.sleep(ttl / 3)
            with contextlib.suppress(Exception):  # Redis away: the lease may lapse meanwhile
                if not await self.store.renew_lease(self.id, self.holder, ttl):
                    log.warning("background response %s: lease lost; stopping", self.id)
                    return

    async def _generate(self, service: GenerationService) -> str:
        body = ResponsesRequest.model_validate({**self.record["body"], "stream": True})
        options = SubmitOptions(request_id_prefix=self.id)
        try:
            run = await service.responses(body, self.record["history"], options)
        except LLMQError as exc:
            await self._fail(exc.message, exc.code or exc.type)
            return "failed"
        try:
            return await self._events(run)
        finally:
            await run.aclose()

    async def _events(self, run: ResponsesRun) -> str:
        stored = self.record["response"]
        run.response.id, run.response.created_at = stored["id"], stored["created_at"]
        run.response.echo["background"] = True
        resumed = Resumed(await self.store.appended(self.id))
        run.response.status = "queued"  # as the created event shows it, as OpenAI's does
        async for event in run.events(item_ids(self.id)):
            run.response.status = (
                "in_progress" if run.response.status == "queued" else run.response.status
            )
            saved = True
            if event["type"] == "response.in_progress":
                saved = await self._save(run.response.model_dump())
            if event["type"] in FINAL_EVENTS:
                # Stored before its final event goes out: a follower who reads it finds it.
                saved = await self._save(run.response.model_dump(), run.items)
            if not saved:  # cancelled meanwhile: its stream ends as it is
                return "cancelled"
            sent = resumed.next(event)
            if sent is not None:
                await self.store.append(self.id, sent)
        return run.response.status

    async def _save(self, response: dict[str, Any], items: list | None = None) -> bool:
        """False if the stored response is final already (cancelled)."""
        record = {**self.record, "response": response}
        if items is not None:
            record["input"] = items
        return await self.store.save(record, self.settings.file_retention)

    async def _fail(self, message: str, code: str = "server_error") -> None:
        """End the response failed, with a final event for its followers."""
        response = {**self.record["response"], "status": "failed"}
        response["error"] = {"code": code, "message": message}
        if await self.store.save(
            {**self.record, "response": response}, self.settings.file_retention
        ):
            sequence = len(await self.store.appended(self.id))
            event = {"type": "response.failed", "sequence_number": sequence, "response": response}
            await self.store.append(self.id, event)


@app.task(name=BACKGROUND_TASK, acks_late=True, reject_on_worker_lost=True)
def run_background(response_id: str) -> dict:
    return asyncio.run(BackgroundRun(response_id).run())
