"""What travels between the API (or a batch task) and the engines, as plain dataclasses.
``common/transport/`` turns them into Redis stream entries and pub/sub messages (JSON)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from llmq.common.sampling_params import SamplingParams

# Lower runs first: interactive requests ahead of batch-job lines.
PRIORITY_INTERACTIVE = 0
PRIORITY_BATCH = 10


def _token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value
    )


@dataclass(slots=True)
class EngineRequest:
    """One generation (or embedding) request as an engine receives it."""

    id: str
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    kind: str = "generate"  # or "embed"
    model: str = ""
    priority: int = PRIORITY_INTERACTIVE
    deadline: float | None = None  # unix time after which the request fails
    created: float = 0.0
    # Embedding requests: one token-id list per input, and options (dimensions, ...).
    inputs: list[list[int]] | None = None
    options: dict[str, Any] = field(default_factory=dict)
    # The pub/sub channel of the API process waiting for the output (one per process, not
    # per request: a worker sends each process one message a step). Empty: the request's
    # own channel (a request written by hand, followed with redis-cli).
    reply_to: str = ""
    # A LoRA adapter of the model applied to this request (its name as clients give it, and
    # the PEFT folder the worker reads it from); empty: the base model.
    lora_name: str = ""
    lora_path: str = ""
    # The content hashes of the prompt's images, in order (their bytes in Redis under
    # Keys.image): each fills one run of the model's image token.
    images: list[str] = field(default_factory=list)

    def to_json(self) -> str:
        data = asdict(self)
        return json.dumps(data, separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str | bytes) -> EngineRequest:
        """The request, or ValueError for an entry of the wrong shape (one written by hand
        with redis-cli, or by another program), which must fail alone, not kill the engine."""
        data = json.loads(raw)
        if not isinstance(data, dict) or not isinstance(data.get("id"), str):
            raise ValueError("a request needs a string id")
        if not _token_ids(data.get("prompt_token_ids")):
            raise ValueError("prompt_token_ids must be a list of token ids")
        inputs = data.get("inputs")
        if inputs is not None and not (isinstance(inputs, list) and all(map(_token_ids, inputs))):
            raise ValueError("inputs must be lists of token ids")
        images = data.get("images", [])
        if not (isinstance(images, list) and all(isinstance(d, str) for d in images)):
            raise ValueError("images must be a list of content hashes")
        try:
            data["params"] = SamplingParams.from_dict(data.get("params") or {})
            return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})
        except (TypeError, AttributeError) as exc:
            raise ValueError(f"malformed request: {exc}") from None


@dataclass(slots=True)
class EngineError:
    message: str
    type: str = "server_error"
    code: str | None = None


@dataclass(slots=True)
class OutputMessage:
    """One message on a request's output channel.

    ``index`` is the position of the first of ``tokens`` in the request's output: a client
    drops what it has already seen and detects a gap, so a request resumed on another worker
    continues the stream without a repeat or a hole."""

    index: int
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[dict[str, Any]] | None = None  # per token: {token_id, logprob, top}
    usage: dict[str, int] | None = None  # with the final message
    error: EngineError | None = None
    worker: str | None = None
    # Embedding results: one base64 string of little-endian float32 per input, in order.
    embeddings: list[str] | None = None
    # On the first message of a request that asked for them: None (token 0), then per prompt
    # token {token_id, logprob, rank, top}; recorded with the request, for a client that
    # missed the message.
    prompt_logprobs: list[dict[str, Any] | None] | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    def to_json(self) -> str:
        data: dict[str, Any] = {"index": self.index, "tokens": self.tokens}
        if self.finish_reason is not None:
            data["finish_reason"] = self.finish_reason
        if self.logprobs is not None:
            data["logprobs"] = self.logprobs
        if self.usage is not None:
            data["usage"] = self.usage
        if self.error is not None:
            data["error"] = asdict(self.error)
        if self.worker is not None:
            data["worker"] = self.worker
        if self.embeddings is not None:
            data["embeddings"] = self.embeddings
        if self.prompt_logprobs is not None:
            data["prompt_logprobs"] = self.prompt_logprobs
        return json.dumps(data, separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str | bytes) -> OutputMessage:
        return cls.from_dict(json.loads(raw))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> OutputMessage:
        error = data.get("error")
        return cls(
            index=data.get("index", 0),
            tokens=data.get("tokens") or [],
            finish_reason=data.get("finish_reason"),
            logprobs=data.get("logprobs"),
            usage=data.get("usage"),
            error=EngineError(**error) if error else None,
            worker=data.get("worker"),
            embeddings=data.get("embeddings"),
            prompt_logprobs=data.get("prompt_logprobs"),
        )
