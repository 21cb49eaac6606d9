"""A file's content in Redis as a list of pieces of at most CHUNK_BYTES each: no value nears
Redis's 512 MB limit on one string, and content is written and read a piece at a time, never
held whole (an upload as it streams in, a batch's output as it is written, a download)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import redis.asyncio as aioredis

CHUNK_BYTES = 1 << 20

# Append piece number ARGV[1] (0-based) unless it is there already: a write retried after its
# reply was lost (redis-py retries on a dropped connection) must not add the piece twice.
_APPEND = """
local have = redis.call('LLEN', KEYS[1])
if have == tonumber(ARGV[1]) then
  redis.call('RPUSH', KEYS[1], ARGV[2])
  have = have + 1
end
redis.call('EXPIRE', KEYS[1], ARGV[3])
return have
"""


class FileGone(Exception):
    """The content was deleted (or expired) while it was being read."""


class ChunkWriter:
    """Writes content to one chunk list as it comes, each piece with the file's TTL."""

    def __init__(
        self, client: aioredis.Redis, key: str, ttl: int, chunk_bytes: int = CHUNK_BYTES
    ) -> None:
        self.r = client
        self.key = key
        self.ttl = ttl
        self.chunk_bytes = chunk_bytes
        self.size = 0
        self._pieces = 0
        self._buffer = bytearray()
        self._append = client.register_script(_APPEND)

    async def write(self, data: bytes) -> None:
        self._buffer += data
        self.size += len(data)
        while len(self._buffer) >= self.chunk_bytes:
            piece = bytes(self._buffer[: self.chunk_bytes])
            del self._buffer[: self.chunk_bytes]
            await self._push(piece)

    async def close(self) -> None:
        """Writes what is left; the content is then whole in Redis."""
        if self._buffer:
            piece = bytes(self._buffer)
            self._buffer.clear()
            await self._push(piece)

    async def discard(self) -> None:
        self._buffer.clear()
        await self.r.delete(self.key)

    async def _push(self, piece: bytes) -> None:
        have = await self._append(keys=[self.key], args=[self._pieces, piece, self.ttl])
        if int(have) != self._pieces + 1:
            raise FileGone(f"{self.key} has {have} pieces, expected {self._pieces + 1}")
        self._pieces += 1


async def read_chunks(client: aioredis.Redis, key: str) -> AsyncIterator[bytes]:
    """The content's pieces in order, one round trip each; FileGone if it goes away before
    its last piece is read."""
    count = await client.llen(key)
    for i in range(count):
        piece = await client.lindex(key, i)
        if piece is None:
            raise FileGone(f"{key} went away after {i} of {count} pieces")
        yield piece
