"""Files and batches of the OpenAI Batch API, kept in Redis (key names from transport.Keys).

A file is a hash (its OpenAI object) plus its content as a string. A batch is a hash whose
fields are the batch object's (JSON where not scalar); its results are a hash of line number ->
output line, written once per line (HSETNX), which is the checkpoint a re-run continues from.

Each file and batch has an ``owner`` field (see common/tenants.py), kept out of the objects
clients see; reads given an owner answer None for another tenant's object, exactly as for a
missing one. Each tenant's files and batches are indexed apart, and its files' bytes counted
against its quota.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
import uuid
from typing import Any

import redis.asyncio as aioredis

from llmq.common.errors import QuotaExceeded
from llmq.common.tenants import ANONYMOUS
from llmq.common.transport.keys import RELEASE_FILE_SCRIPT, RESERVE_BYTES_SCRIPT, Keys

FINAL_STATES = {"completed", "failed", "cancelled", "expired"}
BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")

# Record one line's result exactly once and count it.
_RECORD_LINE = """
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 1 then
  redis.call('HINCRBY', KEYS[2], ARGV[3], 1)
  return 1
end
return 0
"""

# Move a batch to a new status only from one of the given ones; stamp the time field.
_TRANSITION = """
local current = redis.call('HGET', KEYS[1], 'status')
if not current then return false end
for i = 3, #ARGV do
  if current == ARGV[i] then
    redis.call('HSET', KEYS[1], 'status', ARGV[1], ARGV[1] .. '_at', ARGV[2])
    return current
  end
