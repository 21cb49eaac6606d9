"""A batch's per-line checkpoint in Redis: each line's result (its output or error file row),
written once (HSETNX) and counted in the batch object, which a re-run continues from; and the
attempt number of lines retried after a temporary error. Both keys have a TTL and are deleted
once the batch's files are written."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterable

import redis.asyncio as aioredis

from llmq.common.transport.keys import Keys

# Record one line's result exactly once and count it; every record refreshes the TTL.
_RECORD_LINE = """
local recorded = 0
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 1 then
  redis.call('HINCRBY', KEYS[2], ARGV[3], 1)
  recorded = 1
end
redis.call('EXPIRE', KEYS[1], ARGV[4])
return recorded
"""


def _int(raw: bytes | str) -> int:
    return int(raw.decode() if isinstance(raw, bytes) else raw)


class LineCheckpoint:
    def __init__(self, client: aioredis.Redis, keys: Keys, batch_id: str, ttl: int):
        self.r = client
        self.batch_id = batch_id
        self.ttl = ttl
        self.results_key = keys.batch_results(batch_id)
        self.attempts_key = keys.batch_attempts(batch_id)
        self.batch_key = keys.batch(batch_id)
        self._record = client.register_script(_RECORD_LINE)

    async def record(self, line: int, row: dict, ok: bool) -> bool:
        """Checkpoint one line's result; False if it was already recorded. Safe to retry."""
        text = json.dumps(row, separators=(",", ":"))
        counter = "completed" if ok else "failed"
        done = await self._record(
            keys=[self.results_key, self.batch_key], args=[line, text, counter, self.ttl]
        )
        return bool(done)

    async def done(self) -> set[int]:
        """The numbers of the lines recorded (ints only: a few bytes a line)."""
        return {_int(k) for k in await self.r.hkeys(self.results_key)}

    async def rows(self, lines: Iterable[int]) -> dict[int, bytes]:
        """The recorded rows (JSON text) of some lines, in one round trip."""
        lines = list(lines)
        if not lines:
            return {}
        raw = await self.r.hmget(self.results_key, lines)
        return {n: row for n, row in zip(lines, raw, strict=True) if row is not None}

    async def scan(self) -> AsyncIterator[tuple[int, bytes]]:
        """Every recorded row, a slice at a time (HSCAN), in no particular order."""
        async for key, row in self.r.hscan_iter(self.results_key, count=500):
            yield _int(key), row

    async def attempts(self) -> dict[int, int]:
        """Lines retried so far -> their current attempt (few: only retried lines)."""
        raw = await self.r.hgetall(self.attempts_key)
        return {_int(k): _int(v) for k, v in raw.items()}

    async def set_attempt(self, line: int, attempt: int) -> None:
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(self.attempts_key, str(line), str(attempt))
        pipe.expire(self.attempts_key, self.ttl)
        await pipe.execute()

    async def delete(self) -> None:
        await self.r.delete(self.results_key, self.attempts_key)
