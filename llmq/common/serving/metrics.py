"""What the generation service reports while it serves (latencies, tokens, outcomes), to a
``GenerationMetrics`` the caller gives it: the API's Prometheus metrics; batch lines report
none."""

from __future__ import annotations

import time
from typing import Protocol

from llmq.common.engine_client.request_stream import GenerationChunk
from llmq.common.serving.choices import Choice


class GenerationMetrics(Protocol):
    def observe_first_token(self, model: str, seconds: float) -> None:
        """Time from the start of the answer to its first token (once per prompt)."""

    def observe_inter_token(self, model: str, seconds: float) -> None:
        """Time between two tokens of one choice."""

    def observe_queue_time(self, model: str, seconds: float) -> None:
        """Time a choice waited before a worker took it."""

    def observe_finished(
        self,
        model: str,
        seconds: float,
        finish_reason: str,
        prompt_tokens: int,
        generation_tokens: int,
    ) -> None:
        """A prompt's last choice finished: its end-to-end time and tokens."""

    def count_rejected(self, model: str, reason: str) -> None:
        """A request refused before it ran (queue full, no worker, ...)."""


class ChoiceRecorder:
    """Gathers each chunk into its choice and reports timings to the metrics, if any."""

    def __init__(self, metrics: GenerationMetrics | None, model: str):
        self.metrics = metrics
        self.model = model
        self.started = time.monotonic()

    def start(self) -> None:
        self.started = time.monotonic()

    def record(self, choice: Choice, chunk: GenerationChunk) -> None:
        metrics, model, group = self.metrics, self.model, choice.group
        now = time.monotonic()
        if chunk.token_ids:
            if group.first_token_at == 0.0:
                group.first_token_at = now
                if metrics:
                    metrics.observe_first_token(model, now - self.started)
            if choice.last_token_at and metrics:
                gap = now - choice.last_token_at
                metrics.observe_inter_token(model, gap / len(chunk.token_ids))
            choice.last_token_at = now
        choice.add(chunk)
        if chunk.finish_reason is None:
            return
        if chunk.queue_time is not None and metrics:
            metrics.observe_queue_time(model, chunk.queue_time)
        group.finished += 1
        group.completion_tokens += chunk.completion_tokens
        if group.finished == group.size and metrics:  # the prompt's last choice: it is done
            metrics.observe_finished(
                model,
                now - self.started,
                chunk.finish_reason,
                chunk.prompt_tokens,
                group.completion_tokens,
            )
