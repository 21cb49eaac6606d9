"""A tiny random-weight Qwen2.5-VL (`llmq make-model --arch qwen2_5_vl`): the tiny text shape
with M-RoPE, a small vision tower (window attention in one block, full in the other), the
image processor's PIL form and the tokenizer with the vision tokens and a chat template that
places images. No processor is saved: Qwen2.5-VL's wants torchvision for its video processor,
which llmq does not install; the image processor and the tokenizer are all the worker reads."""

from __future__ import annotations

from pathlib import Path

from llmq.tools.vision_models import image_chat_template, vision_tokenizer

VISION_START, IMAGE_PAD, VISION_END, VIDEO_PAD = (
    "<|vision_start|>",
    "<|image_pad|>",
    "<|vision_end|>",
    "<|video_pad|>",
)
# Qwen2.5-VL's image placeholder where an image part stands.
QWEN_VL_CHAT_TEMPLATE = image_chat_template("<|vision_start|><|image_pad|><|vision_end|>")
# 4-pixel patches merged 2 x 2: an image token per 8 x 8 pixels; images resized to between
# 4 and 64 tokens. Windows of 16 pixels (2 x 2 tokens) in the window-attention block.
PATCH, MERGE = 4, 2
MIN_PIXELS, MAX_PIXELS = 4 * 64, 64 * 64
_VISION = dict(
    depth=2,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    patch_size=PATCH,
    spatial_merge_size=MERGE,
    temporal_patch_size=2,
    window_size=16,
    fullatt_block_indexes=[1],
    initializer_range=0.2,
)
# The tiny text shape's head dim is 16: 8 rotary frequencies split over (t, h, w).
MROPE_SECTION = [2, 3, 3]


def make_qwen2_5_vl(path: Path, shape: dict, ids: dict, base_tokenizer, seed: int) -> Path:
    """A Qwen2.5-VL of the tiny text shape (random q/k/v biases, norms perturbed), its tower's
    weights and norms wide, so that neither an image nor a position can be ignored unseen."""
    import torch
    import transformers as t

    from llmq.tools.model_archs import perturb

    path.mkdir(parents=True, exist_ok=True)
    tok = vision_tokenizer(path, base_tokenizer)
    tok.add_special_tokens(
        {"additional_special_tokens": [VISION_START, IMAGE_PAD, VISION_END, VIDEO_PAD]}
    )
    tok.chat_template = QWEN_VL_CHAT_TEMPLATE
    rope = {
        "rope_type": "default",
        "rope_theta": shape["rope_theta"],
        "mrope_section": MROPE_SECTION,
    }
    text = {k: v for k, v in shape.items() if k != "rope_theta"}
    config = t.Qwen2_5_VLConfig(
        text_config={**text, "vocab_size": len(tok), "rope_parameters": rope, **ids},
        vision_config={**_VISION, "out_hidden_size": shape["hidden_size"]},
        image_token_id=tok.convert_tokens_to_ids(IMAGE_PAD),
        video_token_id=tok.convert_tokens_to_ids(VIDEO_PAD),
        vision_start_token_id=tok.convert_tokens_to_ids(VISION_START),
        vision_end_token_id=tok.convert_tokens_to_ids(VISION_END),
        tie_word_embeddings=False,
    )
    config.llmq_random_weights = True
    torch.manual_seed(seed)
    model = t.Qwen2_5_VLForConditionalGeneration(config).float()
    perturb(model, seed=seed)  # norms and biases, the text model's and the tower's
    model.generation_config = t.GenerationConfig(**ids)
    model.save_pretrained(path)
    images = t.Qwen2VLImageProcessorPil(
        size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
        patch_size=PATCH,
        merge_size=MERGE,
        temporal_patch_size=2,
    )
    images.save_pretrained(path)
    tok.save_pretrained(path)
    return path
