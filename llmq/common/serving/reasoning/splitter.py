"""A choice's output split into its reasoning (inside the think block) and its content (after
it), streamed: tags split across chunks are held back until they can be told."""

from __future__ import annotations

from llmq.common.serving.reasoning.formats import ReasoningFormat


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag`` (a tag still arriving)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningSplitter:
    """``inside``: the prompt opened the think block, so the output starts in reasoning.
    Otherwise the output reasons only when it opens the block itself, after whitespace at most
    (that whitespace is dropped with the tag); any other output is content alone."""

    def __init__(self, fmt: ReasoningFormat, inside: bool):
        self.fmt = fmt
        self.state = "reasoning" if inside else "start"
        self.buffer = ""
        self.reasoned = inside  # the output has a think block

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) of ``text``, less what is held back."""
        self.buffer += text
        if self.state == "start":
            self._open()
        if self.state == "reasoning":
            return self._reasoning()
        if self.state == "content":
            out, self.buffer = self.buffer, ""
            return "", out
        return "", ""

    def finish(self) -> tuple[str, str]:
        """What was held back: a tag that never completed is text of its part."""
        out, self.buffer = self.buffer, ""
        if self.state == "reasoning":
            return out, ""
        self.state = "content"
        return "", out

    def _open(self) -> None:
        start = self.fmt.start
        head = self.buffer.lstrip()
        if head.startswith(start):
            self.state, self.reasoned = "reasoning", True
            self.buffer = head[len(start) :]
        elif not start.startswith(head):
            self.state = "content"

    def _reasoning(self) -> tuple[str, str]:
        end = self.fmt.end
        at = self.buffer.find(end)
        if at >= 0:
            reasoning, rest = self.buffer[:at], self.buffer[at + len(end) :]
            self.state, self.buffer = "content", ""
            return reasoning, rest
        keep = _partial_suffix(self.buffer, end)
        cut = len(self.buffer) - keep
        out, self.buffer = self.buffer[:cut], self.buffer[cut:]
        return out, ""


def split_reasoning(fmt: ReasoningFormat, inside: bool, text: str) -> tuple[str | None, str]:
    """A whole output's reasoning (None: it has no think block) and content."""
    splitter = ReasoningSplitter(fmt, inside)
    r1, c1 = splitter.feed(text)
    r2, c2 = splitter.finish()
    return (r1 + r2 if splitter.reasoned else None), c1 + c2
