"""A projection a checkpoint holds in float8 e4m3 (FP8 checkpoints: compressed-tensors'
``float-quantized``, transformers' ``fp8``), in one form for both.

``weight[n, k] = q[n, k] * scale[n // rows, k // cols]`` with ``(rows, cols)`` the scale's block:
``(1, K)`` one scale per output channel, ``(N, K)`` one for the tensor, ``(1, group)`` per group
of a row, ``(128, 128)`` per block (DeepSeek's, Qwen3's FP8: the last blocks of a width that is
not a multiple are partial). The scale is the checkpoint's, held in float32 (fp32, bf16 and
float8 e8m0 scales convert exactly); the product is exact in float32 (a 4-bit significand times
one of 24 bits).

Per channel or per tensor, every row has one scale: ``Fp8Linear``'s row-wise ``torch._scaled_mm``
takes the weight as it is (a GPU of compute capability 8.9 or more). Blocks of 128 x 128 run
as they are on a Hopper GPU (``Fp8BlockLinear``). Other blocks, and any device without these
matmuls, are served as the float model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8 = torch.float8_e4m3fn
FP8_BLOCK = 128  # the block side of block-scaled matmuls
WHOLE = 2**62  # a block side as large as any weight's: one scale for the tensor, or the row


def fp8_matmuls(device: torch.device | str) -> bool:
    """Whether ``device`` runs fp8 matmuls (``torch._scaled_mm``): CUDA, compute capability
    8.9 or more (Ada, Hopper and later)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_block_matmuls(device: torch.device | str) -> bool:
    """Whether ``device`` runs fp8 matmuls with a scale per 128 x 128 block of the weight and
    per 128 columns of the activations: a Hopper GPU (compute capability 9.0) and a torch with
    ``torch.nn.functional.scaled_mm``."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    scaled_mm = hasattr(torch.nn.functional, "scaled_mm")
    return scaled_mm and torch.cuda.get_device_capability(device) == (9, 0)


def serves(kernel: str | None, device: torch.device | str) -> bool:
    """Whether ``device`` runs a ``kernel()`` of an fp8 weight (the integer ones run anywhere)."""
    if kernel == "fp8":
        return fp8_matmuls(device)
    if kernel == "fp8-block":
        return fp8_block_matmuls(device)
    return kernel is not None


@dataclass(slots=True)
class Fp8Tensor:
    q: torch.Tensor  # [N, K] float8 e4m3
    scale: torch.Tensor  # [ceil(N / rows), ceil(K / cols)] float32
    block: tuple[int, int]  # (rows, cols) of the weight each scale covers
    bits = 8

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def _expanded(self) -> torch.Tensor:
        n, k = self.q.shape
        rows, cols = self.block
        return self.scale.repeat_interleave(rows, 0)[:n].repeat_interleave(cols, 1)[:, :k]

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self._expanded()

    def row_scales(self) -> torch.Tensor:
        """One scale per output channel [N] (``kernel() == "fp8"``: one column of scales)."""
        return self.scale[:, 0].repeat_interleave(self.block[0])[: self.q.shape[0]].contiguous()

    def kernel(self) -> str | None:
        """Which matmul takes the weight as it is, on a device that runs it (``serves``):
        "fp8" where every row has one scale (``Fp8Linear``), "fp8-block" in blocks of 128 x 128
        (``Fp8BlockLinear``); None: served as float."""
        if self.block[1] >= self.q.shape[1]:
            return "fp8"
        return "fp8-block" if self.block == (FP8_BLOCK, FP8_BLOCK) else None

    def layout(self) -> str:
        n, k = self.q.shape
        rows, cols = self.block
        if cols >= k:
            return "fp8 e4m3, per tensor" if rows >= n else "fp8 e4m3, per channel"
        return f"fp8 e4m3, blocks of {rows}x{cols}"


def fp8_tensor(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> Fp8Tensor:
    """A checkpoint's fp8 weight and its scales (any shape holding the block grid's count),
    checked."""
    if q.dtype != FP8:
        raise ValueError(f"fp8 weights of {q.dtype} are not implemented (float8 e4m3 is)")
    n, k = q.shape
    rows, cols = min(block[0], n), min(block[1], k)
    grid = (-(-n // rows), -(-k // cols))
    if scale.numel() != grid[0] * grid[1]:
        raise ValueError(f"fp8 scales of shape {tuple(scale.shape)} for a [{n}, {k}] weight")
    return Fp8Tensor(q, scale.float().reshape(grid).contiguous(), (rows, cols))
