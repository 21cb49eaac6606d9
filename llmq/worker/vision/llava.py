"""LLaVA-1.5 and LLaVA-NeXT on the worker: the checkpoint split into its text model, served by the engine as
any Llama (the fast path for text), and its image encoder (the CLIP tower and the projector),
which turns images into the embeddings placed at the prompt's image tokens."""

from __future__ import annotations

import io

import torch
from PIL import Image

from llmq.common.images.tokens import image_token_count


class LlavaEncoder:
    """Images -> one [tokens, hidden] tensor each, in one batched tower call; the
    preprocessing is the checkpoint's own image processor (its PIL form: no torchvision).
    LLaVA-NeXT's tiles ("anyres") are packed as transformers packs them: unpadded, a newline
    embedding per row, after the base tile."""

    def __init__(self, llava, processor):
        self.model = llava.model
        self.config = config = llava.config
        self.image_token_id = int(config.image_token_id)
        self.processor = processor
        vision = config.vision_config
        cls = 1 if config.vision_feature_select_strategy == "full" else 0
        self.anyres = config.model_type == "llava_next"
        if self.anyres:
            grid = [list(map(int, hw)) for hw in config.image_grid_pinpoints]
            self.layout = {"family": "llava_next", "tile": vision.image_size,
                           "patch": vision.patch_size, "grid": grid, "cls": cls}  # fmt: skip
        else:
            side = vision.image_size // vision.patch_size
            self.layout = {"family": "llava", "tokens": side * side + cls}

    def token_count(self, data: bytes) -> int:
        with Image.open(io.BytesIO(data)) as image:
            return image_token_count(self.layout, *image.size)

    @torch.inference_mode()
    def encode(self, images: list[bytes]) -> list[torch.Tensor]:
        pil = [Image.open(io.BytesIO(data)).convert("RGB") for data in images]
        tower = self.model.vision_tower
        inputs = self.processor(pil, return_tensors="pt")
        extra = {"image_sizes": inputs["image_sizes"]} if self.anyres else {}
        out = self.model.get_image_features(
            pixel_values=inputs["pixel_values"].to(device=tower.device, dtype=tower.dtype),
            vision_feature_layer=self.config.vision_feature_layer,
            vision_feature_select_strategy=self.config.vision_feature_select_strategy,
            **extra,
        )
        return list(out.pooler_output)


def load_vision_lm(path: str, dtype: torch.dtype, device: str):
    """(the text model as a causal LM sharing the checkpoint's modules, the image encoder) of
    a LLaVA-1.5, LLaVA-NeXT, Idefics3 or Gemma 3 folder."""
    from transformers import (
        AutoImageProcessor,
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        AutoProcessor,
    )

    from llmq.worker.vision.gemma3 import Gemma3Encoder
    from llmq.worker.vision.idefics3 import Idefics3Encoder

    vlm = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype).to(device).eval()
    idefics = vlm.config.model_type == "idefics3"
    text_config = vlm.config.text_config
    # The wrapper is built on the meta device: its own weights are replaced at once.
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(text_config, dtype=dtype)
    lm.model = vlm.model.text_model if idefics else vlm.model.language_model
    lm.lm_head = vlm.lm_head
    lm.generation_config = vlm.generation_config
    lm.config.llmq_random_weights = getattr(vlm.config, "llmq_random_weights", False)
    lm.config.name_or_path = path
    lm.eval()
    if vlm.config.model_type == "gemma3":  # its processor writes the image's tokens
        return lm, Gemma3Encoder(vlm, AutoProcessor.from_pretrained(path))
    images = AutoImageProcessor.from_pretrained(path)
    encoder = Idefics3Encoder(vlm, images) if idefics else LlavaEncoder(vlm, images)
    return lm, encoder
