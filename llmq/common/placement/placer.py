"""The API's side of cache-aware placement: for each generation request, the live worker of
its model it goes to (``placement.choose``), from the workers' heartbeats, their published
cached block hashes and this process's recent placements. The entry names that worker
(``target``); the workers see to it that it gets there (``transport/engine_placement.py``)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import redis.exceptions

from llmq.common.engine_status import EngineStatus
from llmq.common.placement.block_hashes import adapter_root, prompt_hashes
from llmq.common.placement.policy import Candidate, RecentPlacements, choose, cost
from llmq.common.protocol import EngineRequest
from llmq.common.transport import AsyncTransport

log = logging.getLogger(__name__)

# What a worker that has not loaded a request's LoRA adapter pays first, as prompt tokens: it
# reads the adapter from disk and may drop another to make room. A short prompt's worth, so
# that the adapter's worker wins unless it is far busier.
ADAPTER_LOAD_TOKENS = 256


def _adapter_cost(engine: EngineStatus, lora_name: str) -> int:
    if not lora_name or lora_name in engine.loras.split(","):
        return 0
    return ADAPTER_LOAD_TOKENS


class Placer:
    def __init__(
        self,
        transport: AsyncTransport,
        engines: Callable[[], Awaitable[list[EngineStatus]]],
        load_weight: float = 1.0,
    ):
        self.transport = transport
        self.engines = engines
        self.load_weight = load_weight
        self.recent = RecentPlacements()

    async def target(self, request: EngineRequest) -> str:
        """The worker chosen for ``request``; "" for none (an embedding request, a model one
        worker or none serves: whichever reads it first takes it)."""
        if request.kind != "generate" or not request.prompt_token_ids:
            return ""
        live = [
            e
            for e in await self.engines()
            if e.model == request.model and e.kind == "generate" and e.placement
        ]
        block_sizes = {e.block_size for e in live}
        if len(live) < 2 or len(block_sizes) != 1 or 0 in block_sizes:
            return ""
        block_size = block_sizes.pop()
        prompt = request.prompt_token_ids
        hashes = prompt_hashes(prompt, block_size, adapter_root(request.lora_name))
        workers = [e.worker for e in live]
        try:
            published = await self.transport.cached_prefixes(request.model, workers, hashes)
        except redis.exceptions.ResponseError as exc:  # placement helps; it never fails one
            log.warning("placement: cached prefixes unreadable (%s); not placed", exc)
            return ""
        recent = self.recent
        candidates = [
            Candidate(
                e.worker,
                recent.held_blocks(e.worker, hashes, published[e.worker]),
                recent.load(e.worker, e.pending_tokens, e.updated),
                _adapter_cost(e, request.lora_name),
            )
            for e in live
        ]
        best = choose(candidates, len(prompt), block_size, self.load_weight)
        computed = round(cost(best, len(prompt), block_size, 0.0))
        recent.record(best.worker, hashes, computed, request.id)
        return best.worker

    def computed(self, request_id: str) -> None:
        """``request_id``'s first output came back: its prompt left its worker's load."""
        self.recent.computed(request_id)
