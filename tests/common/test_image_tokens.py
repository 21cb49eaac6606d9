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


def test_idefics3_text_and_count_equal_the_processors(tmp_path):
    """The prompt text the API writes for an image (tiles tagged by row and column, the whole
    image last) tokenizes to the processor's own ids, at every shape."""
    from PIL import Image
    from transformers import Idefics3ImageProcessorPil, Idefics3Processor

    from llmq.common.images.tokens import idefics3_text
    from llmq.tools.model_factory import train_tokenizer
    from llmq.tools.vision_models import IDEFICS3_TOKENS, vision_tokenizer

    tok = vision_tokenizer(tmp_path, train_tokenizer(1024))
    tok.add_special_tokens({"additional_special_tokens": ["<image>", *IDEFICS3_TOKENS]})
    images = Idefics3ImageProcessorPil(
        size={"longest_edge": 96}, max_image_size={"longest_edge": 24}
    )
    processor = Idefics3Processor(image_processor=images, tokenizer=tok, image_seq_len=4)
    layout = {"family": "idefics3", "longest": 96, "tile": 24, "seq": 4}
    image_id = tok.convert_tokens_to_ids("<image>")
    for width, height in _sizes()[:80] + [(24, 24), (25, 24), (97, 30), (5000, 300)]:
        theirs = processor(images=[Image.new("RGB", (width, height))], text="a<image>b")
        ours = tok("a" + idefics3_text(layout, width, height) + "b")["input_ids"]
        assert list(theirs["input_ids"][0]) == ours, (width, height)
        assert ours.count(image_id) == image_token_count(layout, width, height)
