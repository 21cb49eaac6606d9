"""Which speculation a worker runs, from its settings. Pure: no torch (the draft model's
proposer, which runs one, is built by the engine: ``draft_model.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from llmq.worker.spec.ngram import NgramProposer
from llmq.worker.spec.speculator import Speculator
from llmq.worker.spec.suffix import SuffixProposer

if TYPE_CHECKING:
    from llmq.common.settings import Settings
    from llmq.worker.spec.proposer import Proposer

METHODS = ("off", "ngram", "draft", "suffix")


@dataclass(slots=True)
class SpecConfig:
    method: str = "ngram"
    num_tokens: int = 6  # most draft tokens per sequence and step (measured: 6 over 4 and 8)
    ngram_min: int = 2
    ngram_max: int = 4
    max_batch: int = 4  # decoding sequences past which no step proposes (_max_batch)
    draft_model: str = ""  # method draft: the draft model's folder or GGUF file
    draft_quantization: str = "none"
    dtype: str = "auto"  # the draft model's, as the served model's
    device: str = "auto"
    suffix_requests: int = 256  # method suffix: finished requests' outputs kept

    @classmethod
    def from_settings(cls, settings: Settings) -> SpecConfig | None:
        method = settings.speculative_method
        if method == "off" or settings.speculative_tokens < 1:
            return None
        if method == "draft" and not settings.speculative_model:
            raise ValueError("LLMQ_SPECULATIVE_METHOD=draft needs LLMQ_SPECULATIVE_MODEL")
        return cls(
            method=method,
            num_tokens=settings.speculative_tokens,
            ngram_min=settings.speculative_ngram_min,
            ngram_max=settings.speculative_ngram_max,
            max_batch=_max_batch(settings),
            draft_model=settings.speculative_model,
            draft_quantization=settings.speculative_quantization,
            dtype=settings.dtype,
            device=settings.device,
            suffix_requests=settings.speculative_suffix_requests,
        )

    def speculator(self, max_model_len: int, proposer: Proposer | None = None) -> Speculator:
        """``proposer``: the one built for this config where it needs a model (``draft``)."""
        if proposer is None:
            proposer = self.pure_proposer()
        return Speculator(proposer, self.num_tokens, self.max_batch, max_model_len)

    def pure_proposer(self) -> Proposer:
        if self.method == "ngram":
            return NgramProposer(self.ngram_min, self.ngram_max)
        if self.method == "suffix":
            return SuffixProposer(max_requests=self.suffix_requests)
        raise ValueError(f"speculative method {self.method!r} needs its model; one of {METHODS}")


def _max_batch(settings: Settings) -> int:
    """Prompt lookup and suffix drafts cost next to nothing to propose, so every batch may
    speculate, each sequence while it pays (StepCost); a draft model runs for each drafting
    sequence and keeps a KV pool sized by this."""
    if settings.speculative_max_batch is not None:
        return settings.speculative_max_batch
    return 4 if settings.speculative_method == "draft" else settings.max_batch_size
