"""Batches of the OpenAI Batch API in Redis: a hash whose fields are the batch object's (JSON
where not scalar) plus its ``owner``, kept ``window + retention`` seconds; its per-line results
are in batch_checkpoint. Status moves are atomic, and a run's moves only while it holds the
batch's lease: a run that lost its lease can never finish a batch another run is finishing."""

from __future__ import annotations

import json
import time

import redis.asyncio as aioredis

from llmq.common.ids import is_id, new_id, text
from llmq.common.tenants import ANONYMOUS
from llmq.common.transport.keys import Keys

FINAL_STATES = {"completed", "failed", "cancelled", "expired"}

# Move a batch to a new status only from one of the given ones; stamp the time field. With an
# owner (ARGV[3] not empty), only while that run holds the batch's lease (KEYS[2]). ARGV[4] is
# JSON of fields set with the move.
_TRANSITION = """
if ARGV[3] ~= '' and redis.call('GET', KEYS[2]) ~= ARGV[3] then return false end
local current = redis.call('HGET', KEYS[1], 'status')
if not current then return false end
for i = 5, #ARGV do
  if current == ARGV[i] then
    redis.call('HSET', KEYS[1], 'status', ARGV[1], ARGV[1] .. '_at', ARGV[2])
    for k, v in pairs(cjson.decode(ARGV[4])) do redis.call('HSET', KEYS[1], k, v) end
    return current
  end
end
return false
"""

_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

_JSON_FIELDS = {"errors", "metadata"}


