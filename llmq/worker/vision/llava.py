"""LLaVA-1.5 on the worker: the checkpoint split into its text model, served by the engine as
any Llama (the fast path for text), and its image encoder (the CLIP tower and the projector),
which turns images into the embeddings placed at the prompt's image tokens."""

from __future__ import annotations

import io

import torch
from PIL import Image


class LlavaEncoder:
    """Images -> one [tokens_per_image, hidden] tensor each, in one batched tower call; the
    preprocessing is the checkpoint's own image processor (its PIL form: no torchvision)."""

    def __init__(self, llava, processor):
        self.model = llava.model
        self.config = llava.config
        self.image_token_id = int(llava.config.image_token_id)
        self.processor = processor
        vision = llava.config.vision_config
        side = vision.image_size // vision.patch_size
        cls = 1 if llava.config.vision_feature_select_strategy == "full" else 0
        self.tokens_per_image = side * side + cls

    @torch.inference_mode()
    def encode(self, images: list[bytes]) -> list[torch.Tensor]:
        pil = [Image.open(io.BytesIO(data)).convert("RGB") for data in images]
        tower = self.model.vision_tower
        pixels = self.processor(pil, return_tensors="pt")["pixel_values"]
        pixels = pixels.to(device=tower.device, dtype=tower.dtype)
        out = self.model.get_image_features(
            pixel_values=pixels,
            vision_feature_layer=self.config.vision_feature_layer,
            vision_feature_select_strategy=self.config.vision_feature_select_strategy,
        )
        return list(out.pooler_output)


def load_llava(path: str, dtype: torch.dtype, device: str):
    """(the text model as a causal LM sharing the checkpoint's modules, the image encoder)."""
    from transformers import AutoImageProcessor, AutoModelForCausalLM, LlavaForConditionalGeneration

    llava = LlavaForConditionalGeneration.from_pretrained(path, dtype=dtype).to(device).eval()
    text_config = llava.config.text_config
    # The wrapper is built on the meta device: its own weights are replaced at once.
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(text_config, dtype=dtype)
    lm.model = llava.model.language_model
    lm.lm_head = llava.lm_head
    lm.generation_config = llava.generation_config
    lm.config.llmq_random_weights = getattr(llava.config, "llmq_random_weights", False)
    lm.config.name_or_path = path
    lm.eval()
    return lm, LlavaEncoder(llava, AutoImageProcessor.from_pretrained(path))
