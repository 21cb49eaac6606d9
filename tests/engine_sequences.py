"""Sequences for the pure engine tests (block manager, scheduler): no torch."""

from __future__ import annotations

from llmq.common.sampling_params import SamplingParams
from llmq.worker.engine.sequence import Sequence

BS = 16


def make_seq(
    rid: str, tokens: list[int], arrival: int = 0, priority: int = 0, **params
) -> Sequence:
    params.setdefault("ignore_eos", True)
    return Sequence(rid, list(tokens), SamplingParams(**params), priority=priority, arrival=arrival)


def prefix(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))
