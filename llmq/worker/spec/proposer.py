"""The interface every proposer serves: guessed next tokens per sequence, in one call per step.

Pure: no torch. A proposer that needs a model (a draft model, an EAGLE or MTP head) keeps it
behind this same call; the engine only sees token ids.
"""

from __future__ import annotations

from typing import Protocol

from llmq.worker.engine.sequence import Sequence


class Proposer(Protocol):
    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        """Per sequence at most ``limits[i]`` tokens guessed to follow ``seqs[i].token_ids``
        (fewer or none where it has no good guess)."""

    def forget(self, seq: Sequence) -> None:
        """Drop what it keeps for ``seq`` (finished, aborted or preempted)."""
