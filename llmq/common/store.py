"""Files and batches of the OpenAI Batch API, kept in Redis (key names from transport.Keys).

A file is a hash (its OpenAI object) plus its content as a list of pieces (file_chunks), both
with the retention TTL. A batch is a hash whose fields are the batch object's (JSON where not
scalar), with a TTL of its window plus the retention; its per-line results are in
batch_checkpoint.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import redis.asyncio as aioredis

from llmq.common.file_chunks import ChunkWriter, read_chunks
from llmq.common.transport.keys import Keys

FINAL_STATES = {"completed", "failed", "cancelled", "expired"}
BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")

# Move a batch to a new status only from one of the given ones; stamp the time field. With an
# owner (ARGV[3] not empty), only while that run holds the batch's lease (KEYS[2]): a run that
# lost it never moves the batch. ARGV[4] is JSON of fields set with the move.
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

# Extend the TTL of the keys that have one to at least ARGV[1] seconds.
_KEEP = """
for _, key in ipairs(KEYS) do
  local ttl = redis.call('TTL', key)
  if ttl >= 0 and ttl < tonumber(ARGV[1]) then redis.call('EXPIRE', key, ARGV[1]) end
end
return 0
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


DEFAULT_RETENTION = 30 * 24 * 3600


class Store:
    def __init__(self, client: aioredis.Redis, keys: Keys, retention: int = DEFAULT_RETENTION):
        self.r = client
        self.keys = keys
        self.retention = retention  # seconds files and finished batches are kept
        self._transition = client.register_script(_TRANSITION)
        self._keep = client.register_script(_KEEP)

    # ---- files -------------------------------------------------------------------------
    def file_writer(self) -> tuple[str, ChunkWriter]:
        """A new file's id and the writer of its content; ``commit_file`` makes it a file."""
        file_id = new_id("file")
        return file_id, ChunkWriter(self.r, self.keys.file_content(file_id), self.retention)

    async def commit_file(self, file_id: str, filename: str, purpose: str, size: int) -> dict:
        """The file object of content written whole with ``file_writer``."""
        obj = {
            "id": file_id,
            "object": "file",
            "bytes": size,
            "created_at": int(time.time()),
            "filename": filename,
            "purpose": purpose,
            "status": "processed",
        }
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(self.keys.file(file_id), mapping={k: str(v) for k, v in obj.items()})
        pipe.expire(self.keys.file(file_id), self.retention)
        pipe.expire(self.keys.file_content(file_id), self.retention)
        pipe.zadd(self.keys.files_index, {file_id: time.time()})
        await pipe.execute()
        return obj

    async def create_file(self, filename: str, purpose: str, content: bytes) -> dict:
        file_id, writer = self.file_writer()
        await writer.write(content)
        await writer.close()
        return await self.commit_file(file_id, filename, purpose, len(content))

    async def get_file(self, file_id: str) -> dict | None:
        if not is_id("file", file_id):
            return None
        return _file_obj(await self.r.hgetall(self.keys.file(file_id)))

    def file_chunks(self, file_id: str) -> AsyncIterator[bytes]:
        """The file's content, a piece at a time (FileGone if it goes away meanwhile)."""
        return read_chunks(self.r, self.keys.file_content(file_id))

    async def file_content(self, file_id: str) -> bytes | None:
        """The whole content (small files: tests, tools); None if there is no such file."""
        if not is_id("file", file_id) or not await self.r.exists(self.keys.file(file_id)):
            return None
        return b"".join([piece async for piece in self.file_chunks(file_id)])

    async def keep_file(self, file_id: str, seconds: int) -> None:
        """Keep the file at least ``seconds`` more (a batch's input, for its window)."""
        keys = [self.keys.file(file_id), self.keys.file_content(file_id)]
        await self._keep(keys=keys, args=[int(seconds)])

    async def list_files(
        self,
        purpose: str | None = None,
        after: str | None = None,
        limit: int = 10000,
        newest_first: bool = True,
    ) -> tuple[list[dict], bool]:
        """A page of files after the id ``after`` (of ``purpose``, if given), and whether more
        follow. Reads the index a chunk at a time, each chunk's files in one round trip."""
        index = self.keys.files_index
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
            gone = []
            for file_id, raw in zip(ids, await pipe.execute(), strict=True):
                f = _file_obj(raw)
                if f is None:
                    gone.append(file_id)  # past its retention: its index entry goes too
                elif purpose is None or f["purpose"] == purpose:
                    page.append(f)
            if gone:
                await self.r.zrem(index, *gone)
                start -= len(gone)
        return page[:limit], len(page) > limit

    async def delete_file(self, file_id: str) -> bool:
        pipe = self.r.pipeline(transaction=True)
        pipe.delete(self.keys.file(file_id), self.keys.file_content(file_id))
        pipe.zrem(self.keys.files_index, file_id)
        deleted, _ = await pipe.execute()
        return bool(deleted)

    # ---- batches -----------------------------------------------------------------------
    async def create_batch(
        self, input_file_id: str, endpoint: str, completion_window: str, metadata: dict | None
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
        }
        window = fields["expires_at"] - now
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(self.keys.batch(batch_id), mapping={k: str(v) for k, v in fields.items()})
        pipe.expire(self.keys.batch(batch_id), window + self.retention)
        pipe.zadd(self.keys.batches_index, {batch_id: time.time()})
        pipe.sadd(self.keys.batches_active, batch_id)
        await pipe.execute()
        # Its input outlives its window (finalizing reads it again).
        await self.keep_file(input_file_id, window + 3600)
        return await self.get_batch(batch_id)

    async def get_batch(self, batch_id: str) -> dict | None:
        if not is_id("batch", batch_id):
            return None
        raw = await self.r.hgetall(self.keys.batch(batch_id))
        if not raw:
            return None
        return _batch_object({_str(k): _str(v) for k, v in raw.items()})

    async def list_batches(self, after: str | None, limit: int) -> tuple[list[dict], bool]:
        ids = [_str(i) for i in await self.r.zrevrange(self.keys.batches_index, 0, -1)]
        if after is not None:
            ids = ids[ids.index(after) + 1 :] if after in ids else []
        page = ids[:limit]
        found = [(i, await self.get_batch(i)) for i in page]
        gone = [i for i, b in found if b is None]  # past their retention
        if gone:
            await self.r.zrem(self.keys.batches_index, *gone)
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
        return _str(prev) if prev else None

    async def status(self, batch_id: str) -> str | None:
        raw = await self.r.hget(self.keys.batch(batch_id), "status")
        return _str(raw) if raw is not None else None

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


def _file_obj(raw: dict) -> dict | None:
    if not raw:
        return None
    obj: dict[str, Any] = {_str(k): _str(v) for k, v in raw.items()}
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
