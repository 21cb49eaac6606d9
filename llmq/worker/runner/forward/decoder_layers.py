"""The decoder layers as llmq's forward holds them: fused projections, norms and what each
layer's attention asks for, taken from a transformers model of a family ``decoder_families``
knows.

A layer's MLP is one callable (:class:`LayerMLP`): :class:`DenseMLP` here (gate and up in one
projection, then the activation and down); a mixture of experts plugs in the same way. Norm
weights are held as the norm uses them: a Llama-style norm's weight in the model's dtype, a
Gemma-style norm's ``1 + weight`` in float32 (its product is taken in float32, as transformers'
``Gemma3RMSNorm`` does), so one norm function serves both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from llmq.worker.runner.forward.decoder_families import Family, norm_eps
from llmq.worker.runner.forward.moe import from_block, is_moe_block
from llmq.worker.runner.linear.packed_linear import Layout, Linear
from llmq.worker.runner.loaders import mapped_pages
from llmq.worker.runner.malloc_tuning import return_freed_memory

ACTIVATION_CODES = {"silu": 0, "gelu_tanh": 1}  # step_layers.cpp's


class LayerMLP(Protocol):
    """A layer's MLP: ``mlp(x, cpp_ops)`` -> [T, hidden]; ``cpp_ops``: llmq's C++ small-step
    ops may serve this step (few tokens, the kernels loaded)."""

    def __call__(self, x: torch.Tensor, cpp_ops: bool) -> torch.Tensor: ...


class DenseMLP:
    """down(act(gate(x)) * up(x)), gate and up in one projection."""

    def __init__(self, gate_up_proj: Linear, down_proj: Linear, activation: str):
        self.gate_up_proj = gate_up_proj
        self.down_proj = down_proj
        self.activation = activation
        self.intermediate = gate_up_proj.out_features // 2

    def __call__(self, x: torch.Tensor, cpp_ops: bool) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        inter = self.intermediate
        if self.activation == "gelu_tanh":
            return self.down_proj(
                F.gelu(gate_up[:, :inter], approximate="tanh") * gate_up[:, inter:]
            )
        if cpp_ops:
            return self.down_proj(torch.ops.llmq.silu_mul(gate_up))
        return self.down_proj(F.silu(gate_up[:, :inter]) * gate_up[:, inter:])


@dataclass(slots=True)
class DecoderLayer:
    module: torch.nn.Module  # the attention module (carries layer_idx for the paged kernel)
    input_norm: torch.Tensor
    mlp_in_norm: torch.Tensor
    eps: float
    qkv_proj: Linear
    o_proj: Linear
    mlp: LayerMLP
    scaling: float
    window: int | None = None  # sliding window; None: full causal attention
    softcap: float | None = None  # attention logit softcap (Gemma 2)
    attn_out_norm: torch.Tensor | None = None  # Gemma: the attention's output normed
    mlp_out_norm: torch.Tensor | None = None  # Gemma: the MLP's output normed
    q_norm: torch.Tensor | None = None  # Qwen 3, Gemma 3: per query head
    k_norm: torch.Tensor | None = None  # and per key head
    rotary: int = 0  # which of the step's rotary cos/sin the layer uses


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorms, op for op: Llama's (float32 statistics, cast back, then times the
    weight), or Gemma's where ``weight`` is its float32 ``1 + weight`` on reduced-precision
    activations (scaled and weighted in float32, cast back once). In float32 both are one."""
    dtype = x.dtype
    x = x.to(torch.float32)
    variance = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + eps)
    if weight.dtype != dtype:
        return (x * weight).to(dtype)
    return weight * x.to(dtype)


def _norm_weight(norm: torch.nn.Module, unit_offset: bool) -> torch.Tensor:
    """The weight as the norm uses it: Gemma's ``1.0 + weight.float()`` computed once, else the
    parameter itself (``own_memory`` may move its data later)."""
    if unit_offset:
        return 1.0 + norm.weight.detach().float()
    return norm.weight


@dataclass
class WeightCopies:
    """What building the layers does with the weights it copies out of the model: ``fused``
    collects the storages of unpacked fused weights (the modules' weights view them);
    ``released`` counts the bytes of file pages released once copied; ``finish_layer(index,
    layer)`` is applied to each layer as soon as it is built (quantizing it: the float copies
    of one layer at a time are alive, not the whole model's)."""

    fused: set[int] = field(default_factory=set)
    released: int = 0
    finish_layer: Callable[[int, DecoderLayer], None] | None = None


