"""The limits a generation request puts on its prompt's tokens (``PromptLimits``), from its
context and ``truncate_prompt_tokens``, as ``choices.truncated`` keeps them."""

from __future__ import annotations

from llmq.common.engine_client.prompt_encoder import PromptLimits
from llmq.common.serving.request_bodies import SamplingFields


def prompt_limits(body: SamplingFields, context: int, extra: int = 0) -> PromptLimits:
    """``extra``: tokens kept beyond ``truncate_prompt_tokens``' (one more tells whether the
    prompt was cut)."""
    keep = body.truncate_prompt_tokens
    if keep == -1:
        keep = max(1, context - (body.wanted_max_tokens() or 1))
    return PromptLimits(context, None if keep is None else keep + extra)
