"""6-bit projections (``Int6Blocks``) on llmq's integer kernel (``kernels/int6_matmul.cpp``): the
tensors a 4-bit model keeps at more bits, as llama.cpp's Q4_K_M keeps them in Q6_K.

The panels ``q6_matmul`` takes, [P, K / 32, 6, 16, 4] bytes: a group's values' low nibbles as
``q4_panels`` lays them out (parts 0-3), then their top two bits (parts 4-5: byte i of a column
in part j holds, from its low bits up, those of step 2j's low and high nibble, then step
2j + 1's); the scales are ``Int4Blocks``' super-blocks (``k_blocks``), or a GGUF's Q6_K ones
(``Q6KLinear``: ``q6k_blocks``). Where the kernel is not
loaded (no AVX2), or on CUDA, the tensors take int8 instead (``quantized_linear``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmq.worker.runner.quantized_linear import (
    PANEL_COLS,
    k_blocks,
    kernel_bias,
    on_kernel,
    panel_rows,
    q4_nibbles,
)
from llmq.worker.runner.quantized_weights import GROUP, Int6Blocks, Q6KBlocks, round_up

_NIBBLE_PARTS = 4  # a group's 64-byte parts of low nibbles; two more hold the top bits


def q6_panels(q: torch.Tensor, rows: int) -> torch.Tensor:
    """q [N, K] in 0..63 (output channels padded to ``rows``) as q6_matmul's panels."""
    n, k = q.shape
    groups = k // GROUP
    packed = torch.empty(rows // PANEL_COLS, groups, 6, PANEL_COLS, 4, dtype=torch.uint8)
    packed[:, :, :_NIBBLE_PARTS] = q4_nibbles(q.to(torch.uint8) & 15, rows)
    for start, part in panel_rows(q, rows):
        # [panel, column, group, part j, step in part, nibble half, i]
        top = (part.to(torch.uint8) >> 4).view(-1, PANEL_COLS, groups, 2, 2, 2, 4)
        fields = top[..., 0, 0, :] | top[..., 0, 1, :] << 2
        fields |= top[..., 1, 0, :] << 4 | top[..., 1, 1, :] << 6
        first = start // PANEL_COLS
        packed[first : first + len(fields), :, _NIBBLE_PARTS:] = fields.permute(0, 2, 3, 1, 4)
    return packed


def _panel_values(lanes: torch.Tensor) -> torch.Tensor:
    """Columns' bytes out of the panels, [n, K / 32, 6, 4], as their q [n, K]."""
    n, groups = lanes.shape[:2]
    nibbles = lanes[:, :, :_NIBBLE_PARTS]
    low = torch.stack([nibbles & 15, nibbles >> 4], dim=3)  # [n, G, step, half, i]
    top = lanes[:, :, _NIBBLE_PARTS:]  # [n, G, j, i]
    fields = torch.stack([top >> shift & 3 for shift in (0, 2, 4, 6)], dim=3)
    high = fields.view(n, groups, 2, 2, 2, 4).reshape(n, groups, 4, 2, 4)
    return (low | high << 4).reshape(n, groups * GROUP)


class Int6Linear:
    """``y = x @ dequantize(weight).T + bias`` for 2-D ``x`` through ``q6_matmul``: activations
    quantized to int8 per block of 32, as ``Int4Linear``'s on llmq's kernel; output channels
    padded to a multiple of 16 with zero rows."""

    bits = 6

    def __init__(self, weight: Int6Blocks | Q6KBlocks, bias: torch.Tensor | None):
        n, k = weight.q.shape
        self.out_features, self.in_features = n, k
        rows = round_up(n, PANEL_COLS)
        self.kernel = True
        self.packed = q6_panels(weight.q, rows)
        self.scales_and_zeros = self._scales(weight, rows)
        self.bias = kernel_bias(bias)

    @staticmethod
    def _scales(weight: Int6Blocks, rows: int) -> torch.Tensor:
        return k_blocks(weight, rows)

    @property
    def weight(self) -> torch.Tensor:
        return self.packed

    def _panel_rows(self, ids: torch.Tensor) -> tuple:
        """The rows ``ids``' values (q [n, K]), their panels' scales [n, S, bytes], and each
        row's index into those and lane in its panel."""
        panel, lane = ids // PANEL_COLS, ids % PANEL_COLS
        q = _panel_values(self.packed[panel, :, :, lane])
        return q, self.scales_and_zeros[panel], torch.arange(len(ids)), lane

    def rows(self, ids: torch.Tensor) -> Int6Blocks:
        """The rows ``ids`` (1-D) of the weight (a tied embedding reads them)."""
        q, blocks, picked, lane = self._panel_rows(ids)  # d, m step [16]; sc, m [8][16]
        n, supers = blocks.shape[:2]

        def steps(offset: int) -> torch.Tensor:
            halves = blocks[:, :, offset : offset + 32].contiguous().view(torch.float16)
            return halves.view(n, supers, PANEL_COLS)[picked, :, lane]

        def codes(offset: int, dtype: torch.dtype) -> torch.Tensor:
            part = blocks[:, :, offset : offset + 128].contiguous().view(dtype)
            lanes = part.view(n, supers, 8, PANEL_COLS)[picked, :, :, lane]
            return lanes.reshape(n, -1)[:, : self.in_features // GROUP]

        return Int6Blocks(q, steps(0), steps(32), codes(64, torch.uint8), codes(192, torch.int8))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return on_kernel(torch.ops.llmq.q6_matmul, x, self.packed, self.scales_and_zeros, self)

    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales_and_zeros.nbytes


def q6k_blocks(weight: Q6KBlocks, rows: int) -> torch.Tensor:
    """A ``Q6KBlocks``' scales as q6_matmul's [P, K / 256, 288] bytes: float16 d [16], then the
    sub-blocks' sc int8 [16][16] (padding rows: d 0)."""
    n, supers = weight.d.shape
    panels, pad_rows = rows // PANEL_COLS, rows - n
    d = F.pad(weight.d, (0, 0, 0, pad_rows)).view(panels, PANEL_COLS, supers).permute(0, 2, 1)
    sc = F.pad(weight.sc, (0, 0, 0, pad_rows)).view(panels, PANEL_COLS, supers, -1)
    sc = sc.permute(0, 2, 3, 1).reshape(panels, supers, -1).view(torch.uint8)
    return torch.cat([d.contiguous().view(torch.uint8), sc], dim=2)


class Q6KLinear(Int6Linear):
    """A GGUF's Q6_K tensor as it is held (``Q6KBlocks``) on ``q6_matmul``: the panels of
    ``Int6Linear``, its 16-value sub-blocks' scales beside them (6.5625 bits a weight, where
    the int8 it took before holds 8.5)."""

    def __init__(self, weight: Q6KBlocks, bias: torch.Tensor | None):
        if weight.q.shape[1] % 256:
            raise ValueError(f"Q6_K blocks are 256 inputs wide, not a part of {weight.q.shape[1]}")
        super().__init__(weight, bias)

    @staticmethod
    def _scales(weight: Q6KBlocks, rows: int) -> torch.Tensor:
        return q6k_blocks(weight, rows)

    def rows(self, ids: torch.Tensor) -> Q6KBlocks:
        """The rows ``ids`` (1-D) of the weight (a tied embedding reads them)."""
        q, blocks, picked, lane = self._panel_rows(ids)  # d [16]; sc [16][16]
        n, supers = blocks.shape[:2]
        d = blocks[:, :, :32].contiguous().view(torch.float16)[picked, :, lane]
        sc = blocks[:, :, 32:].contiguous().view(torch.int8).view(n, supers, -1, PANEL_COLS)
        return Q6KBlocks(q, d, sc[picked, :, :, lane].reshape(n, -1))
