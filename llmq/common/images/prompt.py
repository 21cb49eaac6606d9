"""A vision-language model's prompt: each image token the chat template placed becomes the
run of image tokens the model reads the image's embeddings at (counted from the image's size
and the layout the worker's heartbeat gives), so the context check and ``usage`` count an
image as the model does."""

from __future__ import annotations

from collections.abc import Callable

from llmq.common.engine_client.prompt_encoder import context_exceeded
from llmq.common.engine_status import EngineStatus
from llmq.common.errors import InvalidRequest
from llmq.common.images.decode import CheckedImage
from llmq.common.images.tokens import image_text, image_token_count, parse_layout


def expand_images(
    prompt_ids: list[int], engine: EngineStatus, images: list[CheckedImage]
) -> list[int]:
    """``prompt_ids`` with each image token repeated as many times as the model reads its
    image; a 400 where the template placed another number of images than the request sent, or
    where the prompt then passes the context."""
    token = engine.image_token_id
    placed = prompt_ids.count(token)
    if placed != len(images):
        raise InvalidRequest(
            f"the chat template placed {placed} images for the {len(images)} sent (an image "
            "token typed in the text, or a template that drops images)",
            "messages",
        )
    counts = iter([image_tokens(engine, i) for i in images])
    out: list[int] = []
    for t in prompt_ids:
        if t == token:
            out.extend([token] * next(counts))
        else:
            out.append(t)
    if len(out) >= engine.max_model_len:
        raise context_exceeded(engine.max_model_len, len(out), "messages")
    return out


def image_tokens(engine: EngineStatus, image: CheckedImage) -> int:
    """The tokens ``engine``'s model reads for ``image``."""
    return image_token_count(parse_layout(engine.image_layout), image.width, image.height)


# Families whose processor puts text around the image tokens: expanded in the rendered text.
TEXT_EXPANDED = frozenset({"idefics3", "gemma3"})


def text_expansion(engine: EngineStatus, images: list[CheckedImage]) -> Callable[[str], str] | None:
    """For a family of TEXT_EXPANDED, what turns the rendered prompt's image placeholders into
    the processor's text for each image; None: the ids are expanded (``expand_images``)."""
    layout = parse_layout(engine.image_layout)
    if not images or layout.get("family") not in TEXT_EXPANDED:
        return None

    def expand(text: str) -> str:
        pieces = text.split(layout["placeholder"])
        if len(pieces) - 1 != len(images):
            raise InvalidRequest(
                f"the chat template placed {len(pieces) - 1} images for the {len(images)} sent",
                "messages",
            )
        parts = [pieces[0]]
        for image, piece in zip(images, pieces[1:], strict=True):
            parts += [image_text(layout, image.width, image.height), piece]
        return "".join(parts)

    return expand
