"""A tiny random-weight Gemma 3 vision-language model (`llmq make-model --arch gemma3_vl`):
the tiny Gemma 3 text model (sliding windows of 8 tokens on alternate layers) with a small
SigLIP tower, the average-pool projector, Gemma 3's image tokens in the tokenizer and its
processor (each image becomes ``\\n\\n<start_of_image>``, its soft tokens, ``<end_of_image>\\n\\n``),
all built offline."""

from __future__ import annotations

from pathlib import Path

from llmq.tools.vision_models import image_chat_template

BOI, IMAGE, EOI = "<start_of_image>", "<image_soft_token>", "<end_of_image>"
# Gemma 3's image placeholder where an image part stands.
GEMMA3_CHAT_TEMPLATE = image_chat_template(BOI)
# SigLIP at a tiny size: 32 x 32 images in 4 x 4 patches (8 x 8 of them), pooled 2 x 2 into
# 16 image tokens, as the real 896 / 14 = 64 patches a side pool 4 x 4 into 256.
_VISION = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    image_size=32,
    patch_size=4,
)
IMAGE_TOKENS = 16
# Four text layers, not the tiny two: what the image's tokens read of each other (both ways)
# reaches the answer through more than one full-attention layer, and changes it.
LAYERS = 6


def gemma3_tokenizer(path: Path, base):
    """``base`` (model_factory's tokenizer) with Gemma 3's image tokens named as its processor
    reads them, loaded from its own copy (the trained one is cached and must stay as it is)."""
    from transformers import AutoTokenizer

    base.save_pretrained(path)
    names = {"boi_token": BOI, "image_token": IMAGE, "eoi_token": EOI}
    tok = AutoTokenizer.from_pretrained(path, extra_special_tokens=names)
    tok.add_special_tokens({"additional_special_tokens": [BOI, IMAGE, EOI]})
    tok.chat_template = GEMMA3_CHAT_TEMPLATE
    return tok


def make_gemma3_vl(path: Path, ids: dict, base_tokenizer, seed: int) -> Path:
    """A Gemma 3 vision-language model on the tiny Gemma 3 text config: wide projector, norms
    perturbed, so that an image (or a mask) the engine got wrong changes greedy output."""
    import torch
    import transformers as t

    from llmq.tools.model_archs import perturb, tiny_config

    path.mkdir(parents=True, exist_ok=True)
    tok = gemma3_tokenizer(path, base_tokenizer)
    text = tiny_config("gemma3_text", **ids)
    text.vocab_size = len(tok)
    text.num_hidden_layers, text.layer_types = (
        LAYERS,
        ["sliding_attention", "full_attention"] * (LAYERS // 2),
    )
    token = tok.convert_tokens_to_ids
    config = t.Gemma3Config(
        text_config=text,
        vision_config=t.SiglipVisionConfig(**_VISION),
        mm_tokens_per_image=IMAGE_TOKENS,
        boi_token_index=token(BOI),
        eoi_token_index=token(EOI),
        image_token_index=token(IMAGE),
        initializer_range=text.initializer_range,  # the whole model's init reads this one
        tie_word_embeddings=False,  # tied, the scaled input embedding dominates: one token
    )
    config.llmq_random_weights = True
    torch.manual_seed(seed)
    model = t.Gemma3ForConditionalGeneration(config).float()
    perturb(model, seed=seed)
    with torch.no_grad():  # zero at init: an image would change nothing
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.5)
    model.generation_config = t.GenerationConfig(**ids)
    model.save_pretrained(path)
    side = _VISION["image_size"]
    images = t.Gemma3ImageProcessorPil(size={"height": side, "width": side})
    processor = t.Gemma3Processor(
        image_processor=images,
        tokenizer=tok,
        image_seq_length=IMAGE_TOKENS,
        chat_template=GEMMA3_CHAT_TEMPLATE,
    )
    processor.save_pretrained(path)
    tok.save_pretrained(path)
    return path
