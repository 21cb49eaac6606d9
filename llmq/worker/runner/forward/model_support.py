"""What a model asks of the attention, read before it serves: served exactly, or refused by name.

transformers' forward hands the registered attention function what each layer asks of it (a
layer's ``sliding_window``, Gemma 2's ``softcap``, gpt-oss's ``s_aux`` sinks, the module's
``scaling``) and builds everything else into an attention mask, which llmq's paged attention
never receives. A paged attention that dropped one of those answered wrong without an error, so
at load llmq runs the model once over two tokens with a recording attention function
(:func:`probe`) and compares what every layer asked for, and the shapes of its keys and values,
with what the paged attention implements and with what the config says the mask would do
(:func:`inspect_model`). Anything else refuses the model, naming the feature.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface

from llmq.worker.runner.loaders import mapped_pages

PROBE_IMPLEMENTATION = "llmq_probe"
KNOWN_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})
# Keyword arguments of the attention seam that do not change its arithmetic.
INERT_KWARGS = frozenset(
    {
        "dropout",  # checked apart: 0.0 in eval mode
        "use_cache",
        "output_attentions",
        "output_router_logits",
        "position_ids",
        "cache_position",
        "position_embeddings",
        "llmq_step",
    }
)
# Those the paged attention implements (attention.py).
IMPLEMENTED_KWARGS = frozenset({"scaling", "sliding_window", "softcap", "s_aux"})


class UnsupportedModel(Exception):
    """The model asks for something llmq's attention does not implement; never served."""

    def __init__(self, model_type: str, features: list[str]):
        self.model_type = model_type
        self.features = features
        super().__init__(
            f"llmq does not serve this {model_type} model: it needs "
            + "; ".join(features)
            + ", which llmq's paged attention does not implement"
        )


@dataclass(slots=True)
class AttentionCall:
    """What one layer's attention call asked for."""

    layer: int | None
    kwargs: dict
    query_heads: int
    kv_heads: int
    key_dim: int
    value_dim: int


@dataclass(slots=True)
class ModelFeatures:
    """What the paged attention must do for a model."""

    windows: frozenset[int] = frozenset()  # sliding windows some layer asks for
    layer_windows: tuple[int | None, ...] = ()  # per layer, the window it asks (None: none)
    softcap: bool = False
    sinks: bool = False
    kv_heads: int = 0
    key_dim: int = 0
    value_dim: int = 0
    refusals: list[str] = field(default_factory=list)

    @property
    def mla(self) -> bool:
        """Keys and values of different widths (DeepSeek's multi-head latent attention)."""
        return self.key_dim != self.value_dim

    def needs_kernel_features(self, max_model_len: int) -> bool:
        """Whether the attention does more than softmax(q k^T * scale) v over causal keys."""
        return bool(self.effective_windows(max_model_len)) or self.softcap or self.sinks

    def effective_windows(self, max_model_len: int) -> frozenset[int]:
        """The windows that hide anything: one of max_model_len tokens or more covers every
        key a query can see, and counts as none."""
        return frozenset(w for w in self.windows if w < max_model_len)


_calls: list[AttentionCall] | None = None


def _recording_attention(module, query, key, value, attention_mask, **kwargs):
    if _calls is not None:
        _calls.append(
            AttentionCall(
                layer=getattr(module, "layer_idx", None),
                kwargs=dict(kwargs),
                query_heads=query.shape[1],
                kv_heads=key.shape[1],
                key_dim=key.shape[-1],
                value_dim=value.shape[-1],
            )
        )
    batch, heads, tokens, _ = query.shape
    out = torch.zeros(batch, tokens, heads, value.shape[-1], dtype=query.dtype, device=query.device)
    return out, None


AttentionInterface.register(PROBE_IMPLEMENTATION, _recording_attention)


def probe(model: torch.nn.Module) -> list[AttentionCall]:
    """Every attention call of one forward over two tokens, as the model made it. Leaves the
    model's attention implementation set to the probe (the runner sets its own next)."""
    global _calls
    device = next(model.parameters()).device
    model.set_attn_implementation(PROBE_IMPLEMENTATION)
    _calls = []
    hooks = mapped_pages.released_as_run(model)
    try:
        with torch.inference_mode():
            model(
                input_ids=torch.tensor([[0, 0]], device=device),
                position_ids=torch.tensor([[0, 1]], device=device),
                use_cache=False,
            )
        return _calls
    finally:
        _calls = None
        for hook in hooks:
            hook.remove()


