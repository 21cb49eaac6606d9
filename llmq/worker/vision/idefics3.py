"""Idefics3 (SmolVLM) on the worker: its image encoder (the vision transformer over each tile
and the whole image, the pixel-shuffle connector), with the checkpoint's image processor."""

from __future__ import annotations

import io

import torch
from PIL import Image

from llmq.common.images.tokens import image_token_count


class Idefics3Encoder:
    """Images -> one [tiles x image_seq_len, hidden] tensor each, the tiles in the order the
    prompt tags them, all images' tiles in one tower call."""

    def __init__(self, model, processor):
        self.model = model.model
        config = model.config
        self.image_token_id = int(config.image_token_id)
        self.processor = processor
        longest = processor.size["longest_edge"]
        tile = processor.max_image_size["longest_edge"]
        vision = config.vision_config
        seq = (vision.image_size // vision.patch_size) ** 2 // config.scale_factor**2
        self.layout = {"family": "idefics3", "longest": longest, "tile": tile, "seq": seq,
                       "placeholder": "<image>"}  # fmt: skip

    def token_count(self, data: bytes) -> int:
        with Image.open(io.BytesIO(data)) as image:
            return image_token_count(self.layout, *image.size)

    @torch.inference_mode()
    def encode(self, images: list[bytes]) -> list[torch.Tensor]:
        pil = [[Image.open(io.BytesIO(data)).convert("RGB")] for data in images]
        inputs = self.processor(pil, return_tensors="pt")
        vision = self.model.vision_model
        out = self.model.get_image_features(
            pixel_values=inputs["pixel_values"].to(device=vision.device, dtype=vision.dtype),
            pixel_attention_mask=inputs["pixel_attention_mask"].to(vision.device),
        )
        return list(out.pooler_output)
