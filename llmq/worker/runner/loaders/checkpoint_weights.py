"""A quantized checkpoint's own weights (compressed-tensors, GPTQ, AWQ, fp8) as llmq's quantized
projections.

transformers serves the checkpoint as its float model, the weights dequantized at load
(``model_loader.load_quantized_checkpoint``); this reads the files' integer weights again
(``common/quant_checkpoint``) and repacks them once for the int4/int8 kernels
(``quantized_linear``):

- 4 bits, groups of a multiple of 32 input columns (channel-wise included: one group of K):
  ``Int4Weight`` with the same q, ``scale`` the checkpoint's and ``zero = (8 - z) * scale``, so
  ``(q - 8) * scale + zero == (q - z) * scale`` (exact in float32 for fp16/bf16 scales), each
  group's scale repeated onto the largest group the kernel takes (256/128/64/32) that divides
  it. The kernel holds scale and zero in bfloat16: the weights are the checkpoint's within
  that rounding (2**-9 relative of each).
- Activation order (GPTQ ``desc_act``, a ``g_idx`` whose groups are spread over the row): the
  weight's input columns are permuted once so that each group is contiguous, and each call
  permutes its activations the same way (``PermutedLinear``): the same sums, exactly. Fused
  parts (q, k, v; gate, up) of different permutations run as separate kernel calls.
- 8 bits, one symmetric scale per output channel: ``Int8Weight`` with the same q - 128.
- float8 e4m3 with one scale per output channel (or per tensor), on a device with fp8 matmuls
  (CUDA, compute capability 8.9 or more): ``Fp8Linear`` with the same weights and scales, the
  activations quantized per row as each call runs (vLLM's dynamic fp8); in blocks of
  128 x 128, on a Hopper GPU: ``Fp8BlockLinear``, the activations quantized per 128 columns.
  Parts of other kinds, or whose blocks do not line up once fused, run side by side.

Any other layout, a fused group whose parts differ in kernel, and projections the checkpoint
holds in float (its head, usually) stay float, with a log line.
"""

from __future__ import annotations

import logging
import math

import torch

from llmq.worker.loading.quant_checkpoint.checkpoint import QuantCheckpoint, checkpoint_format
from llmq.worker.loading.quant_checkpoint.fp8_tensor import FP8_BLOCK, Fp8Tensor, serves
from llmq.worker.loading.quant_checkpoint.quant_tensor import QuantTensor, kernel_group
from llmq.worker.runner.linear.dynamic_quantized import Fp8Linear
from llmq.worker.runner.linear.fp8_blocks import Fp8BlockLinear
from llmq.worker.runner.linear.quantized_linear import (
    Int4Linear,
    Int4Weight,
    Int8Weight,
    QuantizedLinear,
    int8_linear,
)

log = logging.getLogger(__name__)

# llmq's fused roles -> the transformers modules they are fused from, by attention/MLP owner
ROLE_MODULES = {
    "qkv": ("self_attn", ("q_proj", "k_proj", "v_proj"), "qkv_proj"),
    "o": ("self_attn", ("o_proj",), None),
    "gate_up": ("mlp", ("gate_proj", "up_proj"), "gate_up_proj"),
    "down": ("mlp", ("down_proj",), None),
}


def int4_weight(parts: list[QuantTensor]) -> tuple[Int4Weight, torch.Tensor | None]:
    """Parts of one input (``kernel() == "int4"``, one column order) as one ``Int4Weight`` of
    their rows in order, its columns permuted by the returned order (None: as they are)."""
    order = parts[0].column_order()
    group = kernel_group(math.gcd(*(p.group for p in parts)))
    qs, scales, zeros = [], [], []
    for part in parts:
        repeat = part.group // group
        qs.append(part.q if order is None else part.q[:, order])
        scales.append(part.scale.repeat_interleave(repeat, dim=1))
        zeros.append(((8 - part.zero) * part.scale).repeat_interleave(repeat, dim=1))
    weight = Int4Weight(torch.cat(qs), torch.cat(scales), torch.cat(zeros), group)
    return weight, order


def int8_weight(parts: list[QuantTensor]) -> Int8Weight:
    """Parts of 8 bits, one symmetric scale per output channel (``kernel() == "int8"``)."""
    q = torch.cat([(p.q - 128).to(torch.int8) for p in parts])
    return Int8Weight(q, torch.cat([p.scale[:, 0] for p in parts]))


def fp8_linear(
    parts: list[Fp8Tensor], bias: torch.Tensor | None, device: torch.device | str = "cpu"
) -> Fp8Linear:
    """Parts in float8 with a scale per row (``kernel() == "fp8"``) as one ``Fp8Linear`` of
    their rows in order, on ``device``: the checkpoint's weights and scales as they are."""
    q = torch.cat([p.q for p in parts]).to(device)
    scale = torch.cat([p.row_scales() for p in parts]).to(device)
    return Fp8Linear(q, scale, bias)


def fp8_block_linear(
    parts: list[Fp8Tensor], bias: torch.Tensor | None, device: torch.device | str = "cpu"
) -> Fp8BlockLinear:
    """Parts in 128 x 128 blocks (``kernel() == "fp8-block"``; each but the last a whole
    number of blocks high) as one ``Fp8BlockLinear`` of their rows in order."""
    q = torch.cat([p.q for p in parts]).to(device)
    scale = torch.cat([p.scale for p in parts]).to(device)
    return Fp8BlockLinear(q, scale, bias)