def config_refusals(config) -> list[str]:
    """Features the config names that reach the attention only through its mask (which the
    paged attention never sees) or not through transformers' attention seam at all."""
    out: list[str] = []
    unknown = sorted(set(getattr(config, "layer_types", None) or ()) - KNOWN_LAYER_TYPES)
    if unknown:
        out.append(f"layer types {', '.join(unknown)} (layer_types)")
    if getattr(config, "attention_chunk_size", None):
        out.append(f"chunked attention (attention_chunk_size={config.attention_chunk_size})")
    if getattr(config, "alibi", False) or getattr(config, "use_alibi", False):
        out.append("ALiBi position biases (alibi)")
    if getattr(config, "position_embedding_type", None) == "alibi":
        out.append("ALiBi position biases (position_embedding_type)")
    return out


def _expected_windows(config) -> list[int | None] | None:
    """Per layer, the window the config's mask applies; None where it cannot be told."""
    window = getattr(config, "sliding_window", None)
    layers = config.num_hidden_layers
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return [window if t == "sliding_attention" else None for t in layer_types]
    if window and getattr(config, "use_sliding_window", True):
        return [window] * layers
    return [None] * layers


def _call_refusals(config, calls: list[AttentionCall]) -> list[str]:
    out: list[str] = []
    if len(calls) != config.num_hidden_layers:
        out.append(
            f"layers whose attention does not go through transformers' attention interface "
            f"({len(calls)} calls for {config.num_hidden_layers} layers)"
        )
    unknown = sorted({k for c in calls for k in c.kwargs} - INERT_KWARGS - IMPLEMENTED_KWARGS)
    if unknown:
        out.append(f"attention arguments {', '.join(unknown)}")
    if any(c.kwargs.get("dropout") for c in calls):
        out.append("attention dropout at inference")
    expected = _expected_windows(config)
    for call in calls:
        if call.layer is None or call.layer >= len(expected):
            continue
        asked = call.kwargs.get("sliding_window")
        if asked != expected[call.layer] and expected[call.layer] is not None:
            out.append(
                f"a sliding window of {expected[call.layer]} in layer {call.layer}'s mask that "
                f"its attention call does not pass (sliding_window={asked})"
            )
            break
    shapes = {(c.kv_heads, c.key_dim, c.value_dim) for c in calls}
    if len(shapes) > 1:
        out.append(f"layers of different key/value shapes {sorted(shapes)}")
    if any(c.query_heads % c.kv_heads for c in calls):
        out.append("query heads not a multiple of key/value heads")
    return out


def inspect_model(model: torch.nn.Module) -> ModelFeatures:
    """What ``model``'s attention needs, and what of it llmq refuses (``refusals``)."""
    config = model.config.get_text_config()
    refusals = config_refusals(config)
    try:
        calls = probe(model)
    except (ValueError, NotImplementedError) as exc:  # no custom attention for this class
        return ModelFeatures(
            refusals=[*refusals, f"an attention outside transformers' seam ({exc})"]
        )
    refusals += _call_refusals(config, calls)
    first = calls[0] if calls else AttentionCall(None, {}, 1, 1, 0, 0)
    return ModelFeatures(
        windows=frozenset(
            c.kwargs["sliding_window"] for c in calls if c.kwargs.get("sliding_window")
        ),
        layer_windows=tuple(c.kwargs.get("sliding_window") or None for c in calls),
        softcap=any(c.kwargs.get("softcap") for c in calls),
        sinks=any(c.kwargs.get("s_aux") is not None for c in calls),
        kv_heads=first.kv_heads,
        key_dim=first.key_dim,
        value_dim=first.value_dim,
        refusals=refusals,
    )


def model_dims(config) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) of a decoder config. MLA (DeepSeek V2/V3): keys of
    qk_nope + qk_rope per head, values of v_head_dim, stored at the wider of the two."""
    config = config.get_text_config()
    num_heads = config.num_attention_heads
    if getattr(config, "qk_rope_head_dim", None) and getattr(config, "kv_lora_rank", None):
        key_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
        return config.num_hidden_layers, num_heads, max(key_dim, config.v_head_dim)
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    return config.num_hidden_layers, num_kv_heads, head_dim


def pool_dims(config, features: ModelFeatures | None) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) of the KV pool: as the model's attention calls showed
    them (``model_support.probe``), else as its config says."""
    layers, kv_heads, head_dim = model_dims(config)
    if features is not None and features.key_dim:
        return layers, features.kv_heads, max(features.key_dim, features.value_dim)
    return layers, kv_heads, head_dim
