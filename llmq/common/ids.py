"""Ids of Batch API objects: made here, and checked before any Redis key is built from one
that came in a URL path."""

from __future__ import annotations

import re
import uuid

_ID = re.compile(r"(file|batch)-[0-9a-f]{32}")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def is_id(prefix: str, value: str) -> bool:
    """Whether ``value`` has the form ``new_id(prefix)`` gives: ids from URL paths are checked
    before any key is built from them (``x:content`` named another object's key)."""
    match = _ID.fullmatch(value)
    return match is not None and match.group(1) == prefix


def text(value) -> str:
    """A Redis reply as text."""
    return value.decode() if isinstance(value, bytes) else str(value)