def _fp8_kernel_linear(parts: list[Fp8Tensor], bias, device):
    kinds = {p.kernel() for p in parts}
    if not all(serves(k, device) for k in kinds):
        return None
    if kinds == {"fp8"}:
        return fp8_linear(parts, bias, device)
    if kinds == {"fp8-block"} and all(p.shape[0] % FP8_BLOCK == 0 for p in parts[:-1]):
        return fp8_block_linear(parts, bias, device)
    return ConcatLinear(
        [
            _fp8_kernel_linear([p], b, device)
            for p, b in zip(parts, _split(bias, parts), strict=True)
        ]
    )


class PermutedLinear:
    """``inner`` on the activations' input columns taken in ``order`` (activation order)."""

    def __init__(self, inner: QuantizedLinear, order: torch.Tensor):
        self.inner, self.order = inner, order
        self.out_features, self.in_features = inner.out_features, inner.in_features
        self.bits, self.bias = inner.bits, inner.bias

    @property
    def weight(self) -> torch.Tensor:
        return self.inner.weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.index_select(-1, self.order))

    def nbytes(self) -> int:
        return self.inner.nbytes() + self.order.nbytes


class ConcatLinear:
    """Fused parts that cannot share one kernel call (other column orders): their outputs
    side by side."""

    def __init__(self, parts: list):
        self.parts = parts
        self.out_features = sum(p.out_features for p in parts)
        self.in_features = parts[0].in_features
        self.bits = parts[0].bits
        self.bias = None

    @property
    def weight(self) -> torch.Tensor:
        return self.parts[0].weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)

    def nbytes(self) -> int:
        return sum(p.nbytes() for p in self.parts)


def _split(bias: torch.Tensor | None, parts: list[QuantTensor]) -> list:
    if bias is None:
        return [None] * len(parts)
    return list(bias.split([p.shape[0] for p in parts]))


def kernel_linear(
    parts: list[QuantTensor | Fp8Tensor],
    bias: torch.Tensor | None,
    device: torch.device | str = "cpu",
):
    """One fused projection on ``device``'s int4/int8 kernels (or fp8 matmuls); None where they
    do not take all its parts."""
    if any(isinstance(p, Fp8Tensor) for p in parts):
        return _fp8_kernel_linear(parts, bias, device)
    kinds = {p.kernel() for p in parts}
    if kinds == {"int8"}:
        return int8_linear(int8_weight(parts).to(device), bias)
    if kinds != {"int4"}:
        return None
    orders = [p.column_order() for p in parts]
    same = all(_same_order(o, orders[0]) for o in orders)
    if not same:
        return ConcatLinear(
            [kernel_linear([p], b, device) for p, b in zip(parts, _split(bias, parts), strict=True)]
        )
    weight, order = int4_weight(parts)
    linear = Int4Linear(weight.to(device), bias)
    return linear if order is None else PermutedLinear(linear, order.to(device))


def _same_order(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


class CheckpointQuantizer:
    """``quantize``'s quantizer for a quantized checkpoint (``llmq_checkpoint_files`` on the
    model's config): each projection from the checkpoint's integer weights; None (float)
    where no kernel takes them. The embedding table stays float."""

    def __init__(self, forward):
        model = forward.model
        config = model.config
        fmt = checkpoint_format(config.llmq_checkpoint_quantization)
        self.checkpoint = QuantCheckpoint(config.llmq_checkpoint_files, fmt)
        self.names = {id(m): name for name, m in model.named_modules()}
        self.decoder_layers = forward.inner.layers
        self.head = self.names[id(model.lm_head)]
        self.kept: list[str] = []

    def members(self, index: int, role: str) -> list[str]:
        """The module names fused into layer ``index``'s projection ``role``."""
        owner_attr, names, fused = ROLE_MODULES[role]
        owner = getattr(self.decoder_layers[index], owner_attr)
        prefix = self.names[id(owner)]
        if fused is not None and hasattr(owner, fused):  # Phi-3: fused in the checkpoint
            return [f"{prefix}.{fused}"]
        return [f"{prefix}.{name}" for name in names]

    def linear(self, index: int, role: str, plain) -> QuantizedLinear | None:
        names = [self.head] if index < 0 else self.members(index, role)
        parts = [self.checkpoint.quant(name) for name in names]
        linear = None
        if all(p is not None for p in parts):
            linear = kernel_linear(parts, plain.bias, plain.weight.device)
        if linear is not None and not _same_weights(parts, plain.weight):
            log.warning("%s: the checkpoint's weights differ from the loaded ones", names[0])
            linear = None
        if linear is None:
            log.info("%s: served as float (%s)", names[0], _why(parts))
        return linear

    def embedding(self, table: torch.Tensor) -> None:
        return None


def _same_weights(parts: list[QuantTensor], loaded: torch.Tensor) -> bool:
    """Whether the parts, fused, are the weights transformers loaded (their dequantized ones in
    the model's dtype): a check, once at load, that the names map onto the right modules."""
    ours = torch.cat([p.dequantize() for p in parts])
    if ours.shape != loaded.shape:
        return False
    return torch.equal(ours.to(loaded.dtype), loaded.cpu())


def _why(parts: list[QuantTensor | None]) -> str:
    if any(p is None for p in parts):
        return "float in the checkpoint"
    return "; ".join(sorted({p.layout() for p in parts}))
