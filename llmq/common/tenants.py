"""Tenants: each API key owns the files and batches made with it. Objects carry an owner id
derived from the key, never the key itself (Redis readers must not learn the keys)."""

from __future__ import annotations

import hashlib
from contextvars import ContextVar

# The one tenant of an API without keys (LLMQ_API_KEY unset), and the owner of objects stored
# before owners were recorded.
ANONYMOUS = "anonymous"

# The tenant of the request being served: set by the API's key check, and by a batch task for
# its lines. What a tenant owns (LoRA adapters) is offered to it alone.
current_owner: ContextVar[str] = ContextVar("llmq_owner", default=ANONYMOUS)


def owner_id(key: str) -> str:
    """The id a key's objects are stored under: 16 hex digits of its SHA-256 (64 bits: no two
    keys of one deployment collide by chance; not reversible to the key)."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]
