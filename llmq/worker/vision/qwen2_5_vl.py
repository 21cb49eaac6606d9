"""Qwen2.5-VL on the worker: its text model under the engine (a Qwen 2 decoder that llmq's own
forward and fused C++ step run: its rotary embedding module turns each row's three M-RoPE
positions into that row's cos and sin, which the layers take per row), and its image encoder
(the checkpoint's processor's resize and patches, transformers' vision tower with its window
attention and patch merger)."""

from __future__ import annotations

import io

import torch
from PIL import Image
from transformers import GenerationMixin
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
    Qwen2_5_VLPreTrainedModel,
    Qwen2_5_VLTextModel,
)

from llmq.common.images.tokens import image_token_count, qwen2_5_vl_grid


class Qwen2_5_VLTextLM(Qwen2_5_VLPreTrainedModel, GenerationMixin):
    """Qwen2.5-VL's text model and head as a causal LM: ``position_ids`` of shape
    (3, 1, tokens) carry each row's (temporal, height, width) position."""

    def __init__(self, config):
        super().__init__(config)
        self.model = Qwen2_5_VLTextModel(config)
        self.lm_head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(
        self,
        input_ids=None,
        position_ids=None,
        inputs_embeds=None,
        use_cache=False,
        logits_to_keep=0,
        **kwargs,
    ):
        out = self.model(
            input_ids=input_ids,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        hidden = out.last_hidden_state
        rows = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        return CausalLMOutputWithPast(logits=self.lm_head(hidden[:, rows]))


class Qwen2_5_VLEncoder:
    """Images -> one [rows x cols, hidden] tensor each (an image's tokens row by row), all of
    a step's images in one tower call; ``grid`` gives the rows and columns M-RoPE numbers."""

    mrope = True

    def __init__(self, vlm, processor):
        self.model = vlm.model
        config = vlm.config
        self.image_token_id = int(config.image_token_id)
        self.processor = processor
        size = processor.size
        self.layout = {"family": "qwen2_5_vl", "patch": int(processor.patch_size),
                       "merge": int(processor.merge_size),
                       "min_pixels": int(size["shortest_edge"]),
                       "max_pixels": int(size["longest_edge"])}  # fmt: skip

    def token_count(self, data: bytes) -> int:
        with Image.open(io.BytesIO(data)) as image:
            return image_token_count(self.layout, *image.size)

    def grid(self, data: bytes) -> tuple[int, int]:
        with Image.open(io.BytesIO(data)) as image:
            return qwen2_5_vl_grid(self.layout, *image.size)

    @torch.inference_mode()
    def encode(self, images: list[bytes]) -> list[torch.Tensor]:
        pil = [Image.open(io.BytesIO(data)).convert("RGB") for data in images]
        inputs = self.processor(pil, return_tensors="pt")
        visual = self.model.visual
        out = self.model.get_image_features(
            pixel_values=inputs["pixel_values"].to(device=visual.device, dtype=visual.dtype),
            image_grid_thw=inputs["image_grid_thw"].to(visual.device),
        )
        return list(out.pooler_output)


def load_qwen2_5_vl(path: str, dtype: torch.dtype, device: str):
    """(the text model as a causal LM sharing the checkpoint's modules, the image encoder)."""
    from transformers import AutoImageProcessor, Qwen2_5_VLForConditionalGeneration

    vlm = Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=dtype)
    vlm = vlm.to(device).eval()
    text = vlm.model.language_model
    # The wrapper is built on the meta device: its own weights are replaced at once.
    with torch.device("meta"):
        lm = Qwen2_5_VLTextLM(text.config)
    lm.model = text
    lm.lm_head = vlm.lm_head
    lm.config = text.config
    lm.generation_config = vlm.generation_config
    lm.config.llmq_random_weights = getattr(vlm.config, "llmq_random_weights", False)
    lm.config.name_or_path = path
    lm.eval()
    return lm, Qwen2_5_VLEncoder(vlm, AutoImageProcessor.from_pretrained(path))
