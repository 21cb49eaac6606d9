"""Ollama's answer objects, typed: a chat or generate line (the whole answer, or one line of
the NDJSON stream; the last with ``done: true``, its reason and the timings in nanoseconds)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, ClassVar

from llmq.common.serving.responses import WireModel

_STATS = frozenset(
    {
        "total_duration",
        "load_duration",
        "prompt_eval_count",
        "prompt_eval_duration",
        "eval_count",
        "eval_duration",
    }
)


def created_at() -> str:
    """Now, as Ollama writes it (RFC 3339, UTC)."""
    return datetime.now(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def rfc3339(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, UTC).isoformat().replace("+00:00", "Z")


def done_reason(finish_reason: str | None) -> str:
    """Ollama's two reasons: "length" (num_predict or the context reached) or "stop" (an end
    token, a stop string, tool calls)."""
    return "length" if finish_reason == "length" else "stop"


@dataclass
class Timings:
    """When the answer's phases began, in monotonic nanoseconds: the request arrived, was
    submitted (model resolved, prompt tokenized, queued), gave its first token, ended."""

    started: int = field(default_factory=time.monotonic_ns)
    submitted: int = 0
    first_token: int = 0
    ended: int = 0

    def mark_submitted(self) -> None:
        self.submitted = time.monotonic_ns()

    def stats(self, prompt_tokens: int, output_tokens: int) -> dict[str, int]:
        """Ollama's counts and durations: load (up to submission), prompt evaluation (queue
        and prefill, up to the first token), evaluation (the rest)."""
        ended = self.ended or time.monotonic_ns()
        submitted = self.submitted or ended
        first = self.first_token or ended
        return {
            "total_duration": ended - self.started,
            "load_duration": submitted - self.started,
            "prompt_eval_count": prompt_tokens,
            "prompt_eval_duration": max(first - submitted, 0),
            "eval_count": output_tokens,
            "eval_duration": max(ended - first, 0),
        }


class OllamaFunction(WireModel):
    index: int
    name: str
    arguments: dict[str, Any]  # an object, not JSON text (Ollama's shape)


class OllamaCall(WireModel):
    id: str
    function: OllamaFunction


class OllamaAssistantMessage(WireModel):
    omit_if_none = frozenset({"thinking", "tool_calls"})

    role: str = "assistant"
    content: str = ""
    thinking: str | None = None
    tool_calls: list[OllamaCall] | None = None


class _Line(WireModel):
    omit_if_none: ClassVar[frozenset[str]] = _STATS | {"done_reason"}

    model: str
    created_at: str
    done: bool = False
    done_reason: str | None = None
    total_duration: int | None = None
    load_duration: int | None = None
    prompt_eval_count: int | None = None
    prompt_eval_duration: int | None = None
    eval_count: int | None = None
    eval_duration: int | None = None


class ChatLine(_Line):
    message: OllamaAssistantMessage


class GenerateLine(_Line):
    omit_if_none = _Line.omit_if_none | {"thinking"}

    response: str = ""
    thinking: str | None = None


def chat_line(model: str, message: OllamaAssistantMessage, **final: Any) -> ChatLine:
    return ChatLine(model=model, created_at=created_at(), message=message, **final)


def generate_line(model: str, response: str, thinking: str | None, **final: Any) -> GenerateLine:
    return GenerateLine(
        model=model, created_at=created_at(), response=response, thinking=thinking, **final
    )