def fuse(*linears: torch.nn.Linear, layout: Layout, copies: WeightCopies) -> Linear:
    """One projection for several of the same input (one read of the activations, one kernel).

    Unpacked, the modules' own weights become views of the fused one, so the model's memory does
    not grow; packed, the modules' weights are released (this forward is then the only one)."""
    fused = torch.cat([lin.weight.detach() for lin in linears])
    for lin in linears:
        copies.released += mapped_pages.release(lin.weight.detach())
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
        copies.fused.add(fused.untyped_storage().data_ptr())
    row = 0
    for lin in linears:
        n = lin.out_features
        lin.weight.data = fused.new_empty(0) if pack else fused[row : row + n]
        row += n
    return Linear(fused, bias, layout)


def _projections(
    attn, mlp, activation: str, layout: Layout, copies: WeightCopies
) -> tuple[Linear, Linear, LayerMLP]:
    """qkv, o and the MLP of a layer (Phi-3's come fused in the checkpoint)."""
    if hasattr(attn, "qkv_proj"):
        qkv = fuse(attn.qkv_proj, layout=layout, copies=copies)
    else:
        qkv = fuse(attn.q_proj, attn.k_proj, attn.v_proj, layout=layout, copies=copies)
    if is_moe_block(mlp):  # Qwen3-MoE, Mixtral: llmq's grouped experts
        o = fuse(attn.o_proj, layout=layout, copies=copies)
        moe = from_block(mlp, layout)
        copies.fused.update(moe.storages())
        return qkv, o, moe
    if hasattr(mlp, "gate_up_proj"):
        gate_up = fuse(mlp.gate_up_proj, layout=layout, copies=copies)
    else:
        gate_up = fuse(mlp.gate_proj, mlp.up_proj, layout=layout, copies=copies)
    o = fuse(attn.o_proj, layout=layout, copies=copies)
    down = fuse(mlp.down_proj, layout=layout, copies=copies)
    return qkv, o, DenseMLP(gate_up, down, activation)


def build_layers(
    layers: list[torch.nn.Module], family: Family, layout: Layout, copies: WeightCopies
) -> list[DecoderLayer]:
    """The fast forward's layers from the model's ``layers`` (their projections fused, and
    packed for ``layout``)."""
    out = []
    offset = family.unit_offset_norms
    for index, layer in enumerate(layers):
        attn, mlp = layer.self_attn, layer.mlp
        qkv, o, dense = _projections(attn, mlp, family.activation, layout, copies)
        asked = family.attention[index]
        gemma = hasattr(layer, "pre_feedforward_layernorm")
        out.append(
            DecoderLayer(
                module=attn,
                input_norm=_norm_weight(layer.input_layernorm, offset),
                mlp_in_norm=_norm_weight(
                    layer.pre_feedforward_layernorm if gemma else layer.post_attention_layernorm,
                    offset,
                ),
                eps=norm_eps(layer.input_layernorm),
                qkv_proj=qkv,
                o_proj=o,
                mlp=dense,
                scaling=asked.scaling,
                window=asked.window,
                softcap=asked.softcap,
                attn_out_norm=_norm_weight(layer.post_attention_layernorm, offset)
                if gemma
                else None,
                mlp_out_norm=_norm_weight(layer.post_feedforward_layernorm, offset)
                if gemma
                else None,
                q_norm=_norm_weight(attn.q_norm, offset) if hasattr(attn, "q_norm") else None,
                k_norm=_norm_weight(attn.k_norm, offset) if hasattr(attn, "k_norm") else None,
                rotary=family.layer_rotary[index],
            )
        )
        if copies.finish_layer is not None:
            copies.finish_layer(index, out[-1])
        return_freed_memory()  # this layer's temporary copies
    return out


def own_memory(model: torch.nn.Module, copies: WeightCopies) -> None:
    """Copy the weights still in the model (the embedding, the norms, a head) out of the file
    they were loaded from. Loaded from a safetensors file of their own dtype they are views of
    the file's mapping, and the whole mapping stays resident while any one of them lives, long
    after the projections were fused into memory of their own, so a worker would hold the
    whole file besides its fused weights (docs/performance.md, "Choices: memory"). The fused
    weights (``copies.fused``), which the modules' weights view unpacked, are left."""
    for param in model.parameters():  # shared (tied) parameters come once
        if param.numel() and param.untyped_storage().data_ptr() not in copies.fused:
            original = param.data
            param.data = original.clone()
            copies.released += mapped_pages.release(original)
