"""Chat and completion answers as Ollama's lines: the whole answer as one line, or a stream's
chunks as NDJSON lines. Text and thinking go out as they come; tool calls, which Ollama sends
whole (arguments an object), go out together once the output ended; the last line has
``done: true``, the reason and the timings."""

from __future__ import annotations

import json
from typing import Literal

from llmq.common.serving.ollama_api.objects import (
    OllamaAssistantMessage,
    OllamaCall,
    OllamaFunction,
    Timings,
    WireModel,
    chat_line,
    done_reason,
    generate_line,
)
from llmq.common.serving.responses import (
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    CompletionChunk,
    ToolCall,
    Usage,
)

Surface = Literal["chat", "generate"]


def ollama_calls(calls: list[ToolCall]) -> tuple[list[OllamaCall], str]:
    """The calls in Ollama's shape, and the text of any whose arguments are not a JSON object
    (only a call cut short by num_predict: answered as text, with done_reason "length")."""
    out: list[OllamaCall] = []
    leftover = ""
    for call in calls:
        try:
            arguments = json.loads(call.function.arguments)
        except ValueError:
            arguments = None
        if not isinstance(arguments, dict):
            leftover += call.function.arguments
            continue
        function = OllamaFunction(index=len(out), name=call.function.name, arguments=arguments)
        out.append(OllamaCall(id=call.id, function=function))
    return out, leftover


class OllamaLines:
    """Builds the lines of one answer (one choice) for /api/chat or /api/generate."""

    def __init__(self, surface: Surface, model: str, timings: Timings):
        self.surface = surface
        self.model = model
        self.timings = timings
        self.reason: str | None = None
        self.usage: Usage | None = None
        self.calls: dict[int, ToolCall] = {}  # a stream's calls, by index, as they arrive

    def line(
        self,
        content: str,
        thinking: str | None = None,
        calls: list[OllamaCall] | None = None,
        **final,
    ) -> WireModel:
        if self.surface == "generate":
            return generate_line(self.model, content, thinking, **final)
        message = OllamaAssistantMessage(content=content, thinking=thinking, tool_calls=calls)
        return chat_line(self.model, message, **final)

    def _final(self, prompt_tokens: int, output_tokens: int) -> dict:
        stats = self.timings.stats(prompt_tokens, output_tokens)
        return {"done": True, "done_reason": done_reason(self.reason), **stats}

    # ---- whole -----------------------------------------------------------------------------
    def whole(self, answer: ChatCompletion | Completion) -> WireModel:
        choice = answer.choices[0]
        self.reason = choice.finish_reason
        final = self._final(answer.usage.prompt_tokens, answer.usage.completion_tokens)
        if isinstance(answer, Completion):
            return self.line(answer.choices[0].text, **final)
        message = answer.choices[0].message
        calls, leftover = ollama_calls(message.tool_calls or [])
        content = (message.content or "") + leftover
        return self.line(content, message.reasoning_content, calls or None, **final)

    # ---- streamed --------------------------------------------------------------------------
    def feed(self, chunk: ChatCompletionChunk | CompletionChunk) -> list[WireModel]:
        """The lines of one chunk: its text and thinking, if any (calls wait for the end)."""
        self.usage = chunk.usage or self.usage
        lines: list[WireModel] = []
        for choice in chunk.choices:
            self.reason = choice.finish_reason or self.reason
            if not isinstance(choice, ChatChunkChoice):
                if choice.text:
                    lines.append(self.line(choice.text))
                continue
            delta = choice.delta
            for call in delta.tool_calls or []:
                self._add_call(call.index, call.id, call.function.name, call.function.arguments)
            if delta.content or delta.reasoning_content:
                lines.append(self.line(delta.content or "", delta.reasoning_content))
        return lines

    def _add_call(self, index: int, call_id: str | None, name: str | None, arguments) -> None:
        call = self.calls.get(index)
        if call is None:
            call = ToolCall(id=call_id or f"call_{index}", function={"name": "", "arguments": ""})
            self.calls[index] = call
        call.function.name += name or ""
        call.function.arguments += arguments or ""

    def finish(self) -> list[WireModel]:
        """The stream's last lines: its calls (if any), then ``done``."""
        lines: list[WireModel] = []
        calls, leftover = ollama_calls([self.calls[i] for i in sorted(self.calls)])
        if calls or leftover:
            lines.append(self.line(leftover, calls=calls or None))
        usage = self.usage
        prompt, output = (usage.prompt_tokens, usage.completion_tokens) if usage else (0, 0)
        lines.append(self.line("", **self._final(prompt, output)))
        return lines

    def error(self, message: str) -> dict[str, str]:
        """The line that ends a stream that failed (Ollama's: the error alone)."""
        return {"error": message}
