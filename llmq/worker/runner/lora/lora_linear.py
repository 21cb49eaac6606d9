"""LoRA adapters applied in llmq's forward, several in one step: each token row carries its
sequence's adapter (or none), and every adapter present adds its delta
``(x[rows] @ A.T) @ B.T * scale`` to its rows of each projection it targets.

The layers' projections (plain, packed or quantized: ``Linear``, ``Int8Linear``, ``Int4Linear``)
are wrapped once, when the first adapter is loaded, by :class:`LoraLinear`, which calls the base
projection unchanged and adds the step's deltas while a step with adapter rows runs (a model
that never serves an adapter keeps its projections as they are). The fused C++ step
(``kernels/step_layers.cpp``) adds the same deltas itself; CUDA graphs and the compiled decode
step serve only steps without adapter rows.

The deltas themselves are computed from the loaded adapters' stacked weights
(``lora_slots``): a few batched matmuls per projection for all the step's adapters together.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch

from llmq.worker.engine.sequence import LoraRef
from llmq.worker.runner.forward.decoder_layers import DenseMLP
from llmq.worker.runner.lora.lora_slots import LoraSlots, StepAdapters
from llmq.worker.runner.lora.lora_weights import AdapterWeights, BaseShape
from llmq.worker.runner.packed_batch import PackedBatch


class LoraState:
    """The loaded adapters' slots, and the step's adapters as every wrapped projection of one
    forward sees them."""

    def __init__(self, shape: BaseShape, slots: LoraSlots | None = None):
        self.shape = shape
        self.slots = slots
        self.step: StepAdapters | None = None

    @contextmanager
    def applying(self, step: StepAdapters) -> Iterator[None]:
        self.step = step
        try:
            yield
        finally:
            self.step = None


class LoraLinear:
    """A base projection plus the deltas of the adapters of the step's rows (none: the base's
    output as it is). Reads as the base (``weight``, ``bias``, ``out_features``...)."""

    def __init__(self, base, layer: int, role: str, state: LoraState):
        self.base = base
        self.layer = layer
        self.role = role
        self.state = state

    def __getattr__(self, name: str):
        if name == "base":  # not set yet (a copy being built)
            raise AttributeError(name)
        return getattr(self.base, name)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        step = self.state.step
        if step is None:
            return y
        return step.add_deltas(x, y, self.layer, self.role)


def base_shape(forward) -> BaseShape:
    """What an adapter of ``forward``'s model must fit. Raises ValueError for a model whose
    layers llmq cannot wrap (a mixture of experts, layers of different widths)."""
    layers = forward.layers
    if not all(isinstance(layer.mlp, DenseMLP) for layer in layers):
        raise ValueError("LoRA adapters are not served on a mixture-of-experts model")
    widths_seen = {
        (layer.qkv_proj.out_features, layer.o_proj.out_features, layer.mlp.intermediate)
        for layer in layers
    }
    if len(widths_seen) != 1:
        raise ValueError("LoRA adapters are not served on a model whose layers differ in width")
    hidden = forward.model.config.get_text_config().hidden_size
    q, kv = forward.num_heads * forward.head_dim, forward.num_kv_heads * forward.head_dim
    inter = layers[0].mlp.intermediate
    widths = {
        "q_proj": (q, hidden),
        "k_proj": (kv, hidden),
        "v_proj": (kv, hidden),
        "o_proj": (hidden, q),
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
    }
    first = forward.inner.layers[0]
    parts = frozenset(
        name for name in widths if hasattr(first.self_attn, name) or hasattr(first.mlp, name)
    )
    return BaseShape(len(layers), widths, parts)


def install(forward, max_loras: int, dtype: torch.dtype) -> LoraState:
    """Wrap ``forward``'s projections (once), with ``max_loras`` slots of ``dtype``; the state
    through which steps pass adapters."""
    if forward.loras is not None:
        return forward.loras
    shape = base_shape(forward)
    device = forward.model.lm_head.weight.device
    kernel = device.type == "cpu" and forward.small_step_ops  # kernels/lora_deltas.cpp
    state = LoraState(shape, LoraSlots(shape, max_loras, dtype, device, kernel))
    for index, layer in enumerate(forward.layers):
        layer.qkv_proj = LoraLinear(layer.qkv_proj, index, "qkv", state)
        layer.o_proj = LoraLinear(layer.o_proj, index, "o", state)
        mlp = layer.mlp
        mlp.gate_up_proj = LoraLinear(mlp.gate_up_proj, index, "gate_up", state)
        mlp.down_proj = LoraLinear(mlp.down_proj, index, "down", state)
    forward.loras = state
    return state


def step_adapters(
    batch: PackedBatch, resident: Mapping[LoraRef, AdapterWeights], slots: LoraSlots
) -> StepAdapters | None:
    """The adapters of a packed step's rows (``resident``: the loaded adapters, in
    ``slots``); None: no row has one."""
    rows: dict[LoraRef, list[int]] = {}
    for row, item in enumerate(batch.decodes):
        if item.seq.lora is not None:
            rows.setdefault(item.seq.lora, []).append(row)
    for item, q_start in batch.prefills:
        if item.seq.lora is not None:
            chunk = range(q_start, q_start + item.num_new_tokens)
            rows.setdefault(item.seq.lora, []).extend(chunk)
    if not rows:
        return None
    groups = [(resident[ref].slot, ref_rows) for ref, ref_rows in rows.items()]
    return StepAdapters(groups, slots, len(batch.input_ids))
