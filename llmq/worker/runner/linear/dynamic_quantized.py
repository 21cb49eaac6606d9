"""Projections with 8-bit weights and 8-bit activations quantized per row as each call runs
(W8A8 "dynamic", as vLLM serves fp8 and compressed-tensors' int8 on a GPU), on torch's own
matmuls, no extra package:

- ``Fp8Linear``: float8 e4m3 weights with one scale per output channel, on
  ``torch._scaled_mm`` with row-wise scales (cuBLASLt's fp8 matmul on a GPU of compute
  capability 8.9 or more; torch's reference on a CPU, where it serves tests, not speed).
  ``LLMQ_QUANTIZATION=fp8``.
- ``Int8DynamicLinear``: int8 weights with one symmetric scale per output channel, on
  ``torch._int_mm`` (int8 x int8 -> int32, exact), the int8 form on CUDA (torch's CUDA
  ``_weight_int8pack_mm`` is a plain loop per output, not a tensor-core matmul).

Each row of activations takes its own scale (``amax / 448`` or ``amax / 127``), so a row's
output does not depend on the rows beside it (with ``_int_mm``'s exact integer sums, bit for
bit). Tolerance (tests/worker/runner/test_dynamic_quantized.py): against the float64 product of
the activations as quantized (``quantize_rows``) and the dequantized weights, within ``1e-5`` of
``|x| @ |w|.T`` plus the output's rounding to its dtype.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from llmq.worker.runner.linear.quantized_weights import Int8Weight, round_up

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
_TINY = 1e-12
# torch._scaled_mm: both widths multiples of 16. torch._int_mm on CUDA: more than 16 rows,
# widths multiples of 8.
_FP8_MULTIPLE = 16
_INT8_MULTIPLE = 8
_INT_MM_MIN_ROWS = 17


def quantize_rows(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [M, K] as ``dtype`` (float8 e4m3 or int8) values and one float32 scale per row
    [M, 1]: ``x ~= q * scale``; on CUDA in one kernel (``row_quant_cuda``), the same numbers."""
    kernel = _row_kernel() if x.is_cuda else None
    if kernel is None:
        return quantize_rows_torch(x, dtype)
    return kernel(x, dtype, FP8_MAX if dtype == FP8 else 127.0, _TINY)


def quantize_rows_torch(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rows`` in torch's ops (the reference; seven launches on a GPU)."""
    top = FP8_MAX if dtype == FP8 else 127.0
    a = x.float()
    # amax times 1 / top, not over top: torch's CUDA division by a scalar multiplies by its
    # reciprocal (an ulp from the quotient), and the kernel computes this same product.
    scale = (a.abs().amax(dim=1, keepdim=True) * (1.0 / top)).clamp(min=_TINY)
    scaled = (a / scale).clamp(-top, top)
    return (scaled if dtype == FP8 else scaled.round()).to(dtype), scale


@functools.cache
def _row_kernel():
    """``row_quant_cuda.quantize_rows_cuda``; None where Triton is not installed."""
    try:
        from llmq.worker.runner.linear.row_quant_cuda import quantize_rows_cuda
    except ImportError:
        return None
    return quantize_rows_cuda


class _RowwiseLinear:
    """What the fp8 and int8 forms share: a weight quantized per output channel (padded with
    zero rows and columns to the matmul's multiples), a float32 scale per channel, a bias."""

    bits = 8
    dtype: torch.dtype
    multiple: int

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
        n, k = q.shape
        self.out_features, self.in_features = n, k
        rows, cols = round_up(n, self.multiple), round_up(k, self.multiple)
        self.q = F.pad(q, (0, cols - k, 0, rows - n)).contiguous()  # [N', K'] row-major
        self.scale = F.pad(scale.float().view(1, n), (0, rows - n))  # [1, N']
        self.bias = bias

    @property
    def weight(self) -> torch.Tensor:
        return self.q

    def rows(self, ids: torch.Tensor) -> Int8Weight:
        """The rows ``ids`` of the weight, as an ``Int8Weight`` (a tied embedding reads them)."""
        return Int8Weight(self.q[ids, : self.in_features], self.scale[0, ids])

    def dequantize(self) -> torch.Tensor:
        """The weight the matmul uses, [out_features, in_features] float32."""
        w = self.q[: self.out_features, : self.in_features].float()
        return w * self.scale[0, : self.out_features, None]

    def _activations(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cols = self.q.shape[1]
        a = F.pad(x, (0, cols - x.shape[1])) if cols > x.shape[1] else x
        return quantize_rows(a, self.dtype)

    def _finish(self, y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if y.shape[1] != self.out_features:
            y = y[:, : self.out_features]
        y = y.to(dtype)
        return y + self.bias if self.bias is not None else y

    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes


class Fp8Linear(_RowwiseLinear):
    """``y = x @ w.T + bias`` with w in float8 e4m3 per output channel and x quantized to
    float8 per row (``torch._scaled_mm``, float32 sums, the output in bfloat16)."""

    dtype = FP8
    multiple = _FP8_MULTIPLE

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> Fp8Linear:
        w = weight.detach().float()
        scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=_TINY)
        return cls((w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale, bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        q, scale = self._activations(x)
        y = torch._scaled_mm(
            q, self.q.t(), scale_a=scale, scale_b=self.scale, out_dtype=torch.bfloat16
        )
        return self._finish(y, x.dtype)


class Int8DynamicLinear(_RowwiseLinear):
    """``y = x @ dequantize(weight).T + bias`` with int8 weights per output channel and x
    quantized to int8 per row (``torch._int_mm``: exact int32 sums, then both scales in
    float32)."""

    dtype = torch.int8
    multiple = _INT8_MULTIPLE

    def __init__(self, weight: Int8Weight, bias: torch.Tensor | None):
        """``weight``: an ``Int8Weight`` with a scale per output channel."""
        if weight.grouped:
            raise ValueError("Int8DynamicLinear takes per-channel scales")
        super().__init__(weight.q, weight.scale, bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        q, scale = self._activations(x)
        m = q.shape[0]
        if q.is_cuda and m < _INT_MM_MIN_ROWS:  # cuBLAS's int8 matmul takes more than 16
            q = F.pad(q, (0, 0, 0, _INT_MM_MIN_ROWS - m))
        sums = torch._int_mm(q, self.q.t())[:m]
        return self._finish(sums.float() * scale * self.scale, x.dtype)
