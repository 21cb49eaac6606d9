"""Activations quantized per row in one kernel on CUDA (Triton): the ``dynamic_quantized``
projections' quantization, the same numbers as its torch form (``quantize_rows``: amax, scale,
divide, clamp, round, cast) in one launch instead of seven.

A W8A8 projection quantizes its input on every call, four times a layer: in torch's ops that
was seven launches a call, which left a lone stream's step bound by launches, not by the
weights' bytes, and slower than bfloat16's (docs/performance.md, "Choices: weights").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

_BLOCK = 1024


@triton.jit
def _quantize_rows(
    x_ptr,
    q_ptr,
    scale_ptr,
    cols,
    x_stride,
    q_stride,
    top,
    inv_top,
    tiny,
    BLOCK: tl.constexpr,
    ROUND: tl.constexpr,
):
    row = tl.program_id(0)
    offsets = tl.arange(0, BLOCK)
    x_row = x_ptr + row * x_stride
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, cols, BLOCK):
        mask = start + offsets < cols
        v = tl.load(x_row + start + offsets, mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(v))
    scale = tl.maximum(tl.max(amax, axis=0) * inv_top, tiny)
    tl.store(scale_ptr + row, scale)
    q_row = q_ptr + row * q_stride
    for start in range(0, cols, BLOCK):
        mask = start + offsets < cols
        v = tl.load(x_row + start + offsets, mask=mask, other=0.0).to(tl.float32)
        s = tl.minimum(tl.maximum(tl.math.div_rn(v, scale), -top), top)
        if ROUND:
            s = libdevice.rint(s)  # half to even, as torch.round
        tl.store(q_row + start + offsets, s.to(q_ptr.dtype.element_ty), mask=mask)


def quantize_rows_cuda(
    x: torch.Tensor, dtype: torch.dtype, top: float, tiny: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [M, K] (a CUDA tensor, unit stride along K) as ``dtype`` values and float32 row
    scales [M, 1]."""
    if x.stride(1) != 1:
        x = x.contiguous()
    rows, cols = x.shape
    q = torch.empty((rows, cols), dtype=dtype, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows:
        block = min(_BLOCK, triton.next_power_of_2(cols))
        _quantize_rows[(rows,)](
            x,
            q,
            scale,
            cols,
            x.stride(0),
            q.stride(0),
            top,
            1.0 / top,
            tiny,
            BLOCK=block,
            ROUND=dtype == torch.int8,
        )
    return q, scale
