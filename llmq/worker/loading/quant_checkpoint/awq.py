"""AWQ checkpoints (``quant_method: awq``, AutoAWQ's GEMM version).

Per projection: ``qweight`` int32 [K, N / 8] and ``qzeros`` int32 [G, N / 8], the output
dimension packed eight 4-bit values a word in AutoAWQ's interleaved order (the word's nibble i,
lowest first, holds column ``[0, 2, 4, 6, 1, 3, 5, 7][i]`` of its eight), ``scales`` [G, N],
contiguous groups of ``group_size`` input columns; ``weight[n, k] = (q[k, n] - z[k // g, n]) *
scales[k // g, n]`` (no offset on the zeros). The GEMV, Marlin, ExLlama and IPEX versions pack
otherwise and are refused, as are checkpoints without zero points.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from llmq.worker.loading.quant_checkpoint.quant_tensor import QuantTensor, unpack_int32

PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the column each nibble holds
UNPACK_ORDER = torch.tensor([PACK_ORDER.index(c) for c in range(8)])  # the nibble of each column


def unpack_awq(packed: torch.Tensor, columns: int) -> torch.Tensor:
    """[R, columns / 8] int32 in AWQ's order -> [R, columns] int32 in column order."""
    nibbles = unpack_int32(packed, 4, columns)
    rows = nibbles.shape[0]
    return nibbles.view(rows, columns // 8, 8)[:, :, UNPACK_ORDER].reshape(rows, columns)


class AWQFormat:
    name = "awq"
    marker = "qweight"
    parts = ("qweight", "qzeros", "scales")

    def __init__(self, config: dict):
        version = str(config.get("version") or config.get("backend") or "gemm").lower()
        bits = int(config.get("bits", config.get("w_bit", 4)))
        if version != "gemm":
            raise ValueError(f"AWQ version {version!r} is not implemented (gemm is)")
        if bits != 4:
            raise ValueError(f"AWQ with {bits} bits is not implemented (4 is)")
        if not config.get("zero_point", True):
            raise ValueError("AWQ without zero points (zero_point: false) is not implemented")
        self.description = "AWQ 4-bit (GEMM)"

    def decode(self, get: Callable[[str], torch.Tensor]) -> QuantTensor:
        qweight, scales = get("qweight"), get("scales")
        n = qweight.shape[1] * 8
        return QuantTensor(
            q=unpack_awq(qweight, n).t().contiguous(),
            scale=scales.float().t().contiguous(),
            zero=unpack_awq(get("qzeros"), n).t().contiguous(),
            bits=4,
        )
