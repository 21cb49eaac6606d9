"""CLI flags onto settings: each flag given becomes its ``LLMQ_`` variable, which the Settings
class reads and child processes inherit."""

from __future__ import annotations

import os


def override_settings(**values: object) -> None:
    """Set ``LLMQ_{NAME}`` for every value that is not None and drop the cached settings."""
    from llmq.common.settings import get_settings

    for name, value in values.items():
        if value is not None:
            os.environ[f"LLMQ_{name.upper()}"] = str(value)
    get_settings.cache_clear()
