"""A step's decoder layers in one C++ call (``kernels/step_layers.cpp``), bit-equal to the
Python layer loop with llmq's C++ ops.

It serves a model whose layers share one attention scale, one norm epsilon, one activation and
one set of projection widths, each with a dense MLP; and a step whose attention needs nothing
beyond causal softmax attention and sliding windows (no softcap; a model with KV groups, as
Gemma 3's windowed and global layers, reads each layer's group's tables and window; one
without, every window longer than the step's longest context) with the decodes' block tables
for the attention kernel; LoRA adapters' deltas included. Other steps run the Python loop.
"""

from __future__ import annotations

import torch

from llmq.worker.runner.attention.paged import StepMetadata
from llmq.worker.runner.forward.decoder_layers import ACTIVATION_CODES, DecoderLayer, DenseMLP
from llmq.worker.runner.linear.packed_linear import LAYOUT_CODES, Layout, Linear
from llmq.worker.runner.linear.quantized_linear import Int4Linear, Int6Linear, Int8Linear, Q6KLinear
from llmq.worker.runner.lora.lora_linear import LoraLinear
from llmq.worker.runner.lora.lora_slots import StepAdapters

_NO_TABLE = torch.zeros(0, 1, dtype=torch.int32)  # step_layers' tables without decodes
_NO_CONTEXT = torch.zeros(0, dtype=torch.int32)
_NONE = torch.empty(0)  # step_layers' "this layer has no such tensor"
_NO_ADAPTERS = ([], _NONE, _NONE, [], [])  # StepAdapters.step_layers_args of none


def _projections(layer: DecoderLayer) -> tuple:
    """The layer's qkv, o, gate_up and down projections, as their own (a LoRA wrapper's base:
    step_layers adds the deltas itself)."""
    mlp = layer.mlp
    projections = (layer.qkv_proj, layer.o_proj, mlp.gate_up_proj, mlp.down_proj)
    return tuple(p.base if isinstance(p, LoraLinear) else p for p in projections)


def serves_model(layers: list[DecoderLayer]) -> bool:
    """Whether step_layers can run these layers (uniform scale, eps, activation, widths; each
    projection float, or int8, int6 or int4 on llmq's or torch's integer kernels)."""
    if not all(isinstance(layer.mlp, DenseMLP) for layer in layers):
        return False
    # exactly these: not a checkpoint's permuted kinds
    kinds = (Linear, Int8Linear, Int6Linear, Q6KLinear, Int4Linear)
    if not all(type(p) in kinds for layer in layers for p in _projections(layer)):
        return False
    shapes = {
        (
            layer.scaling,
            layer.eps,
            layer.mlp.activation,
            layer.qkv_proj.out_features,
            layer.o_proj.out_features,
            layer.mlp.gate_up_proj.out_features,
            layer.mlp.down_proj.out_features,
        )
        for layer in layers
    }
    return len(shapes) == 1


def _optional(t: torch.Tensor | None) -> torch.Tensor:
    return _NONE if t is None else t


def layer_tensors(layers: list[DecoderLayer]) -> list[torch.Tensor]:
    """step_layers' weights: per layer its norms (input, attention output, MLP input, MLP output,
    query heads, key heads), then the weights, the biases and the quantized scales of its qkv,
    o, gate_up and down projections (an empty tensor: none)."""
    tensors = []
    for layer in layers:
        projections = _projections(layer)
        tensors += [layer.input_norm, _optional(layer.attn_out_norm), layer.mlp_in_norm]
        tensors += [_optional(layer.mlp_out_norm), _optional(layer.q_norm)]
        tensors += [_optional(layer.k_norm)]
        tensors += [p.weight for p in projections]
        tensors += [_optional(p.bias) for p in projections]
        tensors += [_optional(_scales(p)) for p in projections]
    return tensors


def _scales(projection) -> torch.Tensor | None:
    if isinstance(projection, Int8Linear):
        return projection.scale
    if isinstance(projection, (Int4Linear, Int6Linear)):
        return projection.scales_and_zeros
    return None


def kv_groups(step: StepMetadata) -> list[StepMetadata]:
    """The step's KV groups' metadata (``step_metadata.py``): one but for a model with sliding
    windows, in the order of their first layer."""
    if step.layer_steps is None:
        return [step]
    groups: list[StepMetadata] = []
    for layer_step in step.layer_steps:
        if not any(layer_step is g for g in groups):
            groups.append(layer_step)
    return groups


def _group_lists(step: StepMetadata, layers: list[DecoderLayer], longest: float) -> tuple:
    """step_layers' KV group arguments: per group its slots, decode tables, context lengths
    and window (the one its layers ask in the Python loop: theirs where it is shorter than the
    step's longest context; 0: none); each layer's group; per group and prompt chunk its
    context, blocks and mask."""
    groups = kv_groups(step)
    if step.layer_steps is None:
        layer_group, windows = [0] * len(layers), [0]
    else:
        layer_group = [next(i for i, g in enumerate(groups) if g is s) for s in step.layer_steps]
        windows = []
        for g in range(len(groups)):
            window = layers[layer_group.index(g)].window
            asked = window is not None and window < longest and window < step.max_model_len
            windows.append(window if asked else 0)
    tables = [g.decode_tables for g in groups]
    prompts = [(p, w) for g, w in zip(groups, windows, strict=True) for p in g.prefills]
    return (
        [g.slot_mapping for g in groups],
        [t.block_tables if t is not None else _NO_TABLE for t in tables],
        [t.context_lens if t is not None else _NO_CONTEXT for t in tables],
        windows,
        layer_group,
        [p.ctx_len for p, _ in prompts],
        [p.block_ids for p, _ in prompts],
        [p.window_masks[w] if w else p.mask for p, w in prompts],
    )


def run_layers(
    h: torch.Tensor,
    cos: list[torch.Tensor],
    sin: list[torch.Tensor],
    layers: list[DecoderLayer],
    tensors: list[torch.Tensor],
    layout: Layout,
    heads: tuple[int, int],  # query heads, key/value heads
    step: StepMetadata,
    longest: float,  # the most keys any query of the step sees
    adapters: StepAdapters | None = None,
) -> torch.Tensor:
    """The last layer's hidden states of the step (``layer_tensors(layers)`` as ``tensors``),
    with ``adapters``' LoRA deltas where the step's rows have some."""
    first, prompts = layers[0], step.prefills
    mlp = first.mlp
    slots, tables, contexts, windows, layer_group, *per_prompt = _group_lists(step, layers, longest)
    return torch.ops.llmq.step_layers(
        h,
        cos,
        sin,
        [layer.rotary for layer in layers],
        tensors,
        LAYOUT_CODES.get(layout, LAYOUT_CODES["plain"]),  # a quantized model's float ones: plain
        ACTIVATION_CODES[mlp.activation],
        [p.out_features for p in (first.qkv_proj, first.o_proj, mlp.gate_up_proj, mlp.down_proj)],
        list(step.pool.kv),  # a view a layer (of one storage slot a KV group's layer)
        slots,
        step.num_decodes,
        tables,
        contexts,
        windows,
        layer_group,
        [p.q_start for p in prompts],
        [p.q_len for p in prompts],
        *per_prompt,
        step.pool.block_size,
        heads[0],
        heads[1],
        first.scaling,
        first.eps,
        *(_NO_ADAPTERS if adapters is None else adapters.step_layers_args()),
    )
