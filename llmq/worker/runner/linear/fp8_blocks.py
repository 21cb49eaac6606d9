"""fp8 weights in blocks of 128 x 128, each block with its own scale (DeepSeek-V3's and Qwen3's
FP8 checkpoints), served as the checkpoint holds them: ``Fp8BlockLinear``.

Each call quantizes its activations to float8 e4m3 in groups of 128 columns of a row, one scale
a group (``quantize_rows`` on the rows cut in 128s), and multiplies on cuBLASLt's block-scaled
fp8 matmul (``torch.nn.functional.scaled_mm``, 1 x 128 scales on the activations, 128 x 128 on
the weights: vLLM's and DeepGEMM's scheme), on a Hopper GPU. The weight is padded with zero
rows to a multiple of 128 and zero columns to a multiple of 512 (the matmul takes the scales'
K blocks in fours), the activations with zero rows to a multiple of 4.

On a CPU it computes the same quantities in float32 (the reference the tests compare the GPU's
products to), slowly: a CPU serves such a checkpoint as its float model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmq.worker.loading.quant_checkpoint.fp8_tensor import FP8_BLOCK
from llmq.worker.runner.linear.dynamic_quantized import FP8, quantize_rows
from llmq.worker.runner.linear.quantized_weights import round_up

BLOCK = FP8_BLOCK
_ROWS_MULTIPLE = 4  # activation rows: cuBLASLt takes the token-major scales in fours
_COLS_MULTIPLE = 4 * BLOCK  # input columns: the weight's K blocks in fours


class Fp8BlockLinear:
    """``y = x @ w.T + bias`` with w in float8 e4m3 and a float32 scale per 128 x 128 block."""

    bits = 8

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
        """``q`` [N, K] float8 e4m3; ``scale`` [ceil(N / 128), ceil(K / 128)]."""
        n, k = q.shape
        if scale.shape != (-(-n // BLOCK), -(-k // BLOCK)):
            raise ValueError(f"scales of shape {tuple(scale.shape)} for [{n}, {k}] in 128s")
        self.out_features, self.in_features = n, k
        rows, cols = round_up(n, BLOCK), round_up(k, _COLS_MULTIPLE)
        self.q = F.pad(q, (0, cols - k, 0, rows - n)).contiguous()
        grid = (rows // BLOCK, cols // BLOCK)
        self.scale = F.pad(
            scale.float(), (0, grid[1] - scale.shape[1], 0, grid[0] - scale.shape[0]), value=1.0
        ).contiguous()
        self.bias = bias

    @property
    def weight(self) -> torch.Tensor:
        return self.q

    def dequantize(self) -> torch.Tensor:
        """The weight the matmul uses, [out_features, in_features] float32."""
        return self._padded_weight()[: self.out_features, : self.in_features]

    def _padded_weight(self) -> torch.Tensor:
        full = self.scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
        return self.q.float() * full

    def quantize_activations(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` [M, K] padded to the weight's columns and to a multiple of 4 rows, as float8
        and a float32 scale per 128 columns of a row: [M', K'], [M', K' / 128]."""
        m, k = x.shape
        a = F.pad(x, (0, self.q.shape[1] - k, 0, round_up(m, _ROWS_MULTIPLE) - m))
        q, scale = quantize_rows(a.reshape(-1, BLOCK), FP8)
        return q.view(a.shape), scale.view(a.shape[0], -1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        q, scale = self.quantize_activations(x)
        if q.is_cuda:
            y = F.scaled_mm(
                q,
                self.q.t(),
                scale.t().contiguous().t(),  # token-major ("outer-dim-major")
                F.ScalingType.BlockWise1x128,
                self.scale.t(),
                F.ScalingType.BlockWise128x128,
                output_dtype=torch.bfloat16,
            )
        else:
            groups = q.float().view(q.shape[0], -1, BLOCK) * scale[:, :, None]
            y = groups.view(q.shape) @ self._padded_weight().T
        y = y[: x.shape[0], : self.out_features].to(x.dtype)
        return y + self.bias if self.bias is not None else y

    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes
