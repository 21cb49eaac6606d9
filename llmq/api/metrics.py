"""Prometheus metrics with vLLM's names and meanings under the ``llmq:`` prefix; the generation
service reports to them (``GenerationMetrics``), /metrics sets the gauges from the heartbeats."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

from llmq.common.engine_status import EngineStatus

disable_created_metrics()  # no *_created series: vLLM's metric set has none

# fmt: off
_LATENCY = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
            20.0, 40.0, 80.0)
_ITL = (0.001, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
        1.0, 2.5)
# fmt: on
_MODEL = ("model_name",)


@dataclass(slots=True)
class _ModelLoad:
    """The engines' heartbeats of one model, summed."""

    running: int = 0
    waiting: int = 0
    used: int = 0
    total: int = 0
    engines: int = 0
    spec_verified: int = 0
    spec_proposed: int = 0
    spec_accepted: int = 0
    updated: float = 0.0  # the oldest heartbeat's time


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        h, c, g = self._histogram, self._counter, self._gauge
        self.ttft = h("time_to_first_token_seconds", "Time to first token.", _LATENCY)
        self.itl = h("inter_token_latency_seconds", "Time between streamed tokens.", _ITL)
        self.e2e = h("e2e_request_latency_seconds", "End-to-end request latency.", _LATENCY)
        self.queue_time = h(
            "request_queue_time_seconds", "Time a request waited before a worker took it.", _LATENCY
        )
        self.prompt_tokens = c("prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = c("generation_tokens", "Tokens generated.")
        self.success = c(
            "request_success", "Requests finished, by finish reason.", "finished_reason"
        )
        self.rejected = c("request_rejected", "Requests refused, by reason.", "reason")
        self.running = g("num_requests_running", "Requests running on the engines.")
        self.waiting = g("num_requests_waiting", "Requests waiting in the engines and the queue.")
        self.kv_usage = g("kv_cache_usage_perc", "KV cache usage, 0 to 1.")
        self.engines = g("num_engines", "Live engines.")
        self.kv_blocks_used = g("kv_cache_blocks_used", "KV blocks in use.")
        # Signals to scale workers on (per model stream): what nobody has taken, what is served.
        self.queue_lag = g("queue_lag", "Requests in the model's stream no engine has taken yet.")
        self.queue_pending = g("queue_pending", "Requests engines have taken and are serving.")
        # Per live worker, from its heartbeat (totals since it started): what placement gains.
        self.worker_cached = self._worker_gauge(
            "worker_prompt_tokens_cached", "Prompt tokens a worker served from its prefix cache."
        )
        self.worker_computed = self._worker_gauge(
            "worker_prompt_tokens_computed", "Prompt tokens a worker computed."
        )
        # Speculative decoding, over the live engines' totals.
        self.spec_acceptance = g(
            "spec_decode_acceptance_rate", "Share of proposed draft tokens the model accepted."
        )
        self.spec_mean_length = g(
            "spec_decode_mean_accepted_length",
            "Tokens a sequence-step that checked a draft yielded (accepted drafts plus one).",
        )
        # The totals behind those rates (vLLM's counters' names) and when the heartbeats last
        # counted them: a client measures its own run by their change over it.
        self.spec_drafts = g("spec_decode_num_drafts", "Sequence-steps that checked a draft.")
        self.spec_draft_tokens = g("spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.spec_accepted_tokens = g(
            "spec_decode_num_accepted_tokens", "Draft tokens the model accepted."
        )
        self.heartbeat_time = g(
            "engine_heartbeat_time", "Unix time of the oldest of the live engines' heartbeats."
        )

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(f"llmq:{name}", doc, _MODEL, buckets=buckets, registry=self.registry)

    def _counter(self, name: str, doc: str, *labels: str) -> Counter:
        return Counter(f"llmq:{name}", doc, [*_MODEL, *labels], registry=self.registry)

    def _gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(f"llmq:{name}", doc, _MODEL, registry=self.registry)

    def _worker_gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(f"llmq:{name}", doc, [*_MODEL, "worker"], registry=self.registry)

    # ---- GenerationMetrics ---------------------------------------------------------------
    def observe_first_token(self, model: str, seconds: float) -> None:
        self.ttft.labels(model).observe(seconds)

    def observe_inter_token(self, model: str, seconds: float) -> None:
        self.itl.labels(model).observe(seconds)

    def observe_queue_time(self, model: str, seconds: float) -> None:
        self.queue_time.labels(model).observe(seconds)

    def observe_finished(
        self,
        model: str,
        seconds: float,
        finish_reason: str,
        prompt_tokens: int,
        generation_tokens: int,
    ) -> None:
        self.e2e.labels(model).observe(seconds)
        self.success.labels(model, finish_reason).inc()
        self.prompt_tokens.labels(model).inc(prompt_tokens)
        self.generation_tokens.labels(model).inc(generation_tokens)

    def count_rejected(self, model: str, reason: str) -> None:
        self.rejected.labels(model, reason).inc()

    # ---- gauges --------------------------------------------------------------------------
    def observe_engines(
        self, engines: list[EngineStatus], streams: dict[str, tuple[int, int]]
    ) -> None:
        """Set the gauges from the engines' heartbeats (summed per model)."""
        per_model: dict[str, _ModelLoad] = {}
        self.worker_cached.clear()  # a worker gone leaves no series behind
        self.worker_computed.clear()
        for e in engines:
            self.worker_cached.labels(e.model, e.worker).set(e.prompt_tokens_cached)
            self.worker_computed.labels(e.model, e.worker).set(e.prompt_tokens_computed)
            load = per_model.setdefault(e.model, _ModelLoad())
            load.running += e.running
            load.waiting += e.waiting
            load.used += e.kv_blocks_used
            load.total += e.kv_blocks_total
            load.engines += 1
            load.spec_verified += e.spec_verified
            load.spec_proposed += e.spec_proposed
            load.spec_accepted += e.spec_accepted
            load.updated = min(load.updated or e.updated, e.updated)
        for model in set(per_model) | set(streams):
            load = per_model.get(model, _ModelLoad())
            lag, pending = streams.get(model, (0, 0))
            self.running.labels(model).set(load.running)
            self.waiting.labels(model).set(load.waiting + lag)
            self.queue_lag.labels(model).set(lag)
            self.queue_pending.labels(model).set(pending)
            self.kv_usage.labels(model).set(load.used / load.total if load.total else 0.0)
            self.kv_blocks_used.labels(model).set(load.used)
            self.engines.labels(model).set(load.engines)
            self.heartbeat_time.labels(model).set(load.updated)
            if load.spec_verified:
                self.spec_acceptance.labels(model).set(load.spec_accepted / load.spec_proposed)
                verified, accepted = load.spec_verified, load.spec_accepted
                self.spec_mean_length.labels(model).set((accepted + verified) / verified)
                self.spec_drafts.labels(model).set(verified)
                self.spec_draft_tokens.labels(model).set(load.spec_proposed)
                self.spec_accepted_tokens.labels(model).set(accepted)
