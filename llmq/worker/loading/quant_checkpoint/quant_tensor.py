"""A quantized projection as a checkpoint holds it, in one form for every format read here.

``weight[n, k] = (q[n, k] - zero[n, g(k)]) * scale[n, g(k)]``, where ``g(k) = g_idx[k]`` for a
checkpoint quantized in activation order (GPTQ's ``desc_act``: a group's input columns are
spread over the row), else ``k // group``. q and zero are unsigned (0 .. 2**bits - 1; zero may
reach 2**bits for GPTQ's old format), the scale is the checkpoint's, held in float32 (exactly:
fp16/bf16/fp32 all convert without loss).

Dequantized in float32, ``(q - zero) * scale`` is exact for fp16 and bf16 scales (a 5-bit
integer times an 11-bit significand), and is the very operation compressed-tensors performs in
float32 for float32 scales.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Group sizes torch's int4 CPU kernel takes (``_weight_int4pack_mm_for_cpu``).
KERNEL_GROUPS = (256, 128, 64, 32)


@dataclass(slots=True)
class QuantTensor:
    q: torch.Tensor  # [N, K] int32
    scale: torch.Tensor  # [N, G] float32
    zero: torch.Tensor  # [N, G] int32: the q that stands for 0.0
    bits: int
    g_idx: torch.Tensor | None = None  # [K] int64: each input column's group; None: k // group

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    @property
    def group(self) -> int:
        return self.q.shape[1] // self.scale.shape[1]

    def groups(self) -> torch.Tensor:
        """The group of each input column: [K]."""
        if self.g_idx is not None:
            return self.g_idx
        return torch.arange(self.q.shape[1]) // self.group

    def dequantize(self) -> torch.Tensor:
        g = self.groups()
        return (self.q - self.zero[:, g]).float() * self.scale[:, g]

    def column_order(self) -> torch.Tensor | None:
        """The permutation of input columns that makes the groups contiguous (``group`` columns
        each, in group order); None where they already are. Raises where no permutation does
        (a group of another size than the rest)."""
        if self.g_idx is None:
            return None
        k = self.q.shape[1]
        contiguous = torch.arange(k) // self.group
        if torch.equal(self.g_idx, contiguous):
            return None
        order = torch.argsort(self.g_idx, stable=True)
        if not torch.equal(self.g_idx[order], contiguous):
            raise ValueError("g_idx's groups are not all of one size")
        return order

    def kernel(self) -> str | None:
        """Which of torch's weight-only kernels takes this weight as it is: "int4" (4 bits,
        groups a multiple of 32 columns: repeated onto a group the kernel takes), "int8" (8 bits,
        one symmetric scale per output channel), or None: served as float."""
        if self.bits == 4 and self.group % KERNEL_GROUPS[-1] == 0:
            try:
                self.column_order()
            except ValueError:
                return None
            return "int4"
        if self.bits == 8 and self.scale.shape[1] == 1 and bool((self.zero == 128).all()):
            return "int8"
        return None

    def layout(self) -> str:
        """A short description for log lines."""
        contiguous = torch.arange(self.q.shape[1]) // self.group
        spread = self.g_idx is not None and not torch.equal(self.g_idx, contiguous)
        order = ", act-order" if spread else ""
        zeros = "symmetric" if bool((self.zero == 2 ** (self.bits - 1)).all()) else "zero points"
        return f"{self.bits}-bit, group {self.group}, {zeros}{order}"


def kernel_group(group: int) -> int:
    """The largest group the int4 kernel takes that divides ``group`` (a multiple of 32)."""
    return next(g for g in KERNEL_GROUPS if group % g == 0)


def unpack_int32(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Values of ``bits`` (4 or 8) packed into int32 along the last dimension, the lowest bits
    first (GPTQ's, compressed-tensors' and AWQ's shared order before AWQ's interleave): [..., W]
    -> [..., count] int32, unsigned."""
    data = packed.contiguous().view(torch.uint8)  # little-endian: a word's low byte first
    if bits == 4:
        data = torch.stack([data & 15, data >> 4], dim=-1).flatten(-2)
    elif bits != 8:
        raise ValueError(f"{bits}-bit packing is not implemented")
    return data[..., :count].to(torch.int32)
