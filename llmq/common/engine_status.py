"""EngineStatus: a worker's heartbeat, written by its engine loop, read by the API, `llmq
inspect` and the metrics. On Redis it is a flat hash of numbers and strings (``HGETALL
llmq:engines:<worker>`` shows it as is); here it is typed, parsed in one place."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass(slots=True)
class EngineStatus:
    # What the worker serves (fixed for its life).
    model: str = ""
    source: str = ""  # where the weights come from (a hub id or a folder)
    kind: str = "generate"  # or "embed"
    max_model_len: int = 0
    vocab_size: int = 0
    dtype: str = ""
    device: str = ""
    host: str = ""
    pid: int = 0
    started: float = 0.0
    torch_threads: int = 0
    forward_plan: str = ""  # how its steps run, decided at start (worker/runner/forward/plan.py)
    random_weights: bool = False
    dimensions: int = 0  # embedding models
    matryoshka: bool = False
    images: bool = False  # it takes image input (a vision-language model)
    image_token_id: int = 0  # the token a prompt holds at each image position
    image_layout: str = ""  # JSON: how many tokens an image is (common/images/tokens.py)
    # How it is doing (each heartbeat).
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    running: int = 0
    waiting: int = 0
    steps_total: int = 0
    tokens_total: int = 0
    requests_total: int = 0
    prefix_cache_hit_tokens: int = 0
    images_encoded: int = 0  # images its vision encoder ran on (a kept or cached one: not again)
    preemptions_total: int = 0  # sequences it preempted to free blocks (computed again later)
    # Prompt tokens of the requests it finished: served from its prefix cache, and computed.
    prompt_tokens_cached: int = 0
    prompt_tokens_computed: int = 0
    # Tokens its engine has still to compute for the requests it holds (prompts not yet
    # prefilled, one a decoding sequence): the load placement weighs.
    pending_tokens: int = 0
    block_size: int = 0  # of its prefix cache's blocks (0: it caches none)
    placement: bool = False  # it hands requests placed on another worker over to it
    loras: str = ""  # the LoRA adapters it holds loaded, comma-separated
    # Speculative decoding (totals): sequence-steps that checked a draft, draft tokens
    # proposed and accepted.
    spec_verified: int = 0
    spec_proposed: int = 0
    spec_accepted: int = 0
    steps_per_s: float = 0.0
    tokens_per_s: float = 0.0
    updated: float = 0.0
    # The worker's name: the key's suffix, not a field of the hash.
    worker: str = ""

    def update(self, **values: Any) -> None:
        for name, value in values.items():
            setattr(self, name, value)

    def to_redis(self) -> dict[str, str | int | float]:
        """The hash fields (booleans as 0/1, as redis-cli users read them)."""
        out: dict[str, str | int | float] = {}
        for f in fields(self):
            if f.name == "worker":
                continue
            value = getattr(self, f.name)
            out[f.name] = int(value) if isinstance(value, bool) else value
        return out

    @classmethod
    def from_redis(cls, raw: dict, worker: str = "") -> EngineStatus:
        """Parse a heartbeat hash (bytes or str); a field missing or unreadable keeps its
        default (a worker of an older version may lack it)."""
        status = cls(worker=worker)
        for key, value in raw.items():
            name = key.decode() if isinstance(key, bytes) else str(key)
            if name not in _TYPES or name == "worker":
                continue
            text = value.decode() if isinstance(value, bytes) else str(value)
            parsed = _parse(_TYPES[name], text)
            if parsed is not None:
                setattr(status, name, parsed)
        return status


_TYPES = {f.name: f.type for f in fields(EngineStatus)}


def _parse(kind: str, text: str) -> Any:
    try:
        if kind == "bool":
            return text.strip().lower() in ("1", "true")
        if kind == "int":
            return int(float(text)) if text else 0
        if kind == "float":
            return float(text) if text else 0.0
    except ValueError:
        return None
    return text
