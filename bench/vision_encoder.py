"""The vision encoder's time per image on this machine: LLaVA-1.5's image encoder (CLIP
ViT-L/14 at 336 x 336, its second-to-last layer, the two-layer projector to 4096),
SmolVLM-256M's (``--family smolvlm``), Qwen2.5-VL-3B's (``--family qwen``) or Gemma 3 4B's
(``--family gemma3``), with random
weights, run by llmq's encoders (the image processor's PIL path included) on batches of
640 x 480 images; the median of ``--rounds`` runs per batch.

    .venv/bin/python bench/vision_encoder.py                    # float32, 1 and 4 images
    .venv/bin/python bench/vision_encoder.py --dtype bfloat16 --rounds 3
    .venv/bin/python bench/vision_encoder.py --family smolvlm --batches 1 --rounds 2
    .venv/bin/python bench/vision_encoder.py --family qwen --batches 1 --rounds 2
    .venv/bin/python bench/vision_encoder.py --family gemma3 --batches 1 --rounds 1
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import time

import torch
from PIL import Image


def encoder(dtype: torch.dtype):
    from transformers import (
        CLIPImageProcessorPil,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )

    from llmq.worker.vision.llava import LlavaEncoder

    vision = CLIPVisionConfig(
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=24,
        num_attention_heads=16,
        image_size=336,
        patch_size=14,
        projection_dim=768,
    )
    # The text model is tiny: only the tower and the projector (to 4096) are timed.
    text = LlamaConfig(hidden_size=4096, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=32, vocab_size=64)  # fmt: skip
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_id=63)
    model = LlavaForConditionalGeneration(config).to(dtype).eval()
    size = {"shortest_edge": 336}
    processor = CLIPImageProcessorPil(size=size, crop_size={"height": 336, "width": 336})
    return LlavaEncoder(model, processor)


def smolvlm_encoder(dtype: torch.dtype):
    """SmolVLM-256M's image encoder: SigLIP-B/16 at 512 x 512 tiles, pixel shuffle by 4 (64
    tokens a tile), images resized to 2048 on their longest side (a 640 x 480 photo: 4 x 3
    tiles and the whole image, 832 tokens)."""
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessorPil,
        Idefics3VisionConfig,
        LlamaConfig,
    )

    from llmq.worker.vision.idefics3 import Idefics3Encoder

    vision = Idefics3VisionConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                  num_attention_heads=12, image_size=512, patch_size=16)  # fmt: skip
    text = LlamaConfig(hidden_size=576, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=9, num_key_value_heads=3, vocab_size=64)  # fmt: skip
    config = Idefics3Config(vision_config=vision, text_config=text, scale_factor=4,
                            image_token_id=63)  # fmt: skip
    model = Idefics3ForConditionalGeneration(config).to(dtype).eval()
    images = Idefics3ImageProcessorPil(
        size={"longest_edge": 2048}, max_image_size={"longest_edge": 512}
    )
    return Idefics3Encoder(model, images)


def qwen_encoder(dtype: torch.dtype):
    """Qwen2.5-VL-3B's image encoder: a 32-block ViT of width 1280 on 14-pixel patches (window
    attention in 28 blocks, full in 4), merged 2 x 2 to 2048; a 640 x 480 photo resized to
    644 x 476: 23 x 17 = 391 tokens."""
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLImageProcessorPil,
    )

    from llmq.worker.vision.qwen2_5_vl import Qwen2_5_VLEncoder

    vision = dict(
        depth=32,
        hidden_size=1280,
        intermediate_size=3420,
        num_heads=16,
        out_hidden_size=2048,
        window_size=112,
        fullatt_block_indexes=[7, 15, 23, 31],
    )
    text = dict(hidden_size=2048, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=16, num_key_value_heads=2, vocab_size=64)  # fmt: skip
    config = Qwen2_5_VLConfig(vision_config=vision, text_config=text, image_token_id=63)
    model = Qwen2_5_VLForConditionalGeneration(config).to(dtype).eval()
    images = Qwen2VLImageProcessorPil(size={"shortest_edge": 3136, "longest_edge": 12845056})
    return Qwen2_5_VLEncoder(model, images)


def gemma3_encoder(dtype: torch.dtype):
    """Gemma 3 4B's image encoder: SigLIP-So400m/14 at 896 x 896 (4096 patches), pooled 4 x 4
    into 256 tokens, projected to 2560; every image resized to 896 x 896."""
    from types import SimpleNamespace

    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3ImageProcessorPil,
        SiglipVisionConfig,
    )

    from llmq.worker.vision.gemma3 import Gemma3Encoder

    vision = SiglipVisionConfig(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27,
                                num_attention_heads=16, image_size=896, patch_size=14)  # fmt: skip
    text = dict(hidden_size=2560, intermediate_size=64, num_hidden_layers=1, head_dim=64,
                num_attention_heads=8, num_key_value_heads=4, vocab_size=64)  # fmt: skip
    config = Gemma3Config(vision_config=vision, text_config=text, image_token_index=63,
                          boi_token_index=61, eoi_token_index=62)  # fmt: skip
    model = Gemma3ForConditionalGeneration(config).to(dtype).eval()
    images = Gemma3ImageProcessorPil(size={"height": 896, "width": 896})
    # The processor's attributes the encoder reads (no tokenizer needed to time the tower).
    processor = SimpleNamespace(image_processor=images, boi_token="<start_of_image>",
                                full_image_sequence="")  # fmt: skip
    return Gemma3Encoder(model, processor)


def png(seed: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (480, 640, 3), generator=g, dtype=torch.uint8).numpy()
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--family", default="llava", choices=["llava", "smolvlm", "qwen", "gemma3"])
    parser.add_argument("--batches", default="1,4", help="images per call, comma-separated")
    args = parser.parse_args()
    build = {"llava": encoder, "smolvlm": smolvlm_encoder, "qwen": qwen_encoder,
             "gemma3": gemma3_encoder}[args.family]  # fmt: skip
    enc = build(getattr(torch, args.dtype))
    images = [png(s) for s in range(4)]
    enc.encode(images[:1])  # warm
    report = {
        "family": args.family,
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "tokens": enc.token_count(images[0]),
    }
    for n in map(int, args.batches.split(",")):
        times = []
        for _ in range(args.rounds):
            start = time.perf_counter()
            feats = enc.encode(images[:n])
            times.append(time.perf_counter() - start)
        assert len(feats) == n and feats[0].shape[0] == report["tokens"]
        median = statistics.median(times)
        report[f"batch_{n}_s"] = round(median, 3)
        report[f"batch_{n}_per_image_s"] = round(median / n, 3)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
