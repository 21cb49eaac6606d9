"""Files and batches of the OpenAI Batch API, kept in Redis (key names from transport.Keys):
one Store with both halves, files_store.Files and batches_store.Batches.

Each file and batch has an ``owner`` field (see common/tenants.py), kept out of the objects
clients see; reads given an owner answer None for another tenant's object, exactly as for a
missing one. Each tenant's files and batches are indexed apart, and its files' bytes counted
against its quota. Everything has a TTL: files ``retention`` (a batch's input until its window
ends), batches their window plus ``retention``.
"""

from __future__ import annotations

import redis.asyncio as aioredis

from llmq.common.ids import is_id, new_id
from llmq.common.storage.batches_store import FINAL_STATES, Batches
from llmq.common.storage.files_store import DEFAULT_RETENTION, Files
from llmq.common.transport.keys import Keys

BATCH_ENDPOINTS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/rerank",
    "/v1/score",
    "/v1/messages",
)

__all__ = ["BATCH_ENDPOINTS", "FINAL_STATES", "Store", "is_id", "new_id"]


class Store(Files, Batches):
    def __init__(self, client: aioredis.Redis, keys: Keys, retention: int = DEFAULT_RETENTION):
        self.r = client
        self.keys = keys
        self.retention = retention  # seconds files and finished batches are kept
        self._init_files()
        self._init_batches()
