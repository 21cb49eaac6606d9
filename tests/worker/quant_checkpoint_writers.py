"""Projections written in published quantized checkpoints' layouts, from random integers (or
float8 values), each with its reference float32 weight: GPTQ and AWQ packed here as their
formats document (the references their formulas over the integers, before packing),
compressed-tensors by its own compressors (the reference its own decompression), transformers'
fp8 as its ``FP8Linear`` holds it (the reference its own ``_dequantize_fp8_weight``).

A writer: ``(module name, out_features, in_features, generator) -> ({part: tensor}, reference
[N, K])``."""

from __future__ import annotations

import torch
from compressed_tensors.compressors.naive_quantized.base import (
    FloatQuantizationCompressor,
    IntQuantizationCompressor,
)
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's: the column nibble i of a word holds


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """uint32 values held in int64 -> the same bits as int32."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """[R, C] unsigned -> int32 [R * bits / 32, C]: 32 / bits consecutive rows a word, the first
    in the lowest bits (AutoGPTQ's ``pack``)."""
    per = 32 // bits
    v = values.to(torch.int64).view(values.shape[0] // per, per, values.shape[1])
    words = sum(v[:, j] << (bits * j) for j in range(per))
    return _to_int32(words)


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """[R, C] 4-bit -> int32 [R, C / 8] in AutoAWQ's GEMM order."""
    v = values.to(torch.int64)
    words = sum(v[:, col::8] << (4 * i) for i, col in enumerate(AWQ_ORDER))
    return _to_int32(words)


def _scales(shape, generator) -> torch.Tensor:
    return (0.01 + 0.03 * torch.rand(shape, generator=generator)).half()


def _around(zeros: torch.Tensor, top: int, generator) -> torch.Tensor:
    """Random integers in 0..top centred on their zero points: a weight of mean zero (uniform
    integers would give every row the same bias, and a model whose greedy output repeats)."""
    step = torch.randint(-6, 7, zeros.shape, generator=generator)
    return (zeros + step).clamp(0, top)


def act_order_groups(module: str, k: int, group: int) -> torch.Tensor:
    """A g_idx in activation order: GPTQ visits a layer's columns in an order of its inputs'
    statistics, one order per input (q, k and v share theirs), here one per layer and width."""
    layer = int(module.split(".")[2])
    order = torch.randperm(k, generator=torch.Generator().manual_seed(100 * layer + k))
    g_idx = torch.empty(k, dtype=torch.long)
    g_idx[order] = torch.arange(k) // group
    return g_idx


def gptq(bits: int, group: int, act_order: bool, v2: bool, sym: bool):
    def write(module: str, n: int, k: int, generator):
        size = k if group == -1 else group
        groups = k // size
        if sym:
            stored = torch.full((groups, n), 2 ** (bits - 1) - (0 if v2 else 1))
        else:  # near the middle (a model that is not degenerate), and the top of the range
            stored = torch.randint(6, 10, (groups, n), generator=generator)
            stored[0, ::5] = 2**bits - 1  # the old format's zero 16, one past 4 bits
        scales = _scales((groups, n), generator)
        g_idx = act_order_groups(module, k, size) if act_order else torch.arange(k) // size
        # The format's dequantization: the old format's zeros are stored one less.
        zeros = stored + (0 if v2 else 1)
        q = _around(zeros[g_idx], 2**bits - 1, generator)
        reference = (q - zeros[g_idx]).float() * scales[g_idx].float()
        tensors = {
            "qweight": pack_rows(q, bits),
            "qzeros": pack_rows(stored.t() % 2**bits, bits).t().contiguous(),
            "scales": scales,
            "g_idx": g_idx.to(torch.int32),
        }
        return tensors, reference.t().contiguous()

    config = {
        "quant_method": "gptq",
        "bits": bits,
        "group_size": group,
        "desc_act": act_order,
        "sym": sym,
        "checkpoint_format": "gptq_v2" if v2 else "gptq",
    }
    return write, config


def awq(group: int):
    def write(module: str, n: int, k: int, generator):
        zeros = torch.randint(5, 11, (k // group, n), generator=generator)
        zeros[0, ::5] = 15
        scales = _scales((k // group, n), generator)
        rows = torch.arange(k) // group
        q = _around(zeros[rows], 15, generator)
        reference = (q - zeros[rows]).float() * scales[rows].float()
        tensors = {"qweight": pack_awq(q), "qzeros": pack_awq(zeros), "scales": scales}
        return tensors, reference.t().contiguous()

    config = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": group,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": None,
    }
    return write, config


def compressed(fmt: str, weights: QuantizationArgs, activations: QuantizationArgs | None):
    scheme = QuantizationScheme(targets=["Linear"], weights=weights, input_activations=activations)
    compressor = {
        "pack-quantized": PackedQuantizationCompressor,
        "int-quantized": IntQuantizationCompressor,
    }[fmt]

    def write(module: str, n: int, k: int, generator):
        bits = weights.num_bits
        groups = 1 if weights.strategy == "channel" else k // weights.group_size
        low, high = -(2 ** (bits - 1)), 2 ** (bits - 1)
        # bfloat16 scales, as llm-compressor saves a bfloat16 model's (held in float32 here)
        scale = _scales((n, groups), generator).to(torch.bfloat16).float()
        state = {"weight_scale": scale}
        zero = torch.zeros(n, groups, dtype=torch.long)
        if not weights.symmetric:
            zero = torch.randint(-2, 3, (n, groups), generator=generator)
            zero[::5] = low
            state["weight_zero_point"] = zero.to(torch.int8)
        cols = torch.arange(k) // (k // groups)
        q = _around(zero[:, cols] - low, high - low - 1, generator) + low
        # Weights on the grid: the compressor's quantize gives back q exactly.
        state["weight"] = (q - zero[:, cols]).float() * scale[:, cols]
        packed = compressor.compress(state, scheme)
        return packed, compressor.decompress(packed, scheme)["weight"]

    config = {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {"group_0": scheme.model_dump()},
        "ignore": ["lm_head"],
    }
    return write, config


def compressed_act_order(group: int):
    """pack-quantized with ``weight_g_idx`` (older llm-compressor's group activation order,
    which its current compressors no longer write): packed by compressed-tensors' own
    ``pack_to_int32``, the reference the documented ``(q - 0) * scale[n, g_idx[k]]``."""

    def write(module: str, n: int, k: int, generator):
        g_idx = act_order_groups(module, k, group)
        scale = _scales((n, k // group), generator).to(torch.bfloat16).float()
        q = _around(torch.full((n, k), 8), 15, generator) - 8
        reference = q.float() * scale[:, g_idx]
        tensors = {
            "weight_packed": pack_to_int32(q.to(torch.int8), 4),
            "weight_scale": scale,
            "weight_shape": torch.tensor([n, k]),
            "weight_g_idx": g_idx.to(torch.int32),
        }
        return tensors, reference

    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group"}
    config = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {**weights, "group_size": group, "actorder": "group"},
            }
        },
        "ignore": ["lm_head"],
    }
    return write, config


def _fp8_codes(n: int, k: int, generator) -> torch.Tensor:
    """Random float8 e4m3 values of mean zero, spread over the format's range."""
    codes = (100 * torch.randn(n, k, generator=generator)).clamp(-448, 448)
    return codes.to(torch.float8_e4m3fn)  # in range: torch before 2.12 casts past it to NaN


def _fp8_scales(shape, generator) -> torch.Tensor:
    """bfloat16 scales held in float32: with the 4-bit fp8 values, weights of about 0.2."""
    return (0.001 + 0.003 * torch.rand(shape, generator=generator)).to(torch.bfloat16).float()


def compressed_fp8(weights: QuantizationArgs):
    """float-quantized (FP8-dynamic) by compressed-tensors' own compressor."""
    activations = QuantizationArgs(
        num_bits=8, type="float", symmetric=True, strategy="token", dynamic=True
    )
    scheme = QuantizationScheme(targets=["Linear"], weights=weights, input_activations=activations)

    def write(module: str, n: int, k: int, generator):
        if weights.strategy == "block":
            rows, cols = weights.block_structure
            grid = (-(-n // rows), -(-k // cols))
        else:
            rows, cols, grid = (1, k, (n, 1)) if weights.strategy == "channel" else (n, k, (1,))
        scale = _fp8_scales(grid, generator)
        full = scale.reshape(-(-n // rows), -1).repeat_interleave(rows, 0)[:n]
        full = full.repeat_interleave(cols, 1)[:, :k]
        # Weights on the grid: the compressor's quantize gives back the fp8 values exactly.
        state = {"weight": _fp8_codes(n, k, generator).float() * full, "weight_scale": scale}
        packed = FloatQuantizationCompressor.compress(state, scheme)
        assert packed["weight"].dtype == torch.float8_e4m3fn
        return packed, FloatQuantizationCompressor.decompress(packed, scheme)["weight"]

    config = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": scheme.model_dump()},
        "ignore": ["lm_head"],
    }
    return write, config


def transformers_fp8(block: list[int] | None):
    """transformers' fp8 (``quant_method: fp8``): blocks of ``block``, or one scale a tensor."""

    def write(module: str, n: int, k: int, generator):
        codes = _fp8_codes(n, k, generator)
        grid = () if block is None else (-(-n // block[0]), -(-k // block[1]))
        scale = _fp8_scales(grid, generator)
        reference = _dequantize_fp8_weight(codes, scale, block, torch.float32)
        return {"weight": codes, "weight_scale_inv": scale}, reference

    config = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": block,
        "modules_to_not_convert": ["lm_head"],
    }
    return write, config


_W8 = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")
_A8 = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)

WRITERS = {
    "gptq4-actorder": gptq(4, 32, act_order=True, v2=False, sym=False),
    "gptq4-v2-channel": gptq(4, -1, act_order=False, v2=True, sym=True),
    "gptq8-channel": gptq(8, -1, act_order=True, v2=False, sym=True),
    "gptq4-group16": gptq(4, 16, act_order=False, v2=False, sym=False),
    "awq4": awq(64),
    "ct-w4a16": compressed(
        "pack-quantized",
        QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32),
        None,
    ),
    "ct-w4a16-asym": compressed(
        "pack-quantized",
        QuantizationArgs(num_bits=4, type="int", symmetric=False, strategy="channel"),
        None,
    ),
    "ct-w4a16-actorder": compressed_act_order(64),
    "ct-w8a8": compressed("int-quantized", _W8, _A8),
    "ct-fp8-channel": compressed_fp8(
        QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="channel")
    ),
    "ct-fp8-block": compressed_fp8(
        QuantizationArgs(
            num_bits=8, type="float", symmetric=True, strategy="block", block_structure=[128, 128]
        )
    ),
    "fp8-block": transformers_fp8([128, 128]),
    "fp8-tensor": transformers_fp8(None),
}
