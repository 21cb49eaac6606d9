"""The API's count of a Qwen2.5-VL image's tokens (``qwen2_5_vl_grid``, torch-free) equals
what the model's image processor resizes the image to, at many sizes and aspect ratios, for
the tiny test model's layout and for Qwen2.5-VL's own; an image past the processor's aspect
ratio bound is refused as the processor refuses it. The M-RoPE positions the worker gives a
prompt (``worker/vision/mrope.py``) equal transformers' ``get_rope_index``."""

from __future__ import annotations

import random

import numpy as np
import pytest

from llmq.common.errors import InvalidRequest
from llmq.common.images.tokens import image_token_count, qwen2_5_vl_grid

pytestmark = pytest.mark.unit

SIZES = [(40, 50), (80, 30), (50, 50), (20, 70), (1, 1), (3, 5), (7, 1000), (1000, 7)]
SIZES += [(4000, 3000), (28, 28), (29, 27), (12, 2000), (2000, 12)]


def _sizes() -> list[tuple[int, int]]:
    rng = random.Random(0)
    out = list(SIZES)
    while len(out) < 250:
        w, h = rng.randint(1, 3000), rng.randint(1, 3000)
        if max(w, h) / min(w, h) <= 200:
            out.append((w, h))
    return out


@pytest.mark.parametrize(
    "patch, merge, lo, hi",
    [(4, 2, 4 * 64, 64 * 64), (14, 2, 56 * 56, 28 * 28 * 1280)],  # tiny model's, Qwen2.5-VL's
)
def test_qwen2_5_vl_counts_equal_the_processors(patch, merge, lo, hi):
    from transformers import Qwen2VLImageProcessorPil

    processor = Qwen2VLImageProcessorPil(
        size={"shortest_edge": lo, "longest_edge": hi}, patch_size=patch, merge_size=merge
    )
    layout = {"family": "qwen2_5_vl", "patch": patch, "merge": merge,
              "min_pixels": lo, "max_pixels": hi}  # fmt: skip
    for width, height in _sizes():
        patches = processor.get_number_of_image_patches(height, width, {})
        assert image_token_count(layout, width, height) == patches // merge**2, (width, height)
    # The grid itself, through the processor's pixels: (rows, cols) = resized (h, w) / factor.
    for width, height in [(40, 50), (80, 30), (20, 70)]:
        image = np.zeros((height, width, 3), dtype=np.uint8)
        t, h, w = processor(image, return_tensors="np")["image_grid_thw"][0]
        assert (t, h // merge, w // merge) == (1, *qwen2_5_vl_grid(layout, width, height))


def test_an_image_past_the_aspect_ratio_bound_is_refused():
    layout = {"family": "qwen2_5_vl", "patch": 14, "merge": 2, "min_pixels": 3136,
              "max_pixels": 1003520}  # fmt: skip
    with pytest.raises(InvalidRequest, match="aspect ratios up to 200"):
        image_token_count(layout, 2010, 10)


def test_mrope_positions_equal_transformers_get_rope_index():
    """Two images of other grids between text: each token's (t, h, w) position, and the shift
    of the text after the last image, as transformers numbers them."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLModel

    from llmq.worker.vision.mrope import rope_index
    from llmq.worker.vision.runtime import image_spans

    config = Qwen2_5_VLConfig(
        text_config={"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                     "num_key_value_heads": 1, "intermediate_size": 16, "vocab_size": 64},
        vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2,
                       "out_hidden_size": 16},
        image_token_id=60,
    )  # fmt: skip
    grids = [(3, 5), (4, 2)]
    prompt = [1, 2, 3] + [60] * 15 + [4, 5] + [60] * 8 + [6, 7, 8, 9]
    spans = image_spans(prompt, 60, ["a", "b"], [15, 8])
    ours = rope_index(spans, grids)
    ids = torch.tensor([prompt])
    thw = torch.tensor([[1, 2 * r, 2 * c] for r, c in grids])
    theirs, delta = Qwen2_5_VLModel(config).get_rope_index(ids, (ids == 60).int(), thw)
    n = ours.table.shape[1]
    assert torch.equal(theirs[:, 0, :n], ours.table) and int(delta) == ours.delta
    assert torch.equal(theirs[:, 0, n:], torch.arange(n, len(prompt)).expand(3, -1) + ours.delta)
