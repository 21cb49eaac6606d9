"""Where a JSON object or array that arrives in pieces ends: brackets counted outside strings."""

from __future__ import annotations


class JsonExtent:
    """Fed the text of one JSON object or array from its opening bracket on; ``end`` becomes the
    offset just past its closing bracket once that has been fed."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.scanned = 0  # characters fed so far
        self.end: int | None = None

    def feed(self, text: str) -> int:
        """Scan ``text`` (what follows what was fed before); returns how many of its characters
        belong to the value (all of them unless it closed inside ``text``)."""
        for i, ch in enumerate(text):
            if self.end is not None:
                return i
            self.scanned += 1
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.end = self.scanned
        return len(text)
