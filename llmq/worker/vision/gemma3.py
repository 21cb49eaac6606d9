"""Gemma 3 on the worker: its image encoder (the SigLIP tower, the average-pool projector),
with the checkpoint's own processor. An image's tokens attend to each other both ways
(``bidirectional``): the backend gives each image's run to its sequence, which keeps the run
inside one prefill chunk and lets its queries see the run's later keys."""

from __future__ import annotations

import io

import torch
from PIL import Image

from llmq.worker.request_error import RequestError
from llmq.worker.vision.runtime import ImageSpan


class Gemma3Encoder:
    """Images -> one [mm_tokens_per_image, hidden] tensor each, in one tower call. The image
    features are placed unscaled: only the text's embeddings carry Gemma's sqrt(hidden)."""

    bidirectional = True

    def __init__(self, model, processor):
        self.model = model.model
        self.image_token_id = int(model.config.image_token_id)
        self.images = processor.image_processor
        tokens = int(model.config.mm_tokens_per_image)
        # What the processor writes for each image placeholder of the chat template.
        self.layout = {"family": "gemma3", "tokens": tokens, "placeholder": processor.boi_token,
                       "text": processor.full_image_sequence}  # fmt: skip

    def token_count(self, data: bytes) -> int:
        return int(self.layout["tokens"])

    @torch.inference_mode()
    def encode(self, images: list[bytes]) -> list[torch.Tensor]:
        pil = [Image.open(io.BytesIO(data)).convert("RGB") for data in images]
        pixels = self.images(pil, do_pan_and_scan=False, return_tensors="pt")["pixel_values"]
        tower = self.model.vision_tower
        out = self.model.get_image_features(pixels.to(device=tower.device, dtype=tower.dtype))
        return list(out.pooler_output)


def bidirectional_runs(spans: list[ImageSpan], most: int) -> list[tuple[int, int]]:
    """The prompt's runs [start, end) of image tokens that attend to each other both ways
    (adjacent spans one run, as transformers groups consecutive image tokens); a RequestError
    where one is longer than a step's ``most`` tokens: it could never be computed whole."""
    runs: list[tuple[int, int]] = []
    for span in spans:
        if runs and runs[-1][1] == span.start:
            runs[-1] = (runs[-1][0], span.start + span.count)
        else:
            runs.append((span.start, span.start + span.count))
    for first, last in runs:
        if last - first > most:
            raise RequestError(
                f"an image of {last - first} tokens is computed in one step; "
                f"LLMQ_MAX_BATCH_TOKENS is {most}"
            )
    return runs
