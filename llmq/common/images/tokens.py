"""How many tokens a vision-language model reads for an image, from the image's size and the
model's image layout (its worker's heartbeat, ``image_layout``): the API counts them for the
context check and ``usage``, the worker checks a prompt's image runs against them.

LLaVA-1.5: one tile, a fixed count. LLaVA-NeXT ("anyres"): the image is fitted to the grid
resolution that keeps most of its pixels (least padding on ties), cut into tiles of the tower's
size, their features unpadded back to the image's aspect ratio with a newline embedding per
row, after the base tile's features. Idefics3 (SmolVLM): tiles of a grid the image is
resized onto, each tagged with its row and column in the prompt, then the whole image; the
prompt's text around the image tokens is the processor's (``idefics3_text``). Gemma 3: a
fixed count (pan-and-scan off), between its begin- and end-of-image tokens (``image_text``)."""

from __future__ import annotations

import json
import math
from typing import Any

from llmq.common.errors import InvalidRequest


def parse_layout(text: str) -> dict[str, Any]:
    return json.loads(text) if text else {}


def image_text(layout: dict[str, Any], width: int, height: int) -> str:
    """What the processor of a family that writes text around its image tokens puts in the
    prompt for an image: Gemma 3's is the same for every image (``text``)."""
    if layout.get("family") == "gemma3":
        return str(layout["text"])
    return idefics3_text(layout, width, height)


def image_token_count(layout: dict[str, Any], width: int, height: int) -> int:
    family = layout.get("family")
    if family in ("llava", "gemma3"):
        return int(layout["tokens"])
    if family == "llava_next":
        return _anyres_count(layout, width, height)
    if family == "idefics3":
        rows, cols = idefics3_grid(layout, width, height)
        return (rows * cols + 1 if rows else 1) * int(layout["seq"])
    if family == "qwen2_5_vl":
        rows, cols = qwen2_5_vl_grid(layout, width, height)
        return rows * cols
    raise ValueError(f"no image token count for the image layout {layout!r}")


def best_resolution(width: int, height: int, grid: list[list[int]]) -> tuple[int, int]:
    """The (height, width) of ``grid`` keeping most of the image's pixels once it is scaled to
    fit; on a tie, the one with the least padding."""
    best, most_kept, least_waste = (0, 0), -1, float("inf")
    for h, w in grid:
        scale = min(w / width, h / height)
        kept = min(int(width * scale) * int(height * scale), width * height)
        waste = w * h - kept
        if kept > most_kept or (kept == most_kept and waste < least_waste):
            best, most_kept, least_waste = (h, w), kept, waste
    return best


def _anyres_count(layout: dict[str, Any], width: int, height: int) -> int:
    tile, patch = int(layout["tile"]), int(layout["patch"])
    grid_h, grid_w = best_resolution(width, height, layout["grid"])
    side = tile // patch
    rows, cols = side * (grid_h // tile), side * (grid_w // tile)
    if width / height > cols / rows:  # wider than the grid: rows of padding top and bottom
        fitted = int(round(height * (cols / width), 7))
        rows -= (rows - fitted) // 2 * 2
    else:
        fitted = int(round(width * (rows / height), 7))
        cols -= (cols - fitted) // 2 * 2
    base = side * side + int(layout.get("cls", 0))
    return rows * cols + rows + base


# Idefics3's bound on a resized image's longest side (its processor's MAX_IMAGE_SIZE).
_IDEFICS3_MAX_SIDE = 4096


def idefics3_grid(layout: dict[str, Any], width: int, height: int) -> tuple[int, int]:
    """The (rows, columns) of tiles Idefics3's processor cuts the image into (0, 0: the image
    alone): its longest side resized to ``longest`` (even sides), then both sides rounded up
    to whole tiles."""
    longest, tile = int(layout["longest"]), int(layout["tile"])
    ratio = width / height
    if width >= height:
        w, h = longest, int(longest / ratio)
        h += h % 2
    else:
        h, w = longest, int(longest * ratio)
        w += w % 2
    h, w = max(h, 1), max(w, 1)
    if max(h, w) > _IDEFICS3_MAX_SIDE:
        ratio = w / h
        if w >= h:
            w, h = _IDEFICS3_MAX_SIDE, int(_IDEFICS3_MAX_SIDE / ratio)
        else:
            h, w = _IDEFICS3_MAX_SIDE, int(_IDEFICS3_MAX_SIDE * ratio)
        h, w = max(h, 1), max(w, 1)
    ratio = w / h
    if w >= h:
        w = math.ceil(w / tile) * tile
        h = math.ceil(int(w / ratio) / tile) * tile
    else:
        h = math.ceil(h / tile) * tile
        w = math.ceil(int(h * ratio) / tile) * tile
    if h > tile or w > tile:
        return (h - tile) // tile + 1, (w - tile) // tile + 1
    return 0, 0


def idefics3_text(layout: dict[str, Any], width: int, height: int) -> str:
    """What Idefics3's processor puts in the prompt for the image: each tile's image tokens
    after its row and column tag (a newline after each row), then the whole image's."""
    rows, cols = idefics3_grid(layout, width, height)
    fake, image = "<fake_token_around_image>", "<image>" * int(layout["seq"])
    whole = f"{fake}<global-img>{image}{fake}"
    if not rows:
        return whole
    tiles = "".join(
        "".join(f"{fake}<row_{r + 1}_col_{c + 1}>{image}" for c in range(cols)) + "\n"
        for r in range(rows)
    )
    return f"{tiles}\n{whole}"


def qwen2_5_vl_grid(layout: dict[str, Any], width: int, height: int) -> tuple[int, int]:
    """The (rows, columns) of image tokens Qwen2.5-VL reads for an image: its processor's
    ``smart_resize`` (each side rounded to whole ``patch * merge`` units, the area scaled into
    ``min_pixels``..``max_pixels`` keeping the aspect ratio), one token per unit."""
    factor = int(layout["patch"]) * int(layout["merge"])
    lo, hi = int(layout["min_pixels"]), int(layout["max_pixels"])
    if max(height, width) / min(height, width) > 200:
        raise InvalidRequest(
            f"an image of {width} x {height}: the model takes aspect ratios up to 200",
            "messages",
        )
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > hi:
        beta = math.sqrt((height * width) / hi)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < lo:
        beta = math.sqrt(lo / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h // factor, w // factor
