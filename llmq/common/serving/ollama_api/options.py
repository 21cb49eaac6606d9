"""Ollama's ``options`` (its runner's parameters) as the sampling fields of a chat or completion
request. Mapped: temperature, top_p, top_k, min_p, seed, num_predict, stop, repeat_penalty,
presence_penalty, frequency_penalty. num_ctx is accepted: the context window is the served
model's (LLMQ_MAX_MODEL_LEN), a larger num_ctx capped to it as Ollama caps one past a model's
trained length, and a prompt with its output over it refused with the usual 400. llmq's own
``speculative`` (false: no speculative decoding for the request) is an option too, the one
place where Ollama's clients send a field of their own. Accepted and ignored: the options that
place or load the model (threads, GPUs, memory mapping, batch size), which change no answer.
Refused (400) unless neutral: the samplers llmq does not run (mirostat, tfs_z, typical_p) and a
repeat_last_n window other than the whole context."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

# Options that say where and how the model runs, not what it answers: accepted and ignored, as
# llmq's workers are configured by their operator.
IGNORED_OPTIONS = (
    "numa",
    "num_batch",
    "num_gpu",
    "main_gpu",
    "low_vram",
    "f16_kv",
    "logits_all",
    "vocab_only",
    "use_mmap",
    "use_mlock",
    "embedding_only",
    "num_thread",
    "num_keep",
    "penalize_newline",
    "mirostat_tau",
    "mirostat_eta",
)


def _neutral(value: float | None, neutral: float, what: str) -> float | None:
    if value is not None and value != neutral:
        raise ValueError(f"{what} is not supported by this server (only {neutral})")
    return value


class OllamaOptions(BaseModel):
    """Options Ollama does not know are accepted and ignored, as Ollama does."""

    model_config = ConfigDict(extra="allow")

    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: int | None = None  # 0 or less: no top-k
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    seed: Annotated[int, Field(ge=-(2**63), lt=2**63)] | None = None  # negative: random
    num_predict: int | None = None  # 0 or less (-1, -2): up to the context
    stop: str | list[str] | None = None
    repeat_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    num_ctx: Annotated[int, Field(ge=1)] | None = None
    repeat_last_n: Annotated[int, Field(ge=-1)] | None = None  # -1: the whole context
    speculative: bool | None = None  # llmq's: false turns speculative decoding off
    mirostat: int | None = None
    tfs_z: float | None = None
    typical_p: float | None = None
    # Typed so that a wrong type is a 400, and otherwise ignored (IGNORED_OPTIONS).
    numa: bool | None = None
    num_batch: int | None = None
    num_gpu: int | None = None
    main_gpu: int | None = None
    low_vram: bool | None = None
    f16_kv: bool | None = None
    logits_all: bool | None = None
    vocab_only: bool | None = None
    use_mmap: bool | None = None
    use_mlock: bool | None = None
    embedding_only: bool | None = None
    num_thread: int | None = None
    num_keep: int | None = None
    penalize_newline: bool | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None

    @field_validator("mirostat")
    @classmethod
    def _no_mirostat(cls, v):
        return _neutral(v, 0, "mirostat sampling")

    @field_validator("tfs_z")
    @classmethod
    def _no_tfs(cls, v):
        return _neutral(v, 1.0, "tail-free sampling (tfs_z)")

    @field_validator("typical_p")
    @classmethod
    def _no_typical(cls, v):
        return _neutral(v, 1.0, "locally typical sampling (typical_p)")

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        return [v] if isinstance(v, str) else v

    def penalized(self) -> bool:
        return (
            (self.repeat_penalty is not None and self.repeat_penalty != 1.0)
            or bool(self.presence_penalty)
            or bool(self.frequency_penalty)
        )


def _penalties(options: OllamaOptions) -> dict[str, Any]:
    window = options.repeat_last_n
    if window == 0:  # Ollama: penalties off
        return {}
    if window not in (None, -1) and options.penalized():
        raise ValueError(
            f"options.repeat_last_n {window} is not supported: penalties apply over the whole "
            "context here (repeat_last_n -1), or 0 to turn them off"
        )
    fields = {
        "repetition_penalty": options.repeat_penalty,
        "presence_penalty": options.presence_penalty,
        "frequency_penalty": options.frequency_penalty,
    }
    return {k: v for k, v in fields.items() if v is not None}


def sampling_fields(options: OllamaOptions | None) -> dict[str, Any]:
    """The chat or completion request's sampling fields asking for what ``options`` ask (a
    ValueError for a combination not served). Unset options keep llmq's defaults."""
    if options is None:
        return {}
    fields: dict[str, Any] = {
        "temperature": options.temperature,
        "top_p": options.top_p,
        "min_p": options.min_p,
        "stop": options.stop or None,
    }
    if options.top_k is not None:
        fields["top_k"] = options.top_k if options.top_k > 0 else -1
    if options.seed is not None and options.seed >= 0:
        fields["seed"] = options.seed
    if options.num_predict is not None and options.num_predict > 0:
        fields["max_tokens"] = options.num_predict
    if options.speculative is not None:
        fields["speculative"] = options.speculative
    fields = {k: v for k, v in fields.items() if v is not None}
    return fields | _penalties(options)
