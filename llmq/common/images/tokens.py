"""How many tokens a vision-language model reads for an image, from the image's size and the
model's image layout (its worker's heartbeat, ``image_layout``): the API counts them for the
context check and ``usage``, the worker checks a prompt's image runs against them.

LLaVA-1.5: one tile, a fixed count. LLaVA-NeXT ("anyres"): the image is fitted to the grid
resolution that keeps most of its pixels (least padding on ties), cut into tiles of the tower's
size, their features unpadded back to the image's aspect ratio with a newline embedding per
row, after the base tile's features."""

from __future__ import annotations

import json
from typing import Any


def parse_layout(text: str) -> dict[str, Any]:
    return json.loads(text) if text else {}


def image_token_count(layout: dict[str, Any], width: int, height: int) -> int:
    family = layout.get("family")
    if family == "llava":
        return int(layout["tokens"])
    if family == "llava_next":
        return _anyres_count(layout, width, height)
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
