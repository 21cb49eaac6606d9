"""Background responses of the Responses API (``background: true``): what any API replica and
the worker running one share in Redis.

A background response is run by a Celery task on a worker (queue ``llmq.batch``), never by the
API process that took it: the process that created it may go away, and any replica answers its
polls and streams. Beside the stored response (responses_store.py) it has:

- its events, a Redis stream whose entry ids are ``0-{sequence_number + 1}``: an event is
  appended once (Redis refuses an id not above the last), and a follower reads those after
  ``starting_after`` from any replica, none missed and none twice;
- a cancel list, which the running task waits on (BLPOP) beside its generation;
- a lease, held by the task that runs it, so that one task runs it at a time.

The stored record changes only while its status is not final (one Lua script): a cancel that
lands first is never overwritten by the run it stopped.
"""

from __future__ import annotations

import json
import threading
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import redis.asyncio as aioredis

from llmq.common.settings import Settings
from llmq.common.transport.celery_client import BATCH_QUEUE, make_celery
from llmq.common.transport.keys import Keys

if TYPE_CHECKING:
    from celery import Celery

BACKGROUND_TASK = "llmq.responses.background"
FINAL_STATUSES = ("completed", "incomplete", "failed", "cancelled")
FINAL_EVENTS = ("response.completed", "response.incomplete", "response.failed")

# Sets KEYS[1] to ARGV[1] (TTL ARGV[2]) unless the record there has a final status, or there
# is none and ARGV[3] is not '1' (a deleted response stays deleted): 1 if set.
_SAVE_UNLESS_FINAL = """
local current = redis.call('GET', KEYS[1])
if not current and ARGV[3] ~= '1' then
  return 0
end
if current then
  local status = cjson.decode(current)['response']['status']
  if status == 'completed' or status == 'incomplete' or status == 'failed'
     or status == 'cancelled' then
    return 0
  end
end
redis.call('SET', KEYS[1], ARGV[1], 'EX', tonumber(ARGV[2]))
return 1
"""


def is_final(record: dict[str, Any]) -> bool:
    return record["response"]["status"] in FINAL_STATUSES


class BackgroundResponses:
    """The Redis side of background responses; ``retention``: seconds their events stay."""

    def __init__(self, client: aioredis.Redis, keys: Keys, retention: int):
        self.r = client
        self.keys = keys
        self.retention = retention
        self._save = client.register_script(_SAVE_UNLESS_FINAL)

    def active_key(self) -> str:
        """The set of background responses not finished (the supervisor's round)."""
        return self.keys.response("background")

    async def create(self, record: dict[str, Any], ttl: int) -> None:
        """Store a new background response (queued) and count it as running."""
        await self.save(record, ttl, create=True)
        await self.r.sadd(self.active_key(), record["response"]["id"])

    def events_key(self, response_id: str) -> str:
        return self.keys.response(response_id) + ":events"

    def cancel_key(self, response_id: str) -> str:
        return self.keys.response(response_id) + ":cancel"

    def lease_key(self, response_id: str) -> str:
        return self.keys.response(response_id) + ":lease"

    async def load(self, response_id: str) -> dict[str, Any] | None:
        """The whole record, owner and request included (the worker's view)."""
        raw = await self.r.get(self.keys.response(response_id))
        return None if raw is None else json.loads(raw)

    async def save(self, record: dict[str, Any], ttl: int, create: bool = False) -> bool:
        """Store ``record`` (with its owner) unless the stored one is final already, or
        (unless ``create``) gone."""
        key = self.keys.response(record["response"]["id"])
        flag = "1" if create else "0"
        return bool(await self._save(keys=[key], args=[json.dumps(record), ttl, flag]))

    async def append(self, response_id: str, event: dict[str, Any]) -> bool:
        """Add one event under its sequence number; False if it is there already."""
        key = self.events_key(response_id)
        entry = f"0-{event['sequence_number'] + 1}"
        try:
            await self.r.xadd(key, {"e": json.dumps(event)}, id=entry)
        except aioredis.ResponseError:  # an id not above the last: appended before
            return False
        await self.r.expire(key, self.retention)
        return True

    async def appended(self, response_id: str) -> list[dict[str, Any]]:
        """Every event stored so far, in order."""
        entries = await self.r.xrange(self.events_key(response_id))
        return [json.loads(fields[b"e"]) for _, fields in entries]

    async def follow(
        self, response_id: str, after: int = -1, block_ms: int = 1000
    ) -> AsyncIterator[dict[str, Any]]:
        """The events after sequence number ``after`` as they come, to the final one (or, for
        a response cancelled or stopped with none, once its record is final)."""
        last = f"0-{after + 1}"
        key = self.events_key(response_id)
        while True:
            found = await self.r.xread({key: last}, count=256, block=block_ms)
            entries = found[0][1] if found else []
            for entry_id, fields in entries:
                last = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                event = json.loads(fields[b"e"])
                yield event
                if event["type"] in FINAL_EVENTS:
                    return
            if not entries and await self._ended(response_id, last):
                return

    async def _ended(self, response_id: str, last: str) -> bool:
        """Gone, or cancelled with no event after ``last`` (any other end has its final
        event, stored just after the record)."""
        record = await self.load(response_id)
        if record is not None and record["response"]["status"] != "cancelled":
            return False
        return not await self.r.xrange(self.events_key(response_id), min=f"({last}", count=1)

    async def cancel(self, response_id: str) -> None:
        """Tell the task running it to stop (it waits on this list)."""
        key = self.cancel_key(response_id)
        await self.r.rpush(key, "1")
        await self.r.expire(key, self.retention)

    async def wait_cancel(self, response_id: str) -> None:
        """Returns once the response is cancelled (on a connection of its own: BLPOP
        blocks it)."""
        key = self.cancel_key(response_id)
        while not await self.r.blpop([key], timeout=5):
            pass

    async def take_lease(self, response_id: str, holder: str, ttl: float) -> bool:
        key = self.lease_key(response_id)
        taken = await self.r.set(key, holder, nx=True, px=int(ttl * 1000))
        return bool(taken) or (await self.r.get(key)) == holder.encode()

    async def renew_lease(self, response_id: str, holder: str, ttl: float) -> bool:
        key = self.lease_key(response_id)
        if (await self.r.get(key)) != holder.encode():
            return False
        return bool(await self.r.pexpire(key, int(ttl * 1000)))

    async def release_lease(self, response_id: str, holder: str) -> None:
        key = self.lease_key(response_id)
        if (await self.r.get(key)) == holder.encode():
            await self.r.delete(key)


_senders: dict[tuple[str, str], Celery] = {}
_senders_lock = threading.Lock()


def dispatch_background(settings: Settings, response_id: str) -> None:
    """Queue the task that runs a background response, by name (blocking: call it from a
    thread)."""
    key = (settings.redis_url_or_default(), settings.key_prefix)
    with _senders_lock:
        app = _senders.get(key)
        if app is None:
            app = _senders[key] = make_celery(settings)
    app.send_task(BACKGROUND_TASK, args=[response_id], queue=BATCH_QUEUE)