end
return false
"""

_JSON_FIELDS = {"errors", "metadata"}
_INT_FIELDS = {
    "created_at",
    "in_progress_at",
    "expires_at",
    "finalizing_at",
    "completed_at",
    "failed_at",
    "expired_at",
    "cancelling_at",
    "cancelled_at",
    "total",
    "completed",
    "failed",
}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


_ID = re.compile(r"(file|batch)-[0-9a-f]{32}")


def is_id(prefix: str, value: str) -> bool:
    """Whether ``value`` has the form ``new_id(prefix)`` gives: ids from URL paths are checked
    before any key is built from them (``x:content`` named another object's key)."""
    match = _ID.fullmatch(value)
    return match is not None and match.group(1) == prefix


def _str(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class Store:
    def __init__(self, client: aioredis.Redis, keys: Keys):
        self.r = client
        self.keys = keys
        self._record_line = client.register_script(_RECORD_LINE)
        self._transition = client.register_script(_TRANSITION)
        self._reserve_bytes = client.register_script(RESERVE_BYTES_SCRIPT)
        self._release_file = client.register_script(RELEASE_FILE_SCRIPT)

    # ---- files -------------------------------------------------------------------------
    async def create_file(
        self, filename: str, purpose: str, content: bytes, owner: str = ANONYMOUS, quota: int = 0
    ) -> dict:
        """Store a file of ``owner``'s, its bytes counted against ``quota`` (0: counted, never
        refused): QuotaExceeded if they would pass it."""
        await self._reserve(owner, len(content), quota)
        file_id = new_id("file")
        obj = {
            "id": file_id,
            "object": "file",
            "bytes": len(content),
            "created_at": int(time.time()),
            "filename": filename,
            "purpose": purpose,
            "status": "processed",
        }
        pipe = self.r.pipeline(transaction=True)
        fields = {k: str(v) for k, v in obj.items()}
        pipe.hset(self.keys.file(file_id), mapping={**fields, "owner": owner})
        pipe.set(self.keys.file_content(file_id), content)
        pipe.zadd(self.keys.tenant_files(owner), {file_id: time.time()})
        try:
            await pipe.execute()
        except Exception:
            with contextlib.suppress(Exception):  # not stored: give the bytes back
                await self.r.decrby(self.keys.tenant_bytes(owner), len(content))
            raise
        return obj

    async def _reserve(self, owner: str, size: int, quota: int) -> None:
        ok, held = await self._reserve_bytes(
            keys=[self.keys.tenant_bytes(owner)], args=[size, quota]
        )
        if not ok:
            raise QuotaExceeded(
                f"the file ({size} bytes) would pass this API key's storage quota of {quota} "
                f"bytes ({held} in use): delete files to make room"
            )

    async def get_file(self, file_id: str, owner: str | None = None) -> dict | None:
        """The file, if there is one (and ``owner``'s, unless None: the worker's reads)."""
        if not is_id("file", file_id):
            return None
        return _file_obj(await self.r.hgetall(self.keys.file(file_id)), owner)

    async def file_content(self, file_id: str) -> bytes | None:
        if not is_id("file", file_id):
            return None
        return await self.r.get(self.keys.file_content(file_id))

    async def list_files(
        self,
        purpose: str | None = None,
        after: str | None = None,
        limit: int = 10000,
        newest_first: bool = True,
        owner: str = ANONYMOUS,
    ) -> tuple[list[dict], bool]:
        """A page of ``owner``'s files after the id ``after`` (of ``purpose``, if given), and
        whether more follow. Reads the owner's index a chunk at a time, each chunk's files in
        one round trip."""
        index = self.keys.tenant_files(owner)
        start = 0
        if after is not None:
            rank = await (self.r.zrevrank if newest_first else self.r.zrank)(index, after)
            if rank is None:
                return [], False
            start = rank + 1
        read = self.r.zrevrange if newest_first else self.r.zrange
        chunk = min(max(limit + 1, 100), 1000)
        page: list[dict] = []
        while len(page) <= limit:
            ids = [_str(i) for i in await read(index, start, start + chunk - 1)]
            if not ids:
                break
            start += len(ids)
            pipe = self.r.pipeline(transaction=False)
            for i in ids:
                pipe.hgetall(self.keys.file(i))
            for raw in await pipe.execute():
                f = _file_obj(raw, owner)
                if f is not None and (purpose is None or f["purpose"] == purpose):
                    page.append(f)
        return page[:limit], len(page) > limit

    async def delete_file(self, file_id: str, owner: str = ANONYMOUS) -> bool:
        """Delete ``owner``'s file and give its bytes back; False if there is no such file of
        ``owner``'s."""
        if not is_id("file", file_id):
            return False
        k = self.keys
        keys = [
            k.file(file_id),
            k.tenant_files(owner),
            k.tenant_bytes(owner),
            k.file_content(file_id),
        ]
        return bool(await self._release_file(keys=keys, args=[file_id, owner, ANONYMOUS]))

    # ---- batches -----------------------------------------------------------------------
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
        fields = {
            "id": batch_id,
            "endpoint": endpoint,
            "input_file_id": input_file_id,
            "completion_window": completion_window,
            "status": "validating",
            "created_at": now,
            "expires_at": now + _window_seconds(completion_window),
            "total": 0,
            "completed": 0,
            "failed": 0,
            "metadata": json.dumps(metadata) if metadata is not None else "null",
            "errors": "null",
            "owner": owner,
        }
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(self.keys.batch(batch_id), mapping={k: str(v) for k, v in fields.items()})
        pipe.zadd(self.keys.tenant_batches(owner), {batch_id: time.time()})
        pipe.sadd(self.keys.batches_active, batch_id)
        await pipe.execute()
        return await self.get_batch(batch_id)

    async def get_batch(self, batch_id: str, owner: str | None = None) -> dict | None:
        """The batch, if there is one (and ``owner``'s, unless None: the worker's reads)."""
        if not is_id("batch", batch_id):
            return None
        raw = await self.r.hgetall(self.keys.batch(batch_id))
        if not raw:
            return None
        fields = {_str(k): _str(v) for k, v in raw.items()}
        if owner is not None and fields.get("owner", ANONYMOUS) != owner:
            return None
        return _batch_object(fields)

    async def batch_owner(self, batch_id: str) -> str:
        """Who owns the batch: its output and error files are theirs."""
        raw = await self.r.hget(self.keys.batch(batch_id), "owner")
        return _str(raw) if raw is not None else ANONYMOUS

    async def list_batches(
        self, after: str | None, limit: int, owner: str = ANONYMOUS
    ) -> tuple[list[dict], bool]:
        """A page of ``owner``'s batches after the id ``after``, newest first."""
        index = self.keys.tenant_batches(owner)
        start = 0
        if after is not None:
            rank = await self.r.zrevrank(index, after)
            if rank is None:
                return [], False
            start = rank + 1
        ids = [_str(i) for i in await self.r.zrevrange(index, start, start + limit)]
        batches = [b for b in [await self.get_batch(i) for i in ids[:limit]] if b]
        return batches, len(ids) > limit

    async def update_batch(self, batch_id: str, **fields) -> None:
        mapping = {k: json.dumps(v) if k in _JSON_FIELDS else str(v) for k, v in fields.items()}
        await self.r.hset(self.keys.batch(batch_id), mapping=mapping)

    async def transition(self, batch_id: str, to: str, allowed_from: tuple[str, ...]) -> str | None:
        """Set the status if it is one of ``allowed_from``; returns the previous one or None."""
        prev = await self._transition(
            keys=[self.keys.batch(batch_id)], args=[to, int(time.time()), *allowed_from]
        )
        if prev and to in FINAL_STATES:
            await self.r.srem(self.keys.batches_active, batch_id)
        return _str(prev) if prev else None

    async def status(self, batch_id: str) -> str | None:
        raw = await self.r.hget(self.keys.batch(batch_id), "status")
        return _str(raw) if raw is not None else None

    async def record_line(self, batch_id: str, line: int, output: dict, ok: bool) -> bool:
        """Checkpoint one line's result; False if it was already recorded."""
        done = await self._record_line(
            keys=[self.keys.batch_results(batch_id), self.keys.batch(batch_id)],
            args=[line, json.dumps(output, separators=(",", ":")), "completed" if ok else "failed"],
        )
        return bool(done)

    async def results(self, batch_id: str) -> dict[int, dict]:
        raw = await self.r.hgetall(self.keys.batch_results(batch_id))
        return {int(_str(k)): json.loads(v) for k, v in raw.items()}

    async def done_lines(self, batch_id: str) -> set[int]:
        return {int(_str(k)) for k in await self.r.hkeys(self.keys.batch_results(batch_id))}

    async def active_batches(self) -> list[str]:
        return [_str(b) for b in await self.r.smembers(self.keys.batches_active)]

    # ---- leases: one running copy of a batch task at a time --------------------------
    async def acquire_lease(self, batch_id: str, owner: str, ttl: float) -> bool:
        return bool(
            await self.r.set(self.keys.batch_lease(batch_id), owner, nx=True, px=int(ttl * 1000))
        )

    async def renew_lease(self, batch_id: str, owner: str, ttl: float) -> bool:
        renewed = await self.r.eval(
            "if redis.call('GET', KEYS[1]) == ARGV[1] then "
            "return redis.call('PEXPIRE', KEYS[1], ARGV[2]) else return 0 end",
            1,
            self.keys.batch_lease(batch_id),
            owner,
            int(ttl * 1000),
        )
        return bool(renewed)

    async def release_lease(self, batch_id: str, owner: str) -> None:
        await self.r.eval(
            "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0",
            1,
            self.keys.batch_lease(batch_id),
            owner,
        )

    async def lease_holder(self, batch_id: str) -> str | None:
        raw = await self.r.get(self.keys.batch_lease(batch_id))
        return _str(raw) if raw is not None else None


def _file_obj(raw: dict, owner: str | None = None) -> dict | None:
    """The file object clients see (no owner field); None if absent or not ``owner``'s."""
    if not raw:
        return None
    obj: dict[str, Any] = {_str(k): _str(v) for k, v in raw.items()}
    file_owner = obj.pop("owner", ANONYMOUS)
    if owner is not None and file_owner != owner:
        return None
    obj["bytes"] = int(obj["bytes"])
    obj["created_at"] = int(obj["created_at"])
    return obj


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
