"""What a worker tells about its prefix cache: the prompt tokens of its finished requests
served from the cache and computed (heartbeat fields, summed per worker), and the block hashes
the cache holds, published for placement (``transport/engine_placement.py``)."""

from __future__ import annotations

import logging

from llmq.common.protocol import OutputMessage
from llmq.worker.engine_queue import EngineQueue

log = logging.getLogger(__name__)

# An idle worker that places waits this long at most on the stream: requests handed over to it
# (announced on the cancel channel, which a blocked read does not see) start within it.
PLACEMENT_IDLE_BLOCK_MS = 20


class CacheReport:
    def __init__(self, transport: EngineQueue, backend, ttl: float):
        self.transport = transport
        self.ttl = ttl
        self.prompt_tokens_cached = 0
        self.prompt_tokens_computed = 0
        # Only an engine with a prefix cache has hashes to publish (None: none).
        self._hashes = getattr(backend, "cached_block_hashes", None)

    def finished(self, msg: OutputMessage) -> None:
        """Count a finished request's prompt tokens (its final message's usage)."""
        usage = msg.usage or {}
        prompt, cached = usage.get("prompt_tokens", 0), usage.get("cached_tokens", 0) or 0
        self.prompt_tokens_cached += cached
        self.prompt_tokens_computed += max(prompt - cached, 0)

    def fields(self) -> dict:
        return {
            "prompt_tokens_cached": self.prompt_tokens_cached,
            "prompt_tokens_computed": self.prompt_tokens_computed,
            "placement": bool(getattr(self.transport, "placement", False)),
        }

    def publish(self) -> None:
        """Publish the cache's block hashes (placement on; on the engine's thread: the cache
        changes only there)."""
        if self._hashes is not None and getattr(self.transport, "placement", False):
            self.transport.publish_cached(self._hashes(), self.ttl)
