"""GPTQ checkpoints (``quant_method: gptq``; AutoGPTQ's and GPTQModel's layout).

Per projection: ``qweight`` int32 [K * bits / 32, N] (the input dimension packed, the lowest
bits first), ``qzeros`` int32 [G, N * bits / 32] (the output dimension packed), ``scales``
[G, N], ``g_idx`` int32 [K] (each input column's group: with ``desc_act`` the groups are spread
over the row, in the order the quantizer visited the columns). ``group_size`` -1: one group.
``weight[n, k] = (q[k, n] - z[g_idx[k], n]) * scales[g_idx[k], n]``.

The zero points: in the original format (``checkpoint_format`` "gptq", the default) each stored
zero is one less than the one the kernels use (AutoGPTQ stores ``z - 1`` and adds 1 after
unpacking: a symmetric 4-bit checkpoint stores 7 for 8); "gptq_v2" stores ``z`` itself.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from llmq.worker.loading.quant_checkpoint.quant_tensor import QuantTensor, unpack_int32

FORMATS = {"gptq": 1, "gptq_v2": 0}  # checkpoint format -> what to add to a stored zero


class GPTQFormat:
    name = "gptq"
    marker = "qweight"
    parts = ("qweight", "qzeros", "scales", "g_idx")

    def __init__(self, config: dict):
        self.bits = int(config.get("bits", 4))
        fmt = str(config.get("checkpoint_format") or config.get("format") or "gptq").lower()
        if self.bits not in (4, 8):
            raise ValueError(f"GPTQ with {self.bits} bits is not implemented (4 and 8 are)")
        if fmt not in FORMATS:
            raise ValueError(f"GPTQ checkpoint_format {fmt!r} is not implemented (gptq, gptq_v2)")
        self.zero_offset = FORMATS[fmt]
        self.description = f"GPTQ {self.bits}-bit ({fmt})"

    def decode(self, get: Callable[[str], torch.Tensor]) -> QuantTensor:
        """One projection from its tensors (``get(part)``)."""
        qweight, scales = get("qweight"), get("scales")
        k, n = qweight.shape[0] * 32 // self.bits, qweight.shape[1]
        q = unpack_int32(qweight.t(), self.bits, k)  # [N, K]
        zero = unpack_int32(get("qzeros"), self.bits, n).t() + self.zero_offset  # [N, G]
        g_idx = get("g_idx")
        return QuantTensor(
            q=q,
            scale=scales.float().t().contiguous(),
            zero=zero.contiguous(),
            bits=self.bits,
            g_idx=None if g_idx is None else g_idx.long(),
        )
