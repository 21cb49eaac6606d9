"""Tiny random-weight vision-language models for tests (`llmq make-model --arch llava` or
`--arch llava_next`): the text model of ``model_factory`` with a small vision tower, a
projector, an image token in the tokenizer, a chat template that places images, and the
processor saved beside them (its PIL image processor: no torchvision), all built offline."""

from __future__ import annotations

from pathlib import Path

IMAGE_TOKEN = "<image>"


def image_chat_template(placeholder: str) -> str:
    """ChatML whose content may be parts: an image part becomes ``placeholder`` where it
    stands (each tiny vision family's own image text)."""
    return (
        """
{%- for message in messages %}<|im_start|>{{ message.role }}
{% if message.content is string %}{{ message.content }}
{%- else %}{% for part in message.content %}
{%- if part.type == "image" %}"""
        + placeholder
        + """{% else %}{{ part.text }}{% endif %}
{%- endfor %}{% endif %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
    )


VISION_CHAT_TEMPLATE = image_chat_template(IMAGE_TOKEN)
# CLIP's tower at a tiny size: 30 x 30 images in 6 x 6 patches, 25 image tokens each.
_VISION = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    image_size=30,
    patch_size=6,
    projection_dim=32,
)


def vision_tokenizer(path: Path, base):
    """``base`` (model_factory's tokenizer) with the image token and the vision template,
    loaded from its own copy (the trained one is cached and must stay as it is)."""
    from transformers import AutoTokenizer

    base.save_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    tok.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    tok.chat_template = VISION_CHAT_TEMPLATE
    return tok


# LLaVA-NeXT's grid at the tiny tile: one, two or four tiles besides the base one.
_GRID = [[30, 60], [60, 30], [60, 60]]


def make_llava(
    path: Path, shape: dict, ids: dict, base_tokenizer, seed: int, anyres: bool = False
) -> Path:
    """A LLaVA-1.5 of the tiny text shape: CLIP tower, its second-to-last layer without the
    CLS token, a two-layer GELU projector; with ``anyres`` a LLaVA-NeXT (tiles of a grid
    besides the base image, unpadded, a newline embedding per row)."""
    import torch
    from transformers import GenerationConfig, LlamaConfig

    path.mkdir(parents=True, exist_ok=True)
    tok = vision_tokenizer(path, base_tokenizer)
    text = LlamaConfig(**{**shape, "vocab_size": len(tok)}, **ids)
    config_class, model_class, processor_class, images = _classes(anyres)
    options = {"image_grid_pinpoints": _GRID} if anyres else {}
    config = config_class(
        vision_config=_vision_config(),
        text_config=text,
        image_token_id=tok.convert_tokens_to_ids(IMAGE_TOKEN),
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        projector_hidden_act="gelu",
        **options,
    )
    config.llmq_random_weights = True
    torch.manual_seed(seed)
    model = model_class(config).float()
    with torch.no_grad():  # wide weights: an image that changes nothing would hide a bug
        for p in model.model.multi_modal_projector.parameters():
            p.normal_(0.0, 0.5)
    model.generation_config = GenerationConfig(**ids)
    model.save_pretrained(path)
    side = _VISION["image_size"]
    processor = processor_class(
        image_processor=images(
            size={"shortest_edge": side}, crop_size={"height": side, "width": side}, **options
        ),
        tokenizer=tok,
        patch_size=_VISION["patch_size"],
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=VISION_CHAT_TEMPLATE,
    )
    processor.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _vision_config():
    from transformers import CLIPVisionConfig

    return CLIPVisionConfig(**_VISION)


def _classes(anyres: bool) -> tuple:
    """(config, model, processor, image processor) classes of LLaVA-1.5 or LLaVA-NeXT."""
    import transformers as t

    if anyres:
        return (t.LlavaNextConfig, t.LlavaNextForConditionalGeneration, t.LlavaNextProcessor,
                t.LlavaNextImageProcessorPil)  # fmt: skip
    return (t.LlavaConfig, t.LlavaForConditionalGeneration, t.LlavaProcessor,
            t.CLIPImageProcessorPil)  # fmt: skip


# Idefics3's tags for its tiles and the whole image, as its processor writes them.
IDEFICS3_TOKENS = ["<fake_token_around_image>", "<global-img>", "<end_of_utterance>"] + [
    f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)
]


def make_idefics3(path: Path, shape: dict, ids: dict, base_tokenizer, seed: int) -> Path:
    """An Idefics3 (SmolVLM's architecture) of the tiny text shape: 24 x 24 tiles of 6 x 6
    patches, pixel shuffle by 2 (4 image tokens a tile), images resized to 96 on their
    longest side (up to 4 x 4 tiles and the whole image)."""
    import torch
    import transformers as t

    path.mkdir(parents=True, exist_ok=True)
    tok = vision_tokenizer(path, base_tokenizer)
    tok.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN, *IDEFICS3_TOKENS]})
    text = t.LlamaConfig(**{**shape, "vocab_size": len(tok)}, **ids)
    vision = t.Idefics3VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=2, image_size=24, patch_size=6)  # fmt: skip
    config = t.Idefics3Config(
        vision_config=vision,
        text_config=text,
        scale_factor=2,
        image_token_id=tok.convert_tokens_to_ids(IMAGE_TOKEN),
    )
    config.llmq_random_weights = True
    torch.manual_seed(seed)
    model = t.Idefics3ForConditionalGeneration(config).float()
    with torch.no_grad():  # wide weights: an image that changes nothing would hide a bug
        for p in model.model.connector.parameters():
            p.normal_(0.0, 0.5)
    model.generation_config = t.GenerationConfig(**ids)
    model.save_pretrained(path)
    images = t.Idefics3ImageProcessorPil(
        size={"longest_edge": 96}, max_image_size={"longest_edge": 24}
    )
    processor = t.Idefics3Processor(
        image_processor=images, tokenizer=tok, image_seq_len=4, chat_template=VISION_CHAT_TEMPLATE
    )
    processor.save_pretrained(path)
    tok.save_pretrained(path)
    return path
