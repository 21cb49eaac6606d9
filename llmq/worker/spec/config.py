"""Which speculation a worker runs, from its settings. Pure: no torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from llmq.worker.spec.ngram import NgramProposer
from llmq.worker.spec.speculator import Speculator

if TYPE_CHECKING:
    from llmq.common.settings import Settings

METHODS = ("off", "ngram")


@dataclass(slots=True)
class SpecConfig:
    method: str = "ngram"
    num_tokens: int = 4  # most draft tokens per sequence and step
    ngram_min: int = 2
    ngram_max: int = 4
    max_batch: int = 4  # decoding sequences past which no step proposes

    @classmethod
    def from_settings(cls, settings: Settings) -> SpecConfig | None:
        method = settings.speculative_method
        if method == "off" or settings.speculative_tokens < 1:
            return None
        return cls(
            method=method,
            num_tokens=settings.speculative_tokens,
            ngram_min=settings.speculative_ngram_min,
            ngram_max=settings.speculative_ngram_max,
            max_batch=settings.speculative_max_batch,
        )

    def speculator(self, max_model_len: int) -> Speculator:
        if self.method != "ngram":
            raise ValueError(f"unknown speculative method {self.method!r}; one of {METHODS}")
        proposer = NgramProposer(self.ngram_min, self.ngram_max)
        return Speculator(proposer, self.num_tokens, self.max_batch, max_model_len)
