"""Files of the OpenAI Files API in Redis: an object hash (with its ``owner``, kept out of the
object clients see) plus the content as a list of pieces (common/storage/file_chunks.py), written and
read a piece at a time.

Each tenant's files are indexed apart and their bytes counted against its quota as they are
written (an upload reserves each piece before storing it). A file is kept ``retention`` seconds
(a batch's input longer, until its window ends): the retention index holds every file by the
time its retention ends, and ``sweep_expired`` deletes those past it the way a client's delete
does, giving their bytes back to their owner. The keys' own TTL, a week longer, is only a net
for a deployment where no sweep runs."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import redis.asyncio as aioredis

from llmq.common.errors import QuotaExceeded
from llmq.common.ids import is_id, new_id, text
from llmq.common.storage.file_chunks import ChunkWriter, read_chunks
from llmq.common.tenants import ANONYMOUS
from llmq.common.transport.keys import RELEASE_FILE_SCRIPT, RESERVE_BYTES_SCRIPT, Keys

DEFAULT_RETENTION = 30 * 24 * 3600
KEY_TTL_MARGIN = 7 * 24 * 3600  # the keys' own TTL past the retention: a net only

# Keep a file at least ARGV[1] seconds more: its retention (ARGV[2]: its end, epoch seconds) in
# the index KEYS[3] and the TTL of its keys (KEYS[1], KEYS[2]) pushed back, never forward.
_KEEP = """
local score = redis.call('ZSCORE', KEYS[3], ARGV[3])
if score and tonumber(score) < tonumber(ARGV[2]) then
  redis.call('ZADD', KEYS[3], ARGV[2], ARGV[3])
end
for i = 1, 2 do
  local ttl = redis.call('TTL', KEYS[i])
  if ttl >= 0 and ttl < tonumber(ARGV[1]) + tonumber(ARGV[4]) then
    redis.call('EXPIRE', KEYS[i], tonumber(ARGV[1]) + tonumber(ARGV[4]))
  end
end
return 0
"""


class Files:
    r: aioredis.Redis
    keys: Keys
    retention: int

    def _init_files(self) -> None:
        self._reserve_bytes = self.r.register_script(RESERVE_BYTES_SCRIPT)
        self._release_file = self.r.register_script(RELEASE_FILE_SCRIPT)
        self._keep = self.r.register_script(_KEEP)

    def file_writer(self) -> tuple[str, ChunkWriter]:
        """A new file's id and the writer of its content; ``commit_file`` makes it a file."""
        file_id = new_id("file")
        ttl = self.retention + KEY_TTL_MARGIN
        return file_id, ChunkWriter(self.r, self.keys.file_content(file_id), ttl)

    async def reserve(self, owner: str, size: int, quota: int) -> None:
        """Count ``size`` more bytes to ``owner`` (0 ``quota``: counted, never refused);
        QuotaExceeded if they would pass the quota."""
        ok, held = await self._reserve_bytes(
            keys=[self.keys.tenant_bytes(owner)], args=[size, quota]
        )
        if not ok:
            raise QuotaExceeded(
                f"the file ({size} more bytes) would pass this API key's storage quota of "
                f"{quota} bytes ({held} in use): delete files to make room"
            )

    async def unreserve(self, owner: str, size: int) -> None:
        """Give back bytes reserved for content that was not kept."""
        if size:
            with contextlib.suppress(Exception):
                await self.r.decrby(self.keys.tenant_bytes(owner), size)

    async def commit_file(
        self, file_id: str, filename: str, purpose: str, size: int, owner: str = ANONYMOUS
    ) -> dict:
        """The file object of content written whole with ``file_writer``, its ``size`` bytes
        reserved for ``owner`` already."""
        now = time.time()
        obj = {
            "id": file_id,
            "object": "file",
            "bytes": size,
            "created_at": int(now),
            "filename": filename,
            "purpose": purpose,
            "status": "processed",
        }
        fields = {k: str(v) for k, v in obj.items()}
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(self.keys.file(file_id), mapping={**fields, "owner": owner})
        for key in (self.keys.file(file_id), self.keys.file_content(file_id)):
            pipe.expire(key, self.retention + KEY_TTL_MARGIN)
        pipe.zadd(self.keys.tenant_files(owner), {file_id: now})
        pipe.zadd(self.keys.files_expiry, {file_id: now + self.retention})
        await pipe.execute()
        return obj

    async def create_file(
        self, filename: str, purpose: str, content: bytes, owner: str = ANONYMOUS, quota: int = 0
    ) -> dict:
        """Store a small file whole (tests, tools), counted against ``quota``."""
        await self.reserve(owner, len(content), quota)
        file_id, writer = self.file_writer()
        try:
            await writer.write(content)
            await writer.close()
            return await self.commit_file(file_id, filename, purpose, len(content), owner)
        except Exception:
            await self.unreserve(owner, len(content))
            with contextlib.suppress(Exception):
                await writer.discard()
            raise

    async def get_file(self, file_id: str, owner: str | None = None) -> dict | None:
        """The file, if there is one (and ``owner``'s, unless None: the worker's reads)."""
        if not is_id("file", file_id):
            return None
        return _file_obj(await self.r.hgetall(self.keys.file(file_id)), owner)

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
        k = self.keys
        keys = [k.file(file_id), k.file_content(file_id), k.files_expiry]
        args = [int(seconds), time.time() + seconds, file_id, KEY_TTL_MARGIN]
        await self._keep(keys=keys, args=args)

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
            ids = [text(i) for i in await read(index, start, start + chunk - 1)]
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
            k.files_expiry,
        ]
        return bool(await self._release_file(keys=keys, args=[file_id, owner, ANONYMOUS]))

    async def sweep_expired(self, limit: int = 100) -> list[str]:
        """Delete up to ``limit`` files past their retention, each as its owner's delete does
        (its bytes given back); returns their ids."""
        due = await self.r.zrangebyscore(self.keys.files_expiry, "-inf", time.time(), 0, limit)
        swept = []
        for file_id in map(text, due):
            owner = await self.r.hget(self.keys.file(file_id), "owner")
            if await self.delete_file(file_id, text(owner) if owner else ANONYMOUS):
                swept.append(file_id)
            else:  # gone already (its keys' TTL): only the index entry is left
                await self.r.zrem(self.keys.files_expiry, file_id)
        return swept


def _file_obj(raw: dict, owner: str | None = None) -> dict | None:
    """The file object clients see (no owner field); None if absent or not ``owner``'s."""
    if not raw:
        return None
    obj: dict[str, Any] = {text(k): text(v) for k, v in raw.items()}
    file_owner = obj.pop("owner", ANONYMOUS)
    if owner is not None and file_owner != owner:
        return None
    obj["bytes"] = int(obj["bytes"])
    obj["created_at"] = int(obj["created_at"])
    return obj
