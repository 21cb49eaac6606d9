"""transformers' FP8 checkpoints (``quant_method: fp8``: DeepSeek-V3's and Qwen3's FP8 releases,
``FineGrainedFP8Config``).

Per projection: ``weight`` float8 e4m3 [N, K] and ``weight_scale_inv`` [ceil(N / bn),
ceil(K / bk)] with ``weight_block_size: [bn, bk]`` (128 x 128 in the releases; a scalar with no
block size: one scale for the tensor), float32 or, with ``scale_fmt: ue8m0``, float8 e8m0
powers of two. Despite its name the scale multiplies: ``weight = q * weight_scale_inv[n // bn,
k // bk]`` (transformers' ``_dequantize_fp8_weight``, DeepSeek's ``weight_dequant``).

A ``static`` activation scheme's ``activation_scale`` is dropped: activations are quantized per
row as each call runs, where fp8 matmuls serve the weights at all.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from llmq.worker.loading.quant_checkpoint.fp8_tensor import WHOLE, Fp8Tensor, fp8_tensor


class Fp8Format:
    name = "fp8"
    marker = "weight_scale_inv"
    parts = ("weight_scale_inv",)
    dropped = ("activation_scale",)

    def __init__(self, config: dict):
        fmt = str(config.get("fmt") or "e4m3").lower()
        if fmt != "e4m3":
            raise ValueError(f"fp8 {fmt} weights are not implemented (e4m3 is)")
        scheme = str(config.get("activation_scheme") or "dynamic").lower()
        if scheme not in ("dynamic", "static"):
            raise ValueError(f"fp8 activation_scheme {scheme!r} is not implemented")
        if str(config.get("expert_dtype") or "fp8") != "fp8":
            raise ValueError(f"fp8 expert_dtype {config['expert_dtype']!r} is not implemented")
        block = config.get("weight_block_size")
        if block is not None and (len(block) != 2 or min(block) <= 0):
            raise ValueError(f"fp8 weight_block_size {block!r} is not a block")
        self.block = (WHOLE, WHOLE) if block is None else (int(block[0]), int(block[1]))
        grid = "per tensor" if block is None else f"blocks of {block[0]}x{block[1]}"
        self.description = f"fp8 e4m3 ({grid}, {scheme} activations)"

    def decode(self, get: Callable[[str], torch.Tensor]) -> Fp8Tensor:
        return fp8_tensor(get("weight"), get("weight_scale_inv"), self.block)
