"""The API's count of an image's tokens (llmq/common/images/tokens.py) equals what the
model's own processor expands the image to, for LLaVA-1.5 and for LLaVA-NeXT's tile grids at
every aspect ratio (the processor's count is what the model checks its features against)."""

from __future__ import annotations

import random

import pytest

from llmq.common.images.tokens import best_resolution, image_token_count

pytestmark = pytest.mark.unit

SIZES = [(40, 50), (50, 40), (30, 30), (100, 20), (20, 100), (640, 480), (1000, 1), (1, 1000)]


def _sizes() -> list[tuple[int, int]]:
    rng = random.Random(0)
    return SIZES + [(rng.randint(1, 2000), rng.randint(1, 2000)) for _ in range(200)]


@pytest.mark.parametrize(
    "grid, tile, patch",
    [
        ([[30, 60], [60, 30], [60, 60]], 30, 6),  # the tiny test model's
        ([[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]], 336, 14),  # 1.6's
    ],
)
def test_llava_next_counts_equal_the_processors(tmp_path, grid, tile, patch):
    from transformers import LlavaNextImageProcessorPil, LlavaNextProcessor

    from llmq.tools.model_factory import train_tokenizer
    from llmq.tools.vision_models import vision_tokenizer

    images = LlavaNextImageProcessorPil(
        size={"shortest_edge": tile}, crop_size={"height": tile, "width": tile},
        image_grid_pinpoints=grid,
    )  # fmt: skip
    processor = LlavaNextProcessor(
        image_processor=images,
        tokenizer=vision_tokenizer(tmp_path, train_tokenizer(1024)),
        patch_size=patch,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
    )
    layout = {"family": "llava_next", "tile": tile, "patch": patch, "grid": grid, "cls": 0}
    for width, height in _sizes():
        theirs = processor._get_num_multimodal_tokens(image_sizes=[(height, width)])
        assert image_token_count(layout, width, height) == theirs["num_image_tokens"][0], (
            width,
            height,
        )


def test_the_grid_keeps_most_pixels_then_pads_least():
    grid = [[30, 60], [60, 30], [60, 60]]
    assert best_resolution(80, 30, grid) == (30, 60)  # wide: one row of two tiles
    assert best_resolution(20, 70, grid) == (60, 30)
    assert best_resolution(50, 50, grid) == (60, 60)
    assert image_token_count({"family": "llava", "tokens": 576}, 1, 1) == 576
