"""A lean forward pass for the decoder families llmq knows (``decoder_families``: Llama, Qwen 2,
Mistral, Qwen 3, Phi-3, Gemma 2, Gemma 3, Qwen2.5-VL's text model): the same arithmetic as
transformers' modules, op for op, without their per-call machinery.

At small batches a step is bound by per-op overhead, not by arithmetic: transformers' forward
goes through module calls, output-capturing hooks and kwargs plumbing for every one of ~40 ops
per layer, most of a batch-1 decode step on a CPU (docs/performance.md). This walks the
layers itself with the models' own weights: query, key and value projections in one matmul
(one read of the activations, one kernel launch), gate and up in another, rotary embedding
applied to queries and keys together, and attention through the paged kernel. In bfloat16 on
CPU the projections' weights are packed once (``packed_linear``: for llmq's own matmul where
its kernels are loaded, else for oneDNN's). The elementwise arithmetic is transformers' own, so
float32 greedy output stays equal to ``generate``.

Each layer's attention gets what the model's own forward would pass it (its scale, sliding
window, softcap) through the same paged attention (``attention.paged_attention``, and
``attention.featured_attention`` for windows and softcaps). Models it does not know keep transformers'
forward with the paged attention registered through ``AttentionInterface``.

LoRA adapters (``lora_linear``) wrap the projections once the first one is loaded; a step with
adapter rows adds their deltas in the fused C++ step where it serves, else in the Python loop.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

from llmq.worker.runner.attention.paged import StepMetadata, paged_attention
from llmq.worker.runner.forward import decoder_cpp_step
from llmq.worker.runner.forward.decoder_families import MROPE, family, supports
from llmq.worker.runner.forward.decoder_layers import (
    DecoderLayer,
    WeightCopies,
    build_layers,
    own_memory,
    rms_norm,
)
from llmq.worker.runner.forward.moe_install import install_moe
from llmq.worker.runner.linear.packed_linear import (
    Layout,
    Linear,
    can_pack,
    choose_panel_sums,
    panels_fit,
)
from llmq.worker.runner.linear.quantize import (
    Scheme,
    finish_quantization,
    make_quantizer,
    quantization_of,
    quantize_layer,
)
from llmq.worker.runner.lora.lora_linear import LoraState

log = logging.getLogger(__name__)

__all__ = ["DecoderForward", "build_forward", "supports"]

# Where llmq's C++ ops are loaded, a step runs every layer in one C++ call
# (``kernels/step_layers.cpp``). The Python loop below serves where they are not (and the
# tests, as the reference): with them, steps of fewer tokens than this run their norms, rotary
# embedding and activation through the same ops (``kernels/small_step_ops.cpp``), larger ones
# torch's.
SMALL_STEP_OPS_TOKENS = 16

# (layer, query [1, Hq, T, D], key [1, Hkv, T, D], value) -> attention output [..., T, Hq, D]
Attend = Callable[[DecoderLayer, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def build_forward(
    model: torch.nn.Module, fast_forward: bool, pack: bool, kernels: bool = False
) -> DecoderForward | None:
    """llmq's forward for ``model`` where it is asked for and supports the architecture; None:
    transformers' own. ``kernels``: llmq's C++ kernels are loaded (packing may use its matmul)."""
    quantization = quantization_of(model)
    if quantization and not (fast_forward and supports(model)):
        raise ValueError("quantized weights need llmq's fast forward (on, and for this model)")
    if not fast_forward:
        return None
    if not supports(model):
        # transformers' forward, its MoE blocks (if any) replaced by llmq's grouped experts.
        install_moe(model, pack, kernels)
        return None
    return DecoderForward(model, pack=pack, kernels=kernels, quantization=quantization)


def _layout(layer: torch.nn.Module, pack: bool, kernels: bool) -> Layout:
    """How the projections of a model whose first decoder layer is ``layer`` are packed."""
    attn = layer.self_attn
    # A MoE layer has no down_proj; its experts take this layout too.
    down = getattr(layer.mlp, "down_proj", attn.o_proj).weight
    query = attn.qkv_proj.weight if hasattr(attn, "qkv_proj") else attn.q_proj.weight
    if pack and kernels and panels_fit(down) and panels_fit(query):  # both input widths
        return "panels"
    # oneDNN's packing only where it gives F.linear's bits.
    return "onednn" if pack and can_pack(down) else "plain"


def one_position_mrope(
    rotary: torch.nn.Module, h: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """M-RoPE's cos and sin [1, T, D] of rows whose three positions are ``positions`` [T]: its
    module's arithmetic, elementwise, on one component instead of three recomposed: the same
    bits, about 30 us less a step on a 2-core host, all the decode's gap to plain Qwen 2's."""
    freqs = positions[None, :, None].float() * rotary.inv_freq.to(h.device, torch.float)
    emb = torch.cat((freqs, freqs), dim=-1)
    scale = rotary.attention_scaling
    return (emb.cos() * scale).to(h.dtype), (emb.sin() * scale).to(h.dtype)


def attach(model: torch.nn.Module, forward: DecoderForward) -> None:
    """Keep a forward built ahead of the runner (``worker/preload.py``) on its model."""
    model.__dict__["_llmq_forward"] = forward


def take_attached(model: torch.nn.Module) -> DecoderForward | None:
    """The forward ``attach`` kept on the model, once."""
    return model.__dict__.pop("_llmq_forward", None)


def _longest_context(step: StepMetadata) -> float:
    """The most keys any query of the step sees (an upper bound; inf where unknown)."""
    longest = max((p.ctx_len for p in step.prefills), default=0)
    if step.num_decodes:
        if step.decode_tables is not None:
            return max(longest, int(step.decode_tables.context_lens.max()))
        if not step.decode_chunks:
            return float("inf")
        bs = step.pool.block_size
        longest = max(longest, max(c.num_blocks * bs for c in step.decode_chunks))
    return longest


class DecoderForward:
    """``__call__(input_ids, positions, keep, step)`` -> logits of the kept rows."""

    def __init__(
        self,
        model: torch.nn.Module,
        pack: bool = True,
        kernels: bool = False,
        quantization: Scheme | None = None,
    ):
        """``quantization``: each layer's projections quantized as it is built (unpacked
        first), then the head and embedding (``quantize.py``)."""
        config = model.config
        self.model = model
        self.inner = model.model
        self.family, refusal = family(model)
        if self.family is None:
            raise ValueError(f"llmq's forward does not serve this model: {refusal}")
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        layers = self.inner.layers[: config.num_hidden_layers]
        # bfloat16 on CPU: weights packed once, for llmq's matmul or oneDNN's.
        self.layout = layout = _layout(layers[0], pack and not quantization, kernels)
        self.packed = layout != "plain"
        if layout == "panels":
            choose_panel_sums()
        copies = WeightCopies()
        quantizer = make_quantizer(self, quantization) if quantization else None
        if quantizer is not None:
            copies.finish_layer = functools.partial(quantize_layer, quantizer, model=model)
        self.layers = build_layers(list(layers), self.family, layout, copies)
        self.small_step_ops = False  # set by the runner where the C++ ops are loaded
        self.fused_step = False  # set by the runner's plan (forward/plan.py)
        self._cpp_weights: list[torch.Tensor] | None = None  # step_layers' weights, in order
        self.loras: LoraState | None = None  # set where LoRA adapters are served
        # step_layers takes one scale, epsilon, activation and set of widths for all layers.
        self._uniform_layers = decoder_cpp_step.serves_model(self.layers)
        # The shortest sliding window of any layer (inf: none); a step whose longest context
        # is no longer hides nothing with any of them.
        self._shortest_window = min(
            (layer.window for layer in self.layers if layer.window is not None),
            default=float("inf"),
        )
        self._softcapped = any(layer.softcap is not None for layer in self.layers)
        final = self.inner.norm
        self.final_norm = (
            1.0 + final.weight.detach().float() if self.family.unit_offset_norms else final.weight
        )
        self.final_eps = self.layers[0].eps
        self.final_softcap = self.family.final_softcap
        self._build_head(copies, quantizer, quantization)
        log.debug("weight file pages released as copied: %d MiB", copies.released >> 20)

    def _build_head(self, copies: WeightCopies, quantizer, quantization: Scheme | None) -> None:
        """The head (and, quantized, the embedding table), and the model's other weights copied
        out of their file."""
        model, layout = self.model, self.layout
        if not quantization:  # quantized, the head and table are read from the file's pages
            own_memory(model, copies)
        head = model.lm_head
        tied = head.weight.data_ptr() == self.inner.embed_tokens.weight.data_ptr()
        # A head tied to the embedding keeps its weight (the embedding reads it); packed, the
        # head holds a copy in the blocked layout.
        self.lm_head = Linear(head.weight.detach(), head.bias, layout)
        if self.packed and not tied:
            head.weight.data = head.weight.new_empty(0)
        if quantization:
            # The table is quantized from the file, not from a copy: its bf16 copy beside its
            # quantization would raise the start's peak RSS (docs/performance.md).
            finish_quantization(self, quantizer, quantization)
            own_memory(model, copies)  # the norms, and a head or table kept float
            if isinstance(self.lm_head, Linear):  # kept float: onto the owned copy
                self.lm_head = Linear(head.weight.detach(), head.bias, layout)

    def windows(self, max_model_len: int) -> frozenset[int]:
        """The sliding windows of the layers that hide anything within ``max_model_len``."""
        return frozenset(
            layer.window
            for layer in self.layers
            if layer.window is not None and layer.window < max_model_len
        )

    def _cpp_ops(self) -> bool:
        """Whether llmq's C++ ops serve (the runner loaded them)."""
        return self.small_step_ops

    def _small(self, tokens: int) -> bool:
        """Whether the Python loop runs a step of ``tokens`` through the C++ small-step ops."""
        return tokens < SMALL_STEP_OPS_TOKENS and self._cpp_ops()

    def _norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if self._small(x.shape[0]):
            return torch.ops.llmq.rms_norm(x, weight, eps)
        return rms_norm(x, weight, eps)

    _rms_norm = staticmethod(rms_norm)

    @torch.inference_mode()
    def __call__(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]; M-RoPE: [3, T] where a row's three differ
        keep: torch.Tensor,  # rows whose logits are wanted
        step: StepMetadata,
        embeds: torch.Tensor | None = None,  # [T, hidden]: the rows' inputs (images' rows)
    ) -> torch.Tensor:
        # A window no longer than the step's longest context hides nothing in this step.
        longest = _longest_context(step) if self._shortest_window < float("inf") else 0
        if self._whole_step_in_cpp(step, windows_hide=self._shortest_window < longest):
            return self._step_in_cpp(input_ids, positions, keep, step, longest, embeds)

        def attend(layer: DecoderLayer, query, key, value) -> torch.Tensor:
            window = layer.window if layer.window is not None and layer.window < longest else None
            out, _ = paged_attention(
                layer.module,
                query,
                key,
                value,
                None,
                scaling=layer.scaling,
                llmq_step=step,
                sliding_window=window,
                softcap=layer.softcap,
            )
            return out

        return self.run(input_ids, positions, keep, attend, embeds)

    def layers_changed(self) -> None:
        """The layers' weights were replaced (quantized after build): the C++ step's view of
        them is taken again."""
        self._uniform_layers = decoder_cpp_step.serves_model(self.layers)
        self._cpp_weights = None

    def fused_step_serves(self, cache_quantized: bool) -> bool:
        """Whether every layer may run in one C++ call (``kernels/step_layers.cpp``), bit-equal
        to this loop with the C++ ops: they serve, the layers share one shape (scale, epsilon,
        activation, widths), none softcaps, and the cache is in the model's dtype (it writes
        it). The runner's plan asks this once."""
        return (
            self._uniform_layers
            and not self._softcapped
            and not cache_quantized
            and self._cpp_ops()
        )

    def _whole_step_in_cpp(self, step: StepMetadata, windows_hide: bool) -> bool:
        """The fused step where the plan chose it and this step allows: the attention kernel
        serves the decodes and no layer asks for more than its KV group's window."""
        return (
            self.fused_step
            and (not windows_hide or step.layer_steps is not None)  # groups: each its window
            and all(
                group.decode_tables is not None or not group.num_decodes
                for group in decoder_cpp_step.kv_groups(step)
            )
        )

    def _step_in_cpp(
        self, input_ids, positions, keep, step: StepMetadata, longest: float, embeds=None
    ) -> torch.Tensor:
        if self._cpp_weights is None:
            self._cpp_weights = decoder_cpp_step.layer_tensors(self.layers)
        h, cos, sin = self.embed_all(input_ids, positions, embeds)
        h = decoder_cpp_step.run_layers(
            h,
            cos,
            sin,
            self.layers,
            self._cpp_weights,
            self.layout,
            (self.num_heads, self.num_kv_heads),
            step,
            longest,
            None if self.loras is None else self.loras.step,
        )
        return self.head(h, keep)

    def run(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        keep: torch.Tensor | None,  # rows whose logits are wanted; None: all
        attend: Attend,
        embeds: torch.Tensor | None = None,  # the rows' inputs; None: input_ids' embeddings
    ) -> torch.Tensor:
        h, cos, sin = self.embed_all(input_ids, positions, embeds)
        for layer in self.layers:
            h = self.layer(h, cos[layer.rotary], sin[layer.rotary], layer, attend)
        return self.head(h, keep)

    def embed(
        self, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The tokens' embeddings [T, hidden] and their rotary cos and sin [T, 1, head_dim]
        (of the first rotary base: the only one but for Gemma 3)."""
        h, cos, sin = self.embed_all(input_ids, positions)
        return h, cos[0], sin[0]

    def embed_all(
        self, input_ids: torch.Tensor, positions: torch.Tensor, embeds: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        """The tokens' embeddings (scaled where the model's embedding scales them) and, per
        rotary base of ``family.rotary_types``, the rotary cos and sin [T, 1, head_dim].
        ``positions``: [T], or M-RoPE's [3, T] (each row's cos and sin of its three).
        ``embeds``: the rows' inputs as they are (a vision-language model's image rows)."""
        h = self.inner.embed_tokens(input_ids) if embeds is None else embeds
        cos_all, sin_all = [], []
        batched = positions.unsqueeze(-2)  # [1, T] or [3, 1, T]
        for kind in self.family.rotary_types:
            extra = () if kind is None else (kind,)
            if self.family.model_type in MROPE and positions.dim() == 1:
                cos, sin = one_position_mrope(self.inner.rotary_emb, h, positions)
            else:
                cos, sin = self.inner.rotary_emb(h.unsqueeze(0), batched, *extra)
            cos_all.append(cos[0].unsqueeze(1))
            sin_all.append(sin[0].unsqueeze(1))
        return h, cos_all, sin_all

    def _queries_keys(self, qkv: torch.Tensor, layer: DecoderLayer, small: bool) -> torch.Tensor:
        """The rows' query and key heads [T, Hq + Hkv, D] (a view of ``qkv`` where the layer
        norms neither), each head RMS-normed where the layer norms them (Qwen 3, Gemma 3)."""
        hq, hkv = self.num_heads, self.num_kv_heads
        if layer.q_norm is None:
            return qkv[:, : hq + hkv]
        if small:
            return torch.ops.llmq.qk_norm(qkv, layer.q_norm, layer.k_norm, hq, hkv, layer.eps)
        query = rms_norm(qkv[:, :hq], layer.q_norm, layer.eps)
        key = rms_norm(qkv[:, hq : hq + hkv], layer.k_norm, layer.eps)
        return torch.cat((query, key), dim=1)

    def layer(
        self,
        h: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,
        sin: torch.Tensor,
        layer: DecoderLayer,
        attend: Attend,
    ) -> torch.Tensor:
        """One decoder layer, with ``attend`` as its attention (the compiled decode step brings
        its own, traceable one)."""
        t = h.shape[0]
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        half = d // 2
        small = self._small(t)
        residual = h
        x = self._norm(h, layer.input_norm, layer.eps)
        qkv = layer.qkv_proj(x).view(t, hq + 2 * hkv, d)
        qk = self._queries_keys(qkv, layer, small)
        # Rotary embedding on queries and keys at once: q * cos + rotate_half(q) * sin.
        if small:
            qk = torch.ops.llmq.rotary(qk, cos, sin, hq + hkv)
        else:
            rotated = torch.cat((-qk[..., half:], qk[..., :half]), dim=-1)
            qk = qk * cos + rotated * sin
        query = qk[:, :hq].transpose(0, 1).unsqueeze(0)  # [1, Hq, T, D] views
        key = qk[:, hq:].transpose(0, 1).unsqueeze(0)
        value = qkv[:, hq + hkv :].transpose(0, 1).unsqueeze(0)
        attn = attend(layer, query, key, value)
        out = layer.o_proj(attn.reshape(t, hq * d))
        if layer.attn_out_norm is not None:
            out = self._norm(out, layer.attn_out_norm, layer.eps)
        h = residual + out
        out = layer.mlp(self._norm(h, layer.mlp_in_norm, layer.eps), small)
        if layer.mlp_out_norm is not None:
            out = self._norm(out, layer.mlp_out_norm, layer.eps)
        return h + out

    def head(self, h: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        """Logits of the rows ``keep`` (None: all) of the last hidden states (Gemma: softcapped
        as its own head does)."""
        if keep is not None:
            h = h[keep]
        logits = self.lm_head(self._norm(h, self.final_norm, self.final_eps))
        cap = self.final_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
