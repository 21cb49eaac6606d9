"""Tiny configs of the architectures llmq serves, for `llmq make-model` and the coverage tests.

Each is a transformers config of the architecture's own class at the "tiny" shape (2 layers,
hidden 64) with its distinctive features switched on and small: sliding windows of 8 tokens
(prompts cross them), attention logit softcapping, learned sinks, MLA's uneven key and value
widths, a few experts. ``perturb`` then widens what a default init leaves inert (norms at one,
biases and sinks at zero), so that a feature the engine ignored would change greedy output.
"""

from __future__ import annotations

from typing import Any

TINY_WINDOW = 8  # tokens: small, so that every test prompt crosses it
_TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    initializer_range=0.2,
    tie_word_embeddings=False,
)
_ALTERNATING = ["sliding_attention", "full_attention"]
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
_MLA = dict(
    kv_lora_rank=32,
    q_lora_rank=48,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    num_key_value_heads=4,
)

# model_type -> (config class name, its options beyond the tiny shape)
ARCHS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", dict(use_sliding_window=False)),
    "mistral": ("MistralConfig", dict(sliding_window=None)),
    "mistral_window": ("MistralConfig", dict(sliding_window=TINY_WINDOW)),
    "qwen3": ("Qwen3Config", dict(head_dim=16)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(head_dim=16, **_MOE)),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
    "phi3": ("Phi3Config", {}),
    "granite": (
        "GraniteConfig",
        dict(attention_multiplier=0.2, embedding_multiplier=2.0, logits_scaling=2.0),
    ),
    "olmo2": ("Olmo2Config", {}),
    "smollm3": ("SmolLM3Config", {}),
    "glm4": ("Glm4Config", dict(head_dim=16)),
    "gemma2": (
        "Gemma2Config",
        dict(
            head_dim=16,
            sliding_window=TINY_WINDOW,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=5.0,
            query_pre_attn_scalar=24,
            layer_types=_ALTERNATING,
        ),
    ),
    "gemma3_text": (
        "Gemma3TextConfig",
        dict(
            head_dim=16,
            sliding_window=TINY_WINDOW,
            query_pre_attn_scalar=24,
            layer_types=_ALTERNATING,
        ),
    ),
    "gpt_oss": (
        "GptOssConfig",
        dict(
            head_dim=16,
            sliding_window=TINY_WINDOW,
            num_local_experts=4,
            num_experts_per_tok=2,
            layer_types=_ALTERNATING,
        ),
    ),
    "deepseek_v2": ("DeepseekV2Config", dict(_MLA, q_lora_rank=None)),
    "deepseek_v3": ("DeepseekV3Config", dict(_MLA)),
}


def tiny_config(arch: str, **token_ids: int | None):
    """The tiny config of ``arch`` (a key of ARCHS), with the tokenizer's special ids."""
    import transformers

    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHS)}")
    class_name, options = ARCHS[arch]
    shape = {**_TINY, **options}
    return getattr(transformers, class_name)(**shape, **token_ids)


def perturb(model, scale: float = 0.2, seed: int = 0) -> None:
    """Give the weights a default init leaves constant (norms, biases, sinks, a router's
    correction bias) random values around their init, so that every one of them matters."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            constant = param.dim() == 1 or leaf.endswith("bias") or leaf == "sinks"
            if constant and param.dtype.is_floating_point:
                noise = torch.randn(param.shape, generator=generator) * scale
                param.add_(noise.to(param.dtype))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.add_(torch.randn(buffer.shape, generator=generator) * scale)
