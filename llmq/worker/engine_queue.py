"""What the engine loop needs of its transport: requests in, outputs back, liveness and
recovery. ``EngineTransport`` (Redis) is the one in service; tests drive the loop with an
in-memory one."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from llmq.common.engine_status import EngineStatus
from llmq.common.protocol import EngineError
from llmq.common.transport import Emission, PulledRequest, Refusal


class EngineQueue(Protocol):
    worker: str  # this worker's name, stamped on the final message of each request
    handed_back: set[str]  # workers that announced a hand-back since the last claim
    live_peers: int | None  # other live engines on the model's queue (None: not known yet)
    placement: bool  # it hands requests placed on another worker over to it
    handover_waiting: bool  # requests may have been handed over to this worker: pull_handed
    # The transport is unavailable for now: the loop closes it, waits and sets it up again.
    transient_errors: tuple[type[Exception], ...]

    def setup(self, status: EngineStatus | None = None) -> None:
        """Join the model's queue and listen for cancels (again, after an outage)."""

    def close(self) -> None: ...

    def pull(
        self, count: int, block_ms: int | None, own_pending: bool = False
    ) -> list[PulledRequest]:
        """Up to ``count`` new requests, waiting up to ``block_ms`` (None: not at all) when
        there are none; with ``own_pending`` the ones this worker already holds."""

    def pull_handed(self, count: int) -> list[PulledRequest]:
        """Up to ``count`` of the requests other workers handed over to this one, taken into
        service as ``pull`` takes them."""

    def publish_cached(self, hashes: Iterable[int], ttl: float) -> None:
        """Publish the block hashes its prefix cache holds (what placement matches)."""

    def mark_running(self, pulled: Iterable[PulledRequest]) -> list[Refusal]:
        """Take the requests into service as their owner; refused: those another worker owns."""

    def drain_cancels(self) -> list[str]:
        """Ids of the requests cancelled since the last call (hand-backs go to
        ``handed_back``)."""

    def announce_handback(self) -> None:
        """Tell the other workers this one, shutting down, left requests for them."""

    def emit(self, emissions: list[Emission]) -> list[Refusal]:
        """Record and publish one step's news; a final message finishes its request. Nothing
        is written for a request another worker owns now, nor past a record that lost its
        tail: those come back refused."""

    def fail(
        self,
        request_id: str | None,
        entry_id: str,
        index: int,
        error: EngineError,
        reply_to: str = "",
    ) -> list[Refusal]:
        """End a request with an error (request_id None: drop an unparsable entry); its
        client hears of it on ``reply_to``."""

    def dead_letter(self, p: PulledRequest, reason: str) -> None:
        """Set a request aside as undeliverable and fail it."""

    def heartbeat(self, status: EngineStatus, ttl: float) -> None: ...

    def remove_heartbeat(self) -> None: ...

    def claim_orphans(self, min_idle_ms: int, max_count: int) -> list[PulledRequest]:
        """Take over the requests of workers whose heartbeat expired (or that handed back),
        each with the tokens recorded before the claim fenced their old owner out; count the
        live ones into ``live_peers``."""
