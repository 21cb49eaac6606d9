"""A lean forward pass for Llama-family decoders (Llama, Qwen2, Mistral): the same arithmetic as
transformers' modules, op for op, without their per-call machinery.

At small batches a step is bound by per-op overhead, not by arithmetic: transformers' forward
goes through module calls, output-capturing hooks and kwargs plumbing for every one of ~40 ops
per layer, which measured about two thirds of a batch-1 decode step on 2 cores. This walks the
layers itself with the models' own weights: query, key and value projections in one matmul
(one read of the activations, one kernel launch), gate and up in another, rotary embedding
applied to queries and keys together, and attention through the paged kernel. In bfloat16 on
CPU the projections' weights are packed once (``packed_linear``: for llmq's own matmul where
its kernels are loaded, else for oneDNN's). The elementwise arithmetic is transformers' own, so
float32 greedy output stays equal to ``generate``.

Models it does not know (other architectures, or options such as sliding windows that it does
not implement) keep transformers' forward with the paged attention registered through
``AttentionInterface``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llmq.worker.runner.attention import StepMetadata, paged_attention
from llmq.worker.runner.packed_linear import (
    LAYOUT_CODES,
    Layout,
    Linear,
    can_pack,
    choose_panel_sums,
    panels_fit,
)

SUPPORTED_MODEL_TYPES = {"llama", "qwen2", "mistral"}
# Where llmq's C++ ops are loaded, a step runs every layer in one C++ call
# (``kernels/step_layers.cpp``). The Python loop below serves where they are not (and the
# tests, as the reference): with them, steps of fewer tokens than this run their norms, rotary
# embedding and activation through the same ops (``kernels/small_step_ops.cpp``), larger ones
# torch's.
SMALL_STEP_OPS_TOKENS = 16
_NO_TABLE = torch.zeros(0, 1, dtype=torch.int32)  # step_layers' tables without decodes
_NO_CONTEXT = torch.zeros(0, dtype=torch.int32)


@dataclass(slots=True)
class _Layer:
    module: torch.nn.Module  # the attention module (carries layer_idx for the paged kernel)
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    eps: float
    qkv_proj: Linear
    o_proj: Linear
    gate_up_proj: Linear
    down_proj: Linear
    scaling: float


# (layer, query [1, Hq, T, D], key [1, Hkv, T, D], value) -> attention output [..., T, Hq, D]
Attend = Callable[[_Layer, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def supports(model: torch.nn.Module) -> bool:
    config = model.config
    if getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return False
    if getattr(config, "hidden_act", "silu") != "silu":
        return False
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return False
    if getattr(config, "pretraining_tp", 1) not in (None, 1):
        return False
    inner = getattr(model, "model", None)
    return inner is not None and hasattr(inner, "layers") and hasattr(model, "lm_head")


def build_forward(
    model: torch.nn.Module, fast_forward: bool, pack: bool, kernels: bool = False
) -> DecoderForward | None:
    """llmq's forward for ``model`` where it is asked for and supports the architecture; None:
    transformers' own. ``kernels``: llmq's C++ kernels are loaded (packing may use its matmul)."""
    if not (fast_forward and supports(model)):
        return None
    return DecoderForward(model, pack=pack, kernels=kernels)


def _layout(layer: torch.nn.Module, pack: bool, kernels: bool) -> Layout:
    """How the projections of a model whose first decoder layer is ``layer`` are packed."""
    down, query = layer.mlp.down_proj.weight, layer.self_attn.q_proj.weight
    if pack and kernels and panels_fit(down) and panels_fit(query):  # both input widths
        return "panels"
    # oneDNN's packing only where it gives F.linear's bits.
    return "onednn" if pack and can_pack(down) else "plain"


def attach(model: torch.nn.Module, forward: DecoderForward) -> None:
    """Keep a forward built ahead of the runner (``worker/preload.py``) on its model."""
    model.__dict__["_llmq_forward"] = forward


def take_attached(model: torch.nn.Module) -> DecoderForward | None:
    """The forward ``attach`` kept on the model, once."""
    return model.__dict__.pop("_llmq_forward", None)


def _own_memory(model: torch.nn.Module, fused: set[int]) -> None:
    """Copy the weights still in the model (the embedding, the norms, a head) out of the file
    they were loaded from. Loaded from a safetensors file of their own dtype they are views of
    the file's mapping, and the whole mapping stays resident while any one of them lives, long
    after the projections were fused into memory of their own: on the SmolLM2-135M shape in
    bfloat16 a worker held the 269 MB file besides its fused weights (RSS after building this
    forward 932 MiB, with the copies 727 MiB). ``fused``: the storages of the fused weights,
    which the modules' weights view unpacked."""
    for param in model.parameters():  # shared (tied) parameters come once
        if param.numel() and param.untyped_storage().data_ptr() not in fused:
            param.data = param.data.clone()


