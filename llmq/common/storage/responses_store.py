"""Stored responses of the Responses API (``store``, on by default): each one JSON value in
Redis (key name from transport.Keys) with its object, the conversation's input items (for a
later ``previous_response_id``) and its ``owner`` (common/tenants.py), kept out of what clients
see: another tenant's response reads as a missing one. Kept ``retention`` seconds (the files'
retention, LLMQ_FILE_RETENTION: OpenAI keeps responses 30 days, as its files), by the key's
TTL."""

from __future__ import annotations

import json
import re
from typing import Any

import redis.asyncio as aioredis

from llmq.common.transport.keys import Keys

_RESPONSE_ID = re.compile(r"resp_[0-9a-f]{32}")


def is_response_id(value: str) -> bool:
    """Checked before a key is built from an id that came in a URL path or a body."""
    return _RESPONSE_ID.fullmatch(value) is not None


class ResponsesStore:
    def __init__(self, client: aioredis.Redis, keys: Keys, retention: int):
        self.r = client
        self.keys = keys
        self.retention = retention

    async def save(self, owner: str, record: dict[str, Any]) -> None:
        """``record``: {"response": the object, "input": the conversation's input items}."""
        key = self.keys.response(record["response"]["id"])
        await self.r.set(key, json.dumps({**record, "owner": owner}), ex=self.retention)

    async def get(self, response_id: str, owner: str) -> dict[str, Any] | None:
        """The record, if there is one of ``owner``'s (None for an id of another form)."""
        if not is_response_id(response_id):
            return None
        raw = await self.r.get(self.keys.response(response_id))
        if raw is None:
            return None
        record = json.loads(raw)
        return record if record.pop("owner", None) == owner else None

    async def delete(self, response_id: str, owner: str) -> bool:
        """Delete ``owner``'s response; False if there is none of theirs."""
        if await self.get(response_id, owner) is None:
            return False
        return bool(await self.r.delete(self.keys.response(response_id)))

    async def history(self, response_id: str, owner: str) -> list[dict[str, Any]] | None:
        """The items a response continuing ``response_id`` comes after: its input items, then
        its output items."""
        record = await self.get(response_id, owner)
        if record is None:
            return None
        return record["input"] + record["response"]["output"]
