"""Tokenizing prompts and turning generated tokens back into text incrementally."""

from __future__ import annotations


class IncrementalDetokenizer:
    """Text deltas for a growing list of token ids, in O(new tokens) per call.

    Decodes a short window (the tokens since the last emitted text, plus the ones before them
    for context) and emits only once the text is complete: a trailing U+FFFD means a multi-byte
    character is still split across tokens. The concatenated deltas equal ``decode`` of all
    tokens."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: list[int]) -> str:
        self.token_ids.extend(token_ids)
        prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        text = self._decode(self.token_ids[self.prefix_offset :])
        if len(text) > len(prefix) and not text.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.token_ids)
            return text[len(prefix) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        text = self._decode(self.token_ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.token_ids)
        return text[len(prefix) :] if len(text) > len(prefix) else ""


class StopStringMatcher:
    """Finds stop strings in streamed text. Holds back the last ``len(longest stop) - 1``
    characters, so a stop string split across deltas is still caught and never shown."""

    def __init__(self, stops: list[str], include: bool = False):
        self.stops = [s for s in stops if s]
        # The stop string itself ends the text (vLLM's include_stop_str_in_output).
        self.include = include
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.buffer = ""

    def feed(self, delta: str, check: bool = True) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string was hit). ``check`` False: text
        before ``min_tokens`` is reached, passed on without looking for stop strings."""
        if not self.stops:
            return delta, False
        self.buffer += delta
        hits = (
            [(i, -len(s)) for s in self.stops if (i := self.buffer.find(s)) >= 0] if check else []
        )
        if hits:
            at, minus_len = min(hits)  # the first stop string, the longest of those there
            out = self.buffer[: at - minus_len if self.include else at]
            self.buffer = ""
            return out, True
        if len(self.buffer) <= self.hold:
            return "", False
        cut = len(self.buffer) - self.hold
        out, self.buffer = self.buffer[:cut], self.buffer[cut:]
        return out, False

    def flush(self) -> str:
        out, self.buffer = self.buffer, ""
        return out
