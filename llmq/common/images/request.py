"""A request's images, in the order they stand: counted, each decoded and checked (a link's
address checked before anything is fetched), refused by a model that takes no images, then
stored once in Redis under its content hash, where the worker reads it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import httpx

from llmq.common.errors import InvalidRequest
from llmq.common.images.decode import CheckedImage, check_image, data_url_bytes, image_error
from llmq.common.images.fetch import checked_address, fetch_image
from llmq.common.settings import get_settings


@dataclass(frozen=True, slots=True)
class ImageRef:
    """An image part: where it stands (the request's param path), its URL (data or http(s))
    and the detail asked for."""

    where: str
    url: str
    detail: str | None = None

    @property
    def inline(self) -> bool:
        return self.url[:5].lower() == "data:"


def chat_image_refs(messages) -> list[ImageRef]:
    """The image parts of a chat request's messages (ChatMessage objects)."""
    refs = []
    for i, message in enumerate(messages):
        if not isinstance(message.content, list):
            continue
        for j, part in enumerate(message.content):
            if part.type == "image_url":
                where = f"messages[{i}].content[{j}].image_url"
                refs.append(ImageRef(where, part.image_url.url, part.image_url.detail))
    return refs


def check_count(refs: list[ImageRef]) -> None:
    most = get_settings().max_images
    if len(refs) > most:
        raise InvalidRequest(
            f"the request holds {len(refs)} images; at most {most} per request (LLMQ_MAX_IMAGES)",
            "messages",
            "too_many_images",
        )


async def checked_images(
    refs: list[ImageRef], model: str, takes_images: bool
) -> list[CheckedImage]:
    """The request's images checked, in order. Everything that needs no network comes first
    (the count, inline images decoded, links to an address checked), then a text model's
    refusal, and only then are links' names resolved and checked and the links fetched."""
    check_count(refs)
    inline: dict[int, CheckedImage] = {}
    for n, ref in enumerate(refs):
        if ref.inline:
            data = data_url_bytes(ref.url, ref.where)
            inline[n] = await asyncio.to_thread(check_image, data, ref.where)
        else:
            await checked_address(_url(ref), ref.where, names=False)
    if not takes_images:
        raise InvalidRequest(
            f"the model {model!r} is a text model: it does not take images (send the content "
            "as text, or serve a vision-language model)",
            refs[0].where,
            "images_not_supported",
        )
    images = []
    for n, ref in enumerate(refs):
        if n not in inline:
            data = await fetch_image(ref.url, ref.where)
            inline[n] = await asyncio.to_thread(check_image, data, ref.where)
        images.append(inline[n])
    return images


def _url(ref: ImageRef) -> httpx.URL:
    try:
        return httpx.URL(ref.url)
    except httpx.InvalidURL as exc:
        raise image_error(ref.where, f"the image link is not a valid URL: {exc}") from None


async def store_images(redis, key_of, images: list[CheckedImage], ttl: int) -> None:
    """Each image's bytes under ``key_of(digest)`` for ``ttl`` seconds: sent once (a stored
    image only has its expiry renewed)."""
    for image in {i.digest: i for i in images}.values():
        key = key_of(image.digest)
        if not await redis.expire(key, ttl):
            await redis.set(key, image.data, ex=ttl)