def _fuse(*linears: torch.nn.Linear, layout: Layout, fused_storages: set[int]) -> Linear:
    """One projection for several of the same input (one read of the activations, one kernel).

    Unpacked, the modules' own weights become views of the fused one, so the model's memory does
    not grow; packed, the modules' weights are released (this forward is then the only one)."""
    fused = torch.cat([lin.weight.detach() for lin in linears])
    biases = [lin.bias for lin in linears]
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat(
            [
                b.detach() if b is not None else lin.weight.new_zeros(lin.out_features)
                for b, lin in zip(biases, linears, strict=True)
            ]
        )
    pack = layout != "plain"
    if not pack:
        fused_storages.add(fused.untyped_storage().data_ptr())
    row = 0
    for lin in linears:
        n = lin.out_features
        lin.weight.data = fused.new_empty(0) if pack else fused[row : row + n]
        row += n
    return Linear(fused, bias, layout)


class DecoderForward:
    """``__call__(input_ids, positions, keep, step)`` -> logits of the kept rows."""

    def __init__(self, model: torch.nn.Module, pack: bool = True, kernels: bool = False):
        config = model.config
        self.model = model
        self.inner = model.model
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        self.split = (q, kv, kv)
        self.intermediate = config.intermediate_size
        layers = self.inner.layers[: config.num_hidden_layers]
        # bfloat16 on CPU: weights packed once, for llmq's matmul or oneDNN's.
        self.layout = layout = _layout(layers[0], pack, kernels)
        self.packed = layout != "plain"
        if layout == "panels":
            choose_panel_sums()
        fused: set[int] = set()  # storages of the fused weights (unpacked)
        self.layers: list[_Layer] = []
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append(
                _Layer(
                    module=attn,
                    input_norm=layer.input_layernorm.weight,
                    post_norm=layer.post_attention_layernorm.weight,
                    eps=layer.input_layernorm.variance_epsilon,
                    qkv_proj=_fuse(
                        attn.q_proj, attn.k_proj, attn.v_proj, layout=layout, fused_storages=fused
                    ),
                    o_proj=_fuse(attn.o_proj, layout=layout, fused_storages=fused),
                    gate_up_proj=_fuse(
                        mlp.gate_proj, mlp.up_proj, layout=layout, fused_storages=fused
                    ),
                    down_proj=_fuse(mlp.down_proj, layout=layout, fused_storages=fused),
                    scaling=attn.scaling,
                )
            )
        self.small_step_ops = False  # set by the runner where the C++ ops are loaded
        self._cpp_weights: list[torch.Tensor] | None = None  # step_layers' weights, in order
        # step_layers takes one attention scale and one norm epsilon for all layers.
        self._uniform_layers = len({(layer.scaling, layer.eps) for layer in self.layers}) == 1
        first = self.layers[0]  # and one output width per projection (qkv, o, gate_up, down)
        self._out_features = [
            p.out_features
            for p in (first.qkv_proj, first.o_proj, first.gate_up_proj, first.down_proj)
        ]
        self.final_norm = self.inner.norm.weight
        self.final_eps = self.inner.norm.variance_epsilon
        _own_memory(model, fused)
        head = model.lm_head
        tied = head.weight.data_ptr() == self.inner.embed_tokens.weight.data_ptr()
        # A head tied to the embedding keeps its weight (the embedding reads it); packed, the
        # head holds a copy in the blocked layout.
        self.lm_head = Linear(head.weight.detach(), head.bias, layout)
        if self.packed and not tied:
            head.weight.data = head.weight.new_empty(0)

    def _cpp_ops(self) -> bool:
        """Whether llmq's C++ ops serve: loaded, and not while torch.compile traces the layers
        (it cannot see into them)."""
        return self.small_step_ops and not torch.compiler.is_compiling()

    def _small(self, tokens: int) -> bool:
        """Whether the Python loop runs a step of ``tokens`` through the C++ small-step ops."""
        return tokens < SMALL_STEP_OPS_TOKENS and self._cpp_ops()

    def _norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if self._small(x.shape[0]):
            return torch.ops.llmq.rms_norm(x, weight, eps)
        return self._rms_norm(x, weight, eps)

    @staticmethod
    def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # transformers' LlamaRMSNorm, op for op (float32 statistics, cast back, then scale).
        dtype = x.dtype
        x = x.to(torch.float32)
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + eps)
        return weight * x.to(dtype)

    @torch.inference_mode()
    def __call__(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        keep: torch.Tensor,  # rows whose logits are wanted
        step: StepMetadata,
    ) -> torch.Tensor:
        if self._whole_step_in_cpp(step):
            return self._step_in_cpp(input_ids, positions, keep, step)

        def attend(layer: _Layer, query, key, value) -> torch.Tensor:
            out, _ = paged_attention(
                layer.module, query, key, value, None, scaling=layer.scaling, llmq_step=step
            )
            return out

        return self.run(input_ids, positions, keep, attend)

    def _whole_step_in_cpp(self, step: StepMetadata) -> bool:
        """Every layer in one C++ call (``kernels/step_layers.cpp``), bit-equal to this loop
        with the C++ ops, where they serve and the attention kernel serves the decodes."""
        return (
            self._uniform_layers
            and (step.decode_tables is not None or not step.num_decodes)
            and self._cpp_ops()
        )

    def _layer_tensors(self) -> list[torch.Tensor]:
        """step_layers' weights: per layer its two norms, then the weights and the biases
        (an empty tensor: none) of its qkv, o, gate_up and down projections."""
        if self._cpp_weights is None:
            tensors = []
            for layer in self.layers:
                projections = (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
                tensors += [layer.input_norm, layer.post_norm]
                tensors += [p.weight for p in projections]
                tensors += [p.bias if p.bias is not None else torch.empty(0) for p in projections]
            self._cpp_weights = tensors
        return self._cpp_weights

    def _step_in_cpp(self, input_ids, positions, keep, step: StepMetadata) -> torch.Tensor:
        h, cos, sin = self.embed(input_ids, positions)
        tables, first, prompts = step.decode_tables, self.layers[0], step.prefills
        h = torch.ops.llmq.step_layers(
            h,
            cos,
            sin,
            self._layer_tensors(),
            LAYOUT_CODES[self.layout],
            self._out_features,
            step.pool.kv,
            step.slot_mapping,
            step.num_decodes,
            tables.block_tables if tables is not None else _NO_TABLE,
            tables.context_lens if tables is not None else _NO_CONTEXT,
            [p.q_start for p in prompts],
            [p.q_len for p in prompts],
            [p.ctx_len for p in prompts],
            [p.block_ids for p in prompts],
            [p.mask for p in prompts],
            step.pool.block_size,
            self.num_heads,
            self.num_kv_heads,
            first.scaling,
            first.eps,
        )
        return self.head(h, keep)

    def run(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        keep: torch.Tensor | None,  # rows whose logits are wanted; None: all
        attend: Attend,
    ) -> torch.Tensor:
        h, cos, sin = self.embed(input_ids, positions)
        for layer in self.layers:
            h = self.layer(h, cos, sin, layer, attend)
        return self.head(h, keep)

    def embed(
        self, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The tokens' embeddings [T, hidden] and their rotary cos and sin [T, 1, head_dim]."""
        h = self.inner.embed_tokens(input_ids)
        cos, sin = self.inner.rotary_emb(h.unsqueeze(0), positions.unsqueeze(0))  # [1, T, D]
        return h, cos[0].unsqueeze(1), sin[0].unsqueeze(1)

    def layer(
        self,
        h: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,
        sin: torch.Tensor,
        layer: _Layer,
        attend: Attend,
    ) -> torch.Tensor:
        """One decoder layer, with ``attend`` as its attention (the compiled decode step brings
        its own, traceable one)."""
        t = h.shape[0]
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        half = d // 2
        inter = self.intermediate
        small = self._small(t)
        residual = h
        x = self._norm(h, layer.input_norm, layer.eps)
        qkv = layer.qkv_proj(x).view(t, hq + 2 * hkv, d)
        # Rotary embedding on queries and keys at once: q * cos + rotate_half(q) * sin.
        if small:
            qk = torch.ops.llmq.rotary(qkv, cos, sin, hq + hkv)
        else:
            qk = qkv[:, : hq + hkv]
            rotated = torch.cat((-qk[..., half:], qk[..., :half]), dim=-1)
            qk = qk * cos + rotated * sin
        query = qk[:, :hq].transpose(0, 1).unsqueeze(0)  # [1, Hq, T, D] views
        key = qk[:, hq:].transpose(0, 1).unsqueeze(0)
        value = qkv[:, hq + hkv :].transpose(0, 1).unsqueeze(0)
        attn = attend(layer, query, key, value)
        h = residual + layer.o_proj(attn.reshape(t, hq * d))
        residual = h
        x = self._norm(h, layer.post_norm, layer.eps)
        gate_up = layer.gate_up_proj(x)
        if small:
            return residual + layer.down_proj(torch.ops.llmq.silu_mul(gate_up))
        return residual + layer.down_proj(F.silu(gate_up[:, :inter]) * gate_up[:, inter:])

    def head(self, h: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        """Logits of the rows ``keep`` (None: all) of the last hidden states."""
        if keep is not None:
            h = h[keep]
        return self.lm_head(self._norm(h, self.final_norm, self.final_eps))
