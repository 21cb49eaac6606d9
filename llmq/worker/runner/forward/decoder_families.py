"""Which decoders llmq's own forward runs, and what sets each family's layer apart from Llama's.

- Llama, Qwen 2, Mistral: the reference layer (Qwen 2: biased q/k/v projections).
- Qwen2.5-VL's text model: Qwen 2's layer with M-RoPE, whose rotary embedding module builds each
  row's cos and sin from its three positions (``mrope.py``); the layers take them per row.
- Qwen 3: each query and key head RMS-normed before the rotary embedding.
- Phi-3: q/k/v and gate/up already fused in the checkpoint (``qkv_proj``, ``gate_up_proj``).
- Gemma 2 / Gemma 3: RMSNorm times ``1 + weight`` in float32, four norms a layer (the attention's
  and the MLP's outputs normed before their residual adds), embeddings scaled by
  ``sqrt(hidden)`` (transformers' embedding module does it), GELU-tanh MLP, a final logit
  softcap; Gemma 2 an attention logit softcap, Gemma 3 q/k norms and a rotary base of its own
  for sliding layers (``rope_local_base_freq``).

What each layer's attention asks for (its scale, sliding window, softcap) is read as the model's
own forward passes it to the attention seam (``model_support.probe``), so the fast forward hands
the paged attention exactly what transformers' forward would. Anything else, or a rotary
embedding whose angles depend on more than the position (dynamic, longrope) or cover part of a
head, keeps transformers' forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmq.worker.runner.forward.model_support import INERT_KWARGS, AttentionCall, probe

LLAMA_LIKE = frozenset({"llama", "qwen2", "mistral"})
# Rotary embeddings of three position components a row (temporal, height, width).
MROPE = frozenset({"qwen2_5_vl_text"})
# Qwen3-MoE (Qwen 3's attention) and Mixtral (Mistral's) with llmq's MoE layers (``moe.py``),
# on CPU: they group each step's tokens by expert on the host, which no CUDA graph captures.
MOE = frozenset({"qwen3_moe", "mixtral"})
FAMILIES = LLAMA_LIKE | MROPE | {"qwen3", "phi3", "gemma2", "gemma3_text"} | MOE
GEMMA = frozenset({"gemma2", "gemma3_text"})
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
# Rotary embeddings whose cos and sin depend on the position alone (not on the step's longest
# sequence), for the families added after Llama's.
STATIC_ROPE = frozenset({"default", "linear", "llama3", "yarn"})
# Arguments of an attention call the fast forward passes on (the rest must be inert).
PASSED_KWARGS = frozenset({"scaling", "sliding_window", "softcap"})


@dataclass(frozen=True, slots=True)
class LayerAttention:
    """What one layer's attention call asks for."""

    scaling: float
    window: int | None  # its sliding window; None: full causal attention
    softcap: float | None  # Gemma 2's attention logit softcap


@dataclass(frozen=True, slots=True)
class Family:
    model_type: str
    activation: str  # "silu" or "gelu_tanh"
    unit_offset_norms: bool  # Gemma: RMSNorm times (1 + weight), in float32
    final_softcap: float | None  # Gemma: logits = c * tanh(logits / c)
    rotary_types: tuple[str | None, ...]  # Gemma 3: a rotary per layer type; else (None,)
    layer_rotary: tuple[int, ...]  # per layer, its index in rotary_types
    attention: tuple[LayerAttention, ...]  # per layer


def _activation(config) -> str | None:
    name = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
    return ACTIVATIONS.get(name)


def _rope_refusal(config) -> str | None:
    """Why the rotary embedding of a family added after Llama's cannot serve; None: it can."""
    params = getattr(config, "rope_parameters", None) or {}
    sets = list(params.values()) if all(isinstance(v, dict) for v in params.values()) else [params]
    for rope in sets:
        if not rope:
            continue
        kind = rope.get("rope_type", "default")
        if kind not in STATIC_ROPE:
            return f"rotary embedding {kind!r}"
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            return "partial rotary embedding"
    if getattr(config, "partial_rotary_factor", 1.0) not in (None, 1.0):
        return "partial rotary embedding"
    return None


def _config_refusal(model: torch.nn.Module) -> str | None:
    config = model.config
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        return f"architecture {model_type}"
    if model_type in MOE and next(model.parameters()).device.type != "cpu":
        return "mixture of experts off the CPU"
    if _activation(config) is None or (
        model_type in LLAMA_LIKE | MROPE and _activation(config) != "silu"
    ):
        return "its MLP's activation"
    if getattr(config, "pretraining_tp", 1) not in (None, 1):
        return "pretraining_tp"
    if getattr(config, "use_bidirectional_attention", False):
        return "bidirectional attention"
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(model, "lm_head"):
        return "a model without model.layers and lm_head"
    return None if model_type in LLAMA_LIKE else _rope_refusal(config)


def supports(model: torch.nn.Module) -> bool:
    """Whether llmq's forward may serve ``model`` (its config alone; ``family`` reads more)."""
    return _config_refusal(model) is None


def _calls(model: torch.nn.Module) -> list[AttentionCall]:
    """The model's attention calls (``model_support.probe``), its attention set back after."""
    before = model.config._attn_implementation
    try:
        return probe(model)
    finally:
        model.set_attn_implementation(before)


def norm_eps(norm: torch.nn.Module) -> float:
    """An RMSNorm's epsilon (Llama's ``variance_epsilon``, Gemma's ``eps``)."""
    return getattr(norm, "variance_epsilon", None) or norm.eps


def _layer_attention(calls: list[AttentionCall], layers: int) -> tuple[LayerAttention, ...] | None:
    if len(calls) != layers or [c.layer for c in calls] != list(range(layers)):
        return None
    out = []
    for call in calls:
        kwargs = {k: v for k, v in call.kwargs.items() if k not in INERT_KWARGS and v is not None}
        if set(kwargs) - PASSED_KWARGS or call.key_dim != call.value_dim:
            return None
        out.append(
            LayerAttention(
                scaling=kwargs.get("scaling", call.key_dim**-0.5),
                window=kwargs.get("sliding_window") or None,
                softcap=kwargs.get("softcap"),
            )
        )
    return tuple(out)


def family(model: torch.nn.Module) -> tuple[Family | None, str | None]:
    """``model``'s family as the fast forward runs it, or None and why it cannot."""
    refusal = _config_refusal(model)
    if refusal is not None:
        return None, refusal
    config = model.config
    layers = config.num_hidden_layers
    attention = _layer_attention(_calls(model), layers)
    if attention is None:
        return None, "attention calls other than scale, sliding window and softcap"
    norms = {norm_eps(m) for m in model.modules() if "RMSNorm" in type(m).__name__}
    if len(norms) != 1:
        return None, f"RMSNorms of different epsilons {sorted(norms)}"
    model_type = config.model_type
    rotary_types: tuple[str | None, ...] = (None,)
    layer_rotary = (0,) * layers
    if model_type == "gemma3_text":
        rotary_types = tuple(sorted(set(config.layer_types)))
        layer_rotary = tuple(rotary_types.index(t) for t in config.layer_types[:layers])
    return (
        Family(
            model_type=model_type,
            activation=_activation(config),
            unit_offset_norms=model_type in GEMMA,
            final_softcap=getattr(config, "final_logit_softcapping", None)
            if model_type in GEMMA
            else None,
            rotary_types=rotary_types,
            layer_rotary=layer_rotary,
            attention=attention,
        ),
        None,
    )
