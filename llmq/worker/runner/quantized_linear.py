"""Projections with quantized weights on torch's CPU weight-only kernels.

- ``Int8Linear``: W8A16, int8 weights with one symmetric scale per output channel, on
  ``aten._weight_int8pack_mm``.
- ``Int4Linear``: W4A16, 4-bit weights in groups of 32 input columns (64, 128 or 256 for a
  quantized checkpoint's), one scale and one zero per group and output channel
  (``w = (q - 8) * scale + zero``, q in 0..15), on
  ``aten._convert_weight_to_int4pack_for_cpu`` + ``aten._weight_int4pack_mm_for_cpu``.

Both kernels have vectorized (AVX2 / AVX-512) paths for bfloat16 activations only: float32
activations fall to scalar code, measured 6-17x slower than bfloat16 on a 2-core AVX2 EPYC (a
16,384 x 2,048 matrix at one row: int8 91 ms against 11 ms, int4 157 ms against 9 ms). So the
activations enter the kernels in bfloat16 (the A16 of W8A16) whatever the model's dtype, and
the output comes back in it.

Tolerance (tested over odd shapes): against the float32 matmul of the bfloat16-rounded
activations with the dequantized weights, each output is within ``2**-8`` of its magnitude (the
kernels round their output to bfloat16) plus ``1e-5`` of ``|x| @ |w|.T`` (float32 sums in
another order).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

GROUP = 32  # int4 group size: llama.cpp's Q4_K sub-block, and exact for GGUF Q4_K
ACTIVATIONS = torch.bfloat16  # the kernels' fast path
_INT8_K_MULTIPLE = (
    16  # _weight_int8pack_mm crashes on other widths (torch 2.13; 24, 40, 56 on AVX2)
)
_INT4_N_MULTIPLE = 16  # _convert_weight_to_int4pack_for_cpu's requirement


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(slots=True)
class Int8Weight:
    """``weight ~= q * scale[:, None]``: q int8 [N, K] in -127..127, scale [N] (bfloat16)."""

    q: torch.Tensor
    scale: torch.Tensor

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int8Weight:
        w = weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12).to(ACTIVATIONS)
        q = torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
        return cls(q, scale)

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scale.float()[:, None]


@dataclass(slots=True)
class Int4Weight:
    """``weight ~= (q - 8) * scale + zero`` per group of ``group`` input columns (32, 64, 128 or
    256: the kernel's): q [N, K] in 0..15 (int32 here, packed by ``Int4Linear``), scale and zero
    [N, K / group] (bfloat16 for the kernel; a checkpoint's float32 ones are rounded to it by
    ``Int4Linear``)."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    group: int = GROUP

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int4Weight:
        """Asymmetric min/max per group; q computed against the stored (rounded) scale and
        zero, so that the dequantized weight is the nearest the stored numbers allow."""
        n, k = weight.shape
        if k % GROUP:
            raise ValueError(f"int4 needs input widths in multiples of {GROUP}, not {k}")
        w = weight.detach().float().view(n, k // GROUP, GROUP)
        low, high = w.amin(dim=2), w.amax(dim=2)
        scale = ((high - low) / 15).clamp(min=1e-12).to(ACTIVATIONS)
        zero = (low + 8 * scale.float()).to(ACTIVATIONS)
        base = zero.float() - 8 * scale.float()  # the value of q = 0
        q = torch.round((w - base[..., None]) / scale.float()[..., None]).clamp(0, 15)
        return cls(q.view(n, k).to(torch.int32), scale, zero)

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        q = self.q.float().view(n, k // self.group, self.group)
        w = (q - 8) * self.scale.float()[..., None] + self.zero.float()[..., None]
        return w.view(n, k)


class Int8Linear:
    """``y = x @ dequantize(weight).T + bias`` for 2-D ``x`` on ``_weight_int8pack_mm``."""

    bits = 8

    def __init__(self, weight: Int8Weight, bias: torch.Tensor | None):
        n, k = weight.q.shape
        self.out_features, self.in_features = n, k
        self.pad = _round_up(k, _INT8_K_MULTIPLE) - k
        self.q = F.pad(weight.q, (0, self.pad)) if self.pad else weight.q
        self.scale = weight.scale.to(ACTIVATIONS)
        self.bias = bias

    @property
    def weight(self) -> torch.Tensor:  # what a caller that reads ``.weight`` should find
        return self.q

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        a = x.to(ACTIVATIONS)
        if self.pad:
            a = F.pad(a, (0, self.pad))
        y = torch.ops.aten._weight_int8pack_mm(a.contiguous(), self.q, self.scale).to(dtype)
        return y + self.bias if self.bias is not None else y

    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes


class Int4Linear:
    """``y = x @ dequantize(weight).T + bias`` for 2-D ``x`` on torch's int4pack kernels
    (output channels padded to a multiple of 16 with zero rows)."""

    bits = 4

    def __init__(self, weight: Int4Weight, bias: torch.Tensor | None):
        n, k = weight.q.shape
        self.out_features, self.in_features = n, k
        rows = _round_up(n, _INT4_N_MULTIPLE) - n
        q, scale, zero = weight.q, weight.scale, weight.zero
        if rows:
            q = F.pad(q, (0, 0, 0, rows), value=8)
            scale, zero = F.pad(scale, (0, 0, 0, rows)), F.pad(zero, (0, 0, 0, rows))
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)
        # The kernel's layout: [K / group, N, 2], scale then zero.
        self.scales_and_zeros = torch.stack([scale.t(), zero.t()], dim=2).to(ACTIVATIONS)
        self.group = weight.group
        self.bias = bias

    @property
    def weight(self) -> torch.Tensor:
        return self.packed

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        a = x.to(ACTIVATIONS).contiguous()
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            a, self.packed, self.group, self.scales_and_zeros
        )
        if y.shape[1] != self.out_features:
            y = y[:, : self.out_features]
        y = y.to(dtype)
        return y + self.bias if self.bias is not None else y

    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales_and_zeros.nbytes


QuantizedLinear = Int8Linear | Int4Linear


def quantized_linear(weight: torch.Tensor, bias: torch.Tensor | None, bits: int) -> QuantizedLinear:
    """``weight`` [N, K] (any float dtype) quantized to ``bits`` (8, or 4 where K is a multiple
    of the group: else 8)."""
    if bits == 4 and weight.shape[1] % GROUP == 0:
        return Int4Linear(Int4Weight.quantize(weight), bias)
    if bits not in (4, 8):
        raise ValueError(f"unsupported weight bits {bits}")
    return Int8Linear(Int8Weight.quantize(weight), bias)
