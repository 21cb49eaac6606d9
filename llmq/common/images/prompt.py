"""A vision-language model's prompt: each image token the chat template placed becomes the
run of image tokens the model reads the image's embeddings at (the count the worker's
heartbeat gives), so the context check and ``usage`` count an image as the model does."""

from __future__ import annotations

from llmq.common.engine_status import EngineStatus
from llmq.common.errors import InvalidRequest
from llmq.common.prompt_encoder import context_exceeded


def expand_images(prompt_ids: list[int], engine: EngineStatus, count: int) -> list[int]:
    """``prompt_ids`` with each image token repeated ``engine.image_tokens`` times; a 400 where
    the template placed another number of images than the request sent, or where the prompt
    then passes the context."""
    token, each = engine.image_token_id, engine.image_tokens
    placed = prompt_ids.count(token)
    if placed != count:
        raise InvalidRequest(
            f"the chat template placed {placed} images for the {count} sent (an image token "
            "typed in the text, or a template that drops images)",
            "messages",
        )
    out: list[int] = []
    for t in prompt_ids:
        if t == token:
            out.extend([token] * each)
        else:
            out.append(t)
    if len(out) >= engine.max_model_len:
        raise context_exceeded(engine.max_model_len, len(out), "messages")
    return out
