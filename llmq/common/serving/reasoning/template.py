"""reasoning_effort as a chat template variable: passed where the template has that knob,
refused (400 naming the field) where it does not, so that it is never silently dropped."""

from __future__ import annotations

from typing import Any

from llmq.common.errors import InvalidRequest

KNOB = "reasoning_effort"


def reasoning_template_kwargs(effort: str | None, template: Any) -> dict[str, str]:
    if effort is None:
        return {}
    if not isinstance(template, str) or KNOB not in template:
        raise InvalidRequest(
            "reasoning_effort is not supported by this model: its chat template has no "
            "reasoning_effort variable (chat_template_kwargs passes the template's own knobs, "
            "such as enable_thinking)",
            KNOB,
        )
    return {KNOB: effort}
