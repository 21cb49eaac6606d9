"""Text a client sent, checked before a tokenizer sees it."""

from __future__ import annotations

from llmq.common.errors import InvalidRequest


def check_text(value, param: str) -> None:
    """A 400 for text that is not valid Unicode (JSON allows lone surrogates such as "\\ud800";
    tokenizers reject them with an internal error)."""
    if isinstance(value, str):
        if value.isascii():  # no surrogate there, and no copy of a large text made to see it
            return
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidRequest(
                f"{param} is not valid Unicode text: a lone surrogate at character {exc.start}",
                param,
            ) from None
    elif isinstance(value, dict):
        for v in value.values():
            check_text(v, param)
    elif isinstance(value, list):
        for v in value:
            check_text(v, param)
