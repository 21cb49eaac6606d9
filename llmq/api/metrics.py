"""Prometheus metrics with vLLM's names and meanings under the ``llmq:`` prefix."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

from llmq.common.engine_status import EngineStatus

disable_created_metrics()  # no *_created series: vLLM's metric set has none

_LATENCY = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_ITL = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        m = ["model_name"]
        self.ttft = Histogram(
            "llmq:time_to_first_token_seconds",
            "Time to first token.",
            m,
            buckets=_LATENCY,
            registry=r,
        )
        self.itl = Histogram(
            "llmq:inter_token_latency_seconds",
            "Time between streamed tokens.",
            m,
            buckets=_ITL,
            registry=r,
        )
        self.e2e = Histogram(
            "llmq:e2e_request_latency_seconds",
            "End-to-end request latency.",
            m,
            buckets=_LATENCY,
            registry=r,
        )
        self.queue_time = Histogram(
            "llmq:request_queue_time_seconds",
            "Time a request waited before a worker took it.",
            m,
            buckets=_LATENCY,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "llmq:prompt_tokens", "Prompt tokens processed.", m, registry=r
        )
        self.generation_tokens = Counter(
            "llmq:generation_tokens", "Tokens generated.", m, registry=r
        )
        self.success = Counter(
            "llmq:request_success",
            "Requests finished, by finish reason.",
            [*m, "finished_reason"],
            registry=r,
        )
        self.rejected = Counter(
            "llmq:request_rejected", "Requests refused, by reason.", [*m, "reason"], registry=r
        )
        self.running = Gauge(
            "llmq:num_requests_running", "Requests running on the engines.", m, registry=r
        )
        self.waiting = Gauge(
            "llmq:num_requests_waiting",
            "Requests waiting in the engines and the queue.",
            m,
            registry=r,
        )
        self.kv_usage = Gauge("llmq:kv_cache_usage_perc", "KV cache usage, 0 to 1.", m, registry=r)
        self.engines = Gauge("llmq:num_engines", "Live engines.", m, registry=r)
        self.kv_blocks_used = Gauge("llmq:kv_cache_blocks_used", "KV blocks in use.", m, registry=r)
        # Signals to scale workers on (per model stream): what nobody has taken, what is served.
        self.queue_lag = Gauge(
            "llmq:queue_lag",
            "Requests in the model's stream no engine has taken yet.",
            m,
            registry=r,
        )
        self.queue_pending = Gauge(
            "llmq:queue_pending", "Requests engines have taken and are serving.", m, registry=r
        )

    def observe_engines(
        self, engines: list[EngineStatus], streams: dict[str, tuple[int, int]]
    ) -> None:
        """Set the gauges from the engines' heartbeats (summed per model)."""
        per_model: dict[str, dict[str, float]] = {}
        for e in engines:
            agg = per_model.setdefault(
                e.model, {"running": 0, "waiting": 0, "used": 0, "total": 0, "n": 0}
            )
            agg["running"] += e.running
            agg["waiting"] += e.waiting
            agg["used"] += e.kv_blocks_used
            agg["total"] += e.kv_blocks_total
            agg["n"] += 1
        for model in set(per_model) | set(streams):
            agg = per_model.get(model, {"running": 0, "waiting": 0, "used": 0, "total": 0, "n": 0})
            lag, pending = streams.get(model, (0, 0))
            self.running.labels(model).set(agg["running"])
            self.waiting.labels(model).set(agg["waiting"] + lag)
            self.queue_lag.labels(model).set(lag)
            self.queue_pending.labels(model).set(pending)
            self.kv_usage.labels(model).set(agg["used"] / agg["total"] if agg["total"] else 0.0)
            self.kv_blocks_used.labels(model).set(agg["used"])
            self.engines.labels(model).set(agg["n"])