class Batches:
    r: aioredis.Redis
    keys: Keys
    retention: int

    def _init_batches(self) -> None:
        self._transition = self.r.register_script(_TRANSITION)
        self._renew = self.r.register_script(_RENEW)
        self._release = self.r.register_script(_RELEASE)

    async def keep_file(self, file_id: str, seconds: int) -> None:
        raise NotImplementedError  # Files's: a Store is both

    async def create_batch(
        self,
        input_file_id: str,
        endpoint: str,
        completion_window: str,
        metadata: dict | None,
        owner: str = ANONYMOUS,
    ) -> dict:
        batch_id = new_id("batch")
        now = int(time.time())
        window = _window_seconds(completion_window)
        fields = {
            "id": batch_id,
            "endpoint": endpoint,
            "input_file_id": input_file_id,
            "completion_window": completion_window,
            "status": "validating",
            "created_at": now,
            "expires_at": now + window,
            "total": 0,
            "completed": 0,
            "failed": 0,
            "metadata": json.dumps(metadata) if metadata is not None else "null",
            "errors": "null",
            "owner": owner,
        }
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(self.keys.batch(batch_id), mapping={k: str(v) for k, v in fields.items()})
        pipe.expire(self.keys.batch(batch_id), window + self.retention)
        pipe.zadd(self.keys.tenant_batches(owner), {batch_id: time.time()})
        pipe.sadd(self.keys.batches_active, batch_id)
        await pipe.execute()
        # Its input outlives its window (finalizing reads it again).
        await self.keep_file(input_file_id, window + 3600)
        return await self.get_batch(batch_id)

    async def get_batch(self, batch_id: str, owner: str | None = None) -> dict | None:
        """The batch, if there is one (and ``owner``'s, unless None: the worker's reads)."""
        if not is_id("batch", batch_id):
            return None
        raw = await self.r.hgetall(self.keys.batch(batch_id))
        if not raw:
            return None
        fields = {text(k): text(v) for k, v in raw.items()}
        if owner is not None and fields.get("owner", ANONYMOUS) != owner:
            return None
        return _batch_object(fields)

    async def batch_owner(self, batch_id: str) -> str:
        """Who owns the batch: its output and error files are theirs."""
        raw = await self.r.hget(self.keys.batch(batch_id), "owner")
        return text(raw) if raw is not None else ANONYMOUS

    async def list_batches(
        self, after: str | None, limit: int, owner: str = ANONYMOUS
    ) -> tuple[list[dict], bool]:
        """A page of ``owner``'s batches after the id ``after``, newest first; batches past
        their retention leave the index as a page meets them."""
        index = self.keys.tenant_batches(owner)
        start = 0
        if after is not None:
            rank = await self.r.zrevrank(index, after)
            if rank is None:
                return [], False
            start = rank + 1
        ids = [text(i) for i in await self.r.zrevrange(index, start, start + limit)]
        found = [(i, await self.get_batch(i)) for i in ids[:limit]]
        if gone := [i for i, b in found if b is None]:
            await self.r.zrem(index, *gone)
        return [b for _, b in found if b], len(ids) > limit

    async def update_batch(self, batch_id: str, **fields) -> None:
        mapping = {k: json.dumps(v) if k in _JSON_FIELDS else str(v) for k, v in fields.items()}
        await self.r.hset(self.keys.batch(batch_id), mapping=mapping)

    async def transition(
        self,
        batch_id: str,
        to: str,
        allowed_from: tuple[str, ...],
        lease_owner: str = "",
        fields: dict[str, str] | None = None,
    ) -> str | None:
        """Set the status (and ``fields``) if it is one of ``allowed_from`` and, with
        ``lease_owner``, that run holds the lease; returns the previous status or None."""
        keys = [self.keys.batch(batch_id), self.keys.batch_lease(batch_id)]
        args = [to, int(time.time()), lease_owner, json.dumps(fields or {}), *allowed_from]
        prev = await self._transition(keys=keys, args=args)
        if prev and to in FINAL_STATES:
            await self.r.srem(self.keys.batches_active, batch_id)
        return text(prev) if prev else None

    async def status(self, batch_id: str) -> str | None:
        raw = await self.r.hget(self.keys.batch(batch_id), "status")
        return text(raw) if raw is not None else None

    async def active_batches(self) -> list[str]:
        return [text(b) for b in await self.r.smembers(self.keys.batches_active)]

    # ---- leases: one running copy of a batch task at a time --------------------------
    async def acquire_lease(self, batch_id: str, owner: str, ttl: float) -> bool:
        return bool(
            await self.r.set(self.keys.batch_lease(batch_id), owner, nx=True, px=int(ttl * 1000))
        )

    async def renew_lease(self, batch_id: str, owner: str, ttl: float) -> bool:
        """False when another run holds the lease, or none does (it expired)."""
        keys = [self.keys.batch_lease(batch_id)]
        return bool(await self._renew(keys=keys, args=[owner, int(ttl * 1000)]))

    async def release_lease(self, batch_id: str, owner: str) -> None:
        await self._release(keys=[self.keys.batch_lease(batch_id)], args=[owner])

    async def lease_holder(self, batch_id: str) -> str | None:
        raw = await self.r.get(self.keys.batch_lease(batch_id))
        return text(raw) if raw is not None else None


def _window_seconds(window: str) -> int:
    if window.endswith("h") and window[:-1].isdigit():
        return int(window[:-1]) * 3600
    return 24 * 3600


def _batch_object(f: dict[str, str]) -> dict:
    def num(name: str) -> int | None:
        v = f.get(name)
        return int(v) if v not in (None, "", "None") else None

    return {
        "id": f["id"],
        "object": "batch",
        "endpoint": f["endpoint"],
        "errors": json.loads(f.get("errors") or "null"),
        "input_file_id": f["input_file_id"],
        "completion_window": f["completion_window"],
        "status": f["status"],
        "output_file_id": f.get("output_file_id") or None,
        "error_file_id": f.get("error_file_id") or None,
        "created_at": num("created_at"),
        "in_progress_at": num("in_progress_at"),
        "expires_at": num("expires_at"),
        "finalizing_at": num("finalizing_at"),
        "completed_at": num("completed_at"),
        "failed_at": num("failed_at"),
        "expired_at": num("expired_at"),
        "cancelling_at": num("cancelling_at"),
        "cancelled_at": num("cancelled_at"),
        "request_counts": {
            "total": num("total") or 0,
            "completed": num("completed") or 0,
            "failed": num("failed") or 0,
        },
        "metadata": json.loads(f.get("metadata") or "null"),
    }
