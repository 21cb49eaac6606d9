"""GGUF block readers for llama.cpp's 32-value types (Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL), IQ4_XS
and Q3_K, each into a weight llmq's kernels run (``gguf_weights.py`` reads the other k-quants):

- Q4_0 (``w = d * (q - 8)``), Q5_0 (``d * (q - 16)``) and IQ4_NL (``d * kvalues[q]``, its 16
  levels int8 numbers) are grouped ``Int8Weight`` exactly: int8 values, the block's float16 d
  as the group's scale.
- IQ4_XS (IQ4_NL's levels, a 6-bit scale per 32 values under a float16 d per 256) is grouped
  ``Int8Weight``, the group's scale ``d * (ls - 32)`` rounded to float16 (at most 2**-11 of
  it; llama.cpp multiplies in float32).
- Q3_K (``w = d * (sc - 32) * (q - 4)``, q in 0..7, a 6-bit sc per 16 values) is ``Q6KBlocks``
  exactly: q + 28 is a Q6_K code (``q6 - 32 = q - 4``), ``sc - 32`` its int8 scale.
- Q4_1 and Q5_1 (``w = d * q + m``, a float16 d and m per 32 values) are ``Int4Groups`` and
  ``Int6Groups`` exactly: the same q, d and m, on the int4 and 6-bit kernels with a group's
  float16 scale and base. (Coding d and m in 8 bits against a super-block, as Q4_K codes its
  sub-blocks', saved 0.375 bits a weight and moved the weights by 0.6%: SmolLM2-135M's Q4_1
  file served 1.5 times further from its float model, docs/performance.md.)
"""

from __future__ import annotations

import numpy as np
import torch

from llmq.worker.runner.linear.quantized_weights import (
    Int4Groups,
    Int6Groups,
    Int8Weight,
    Q6KBlocks,
)

# IQ4_NL's and IQ4_XS's 16 levels (ggml's kvalues_iq4nl)
IQ4_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113])
# bytes a block: Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL per 32 values; IQ4_XS, Q3_K per 256
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "IQ4_NL": 18}
IQ4_XS_BLOCK, Q3_K_BLOCK = 136, 110


def _blocks(raw: np.ndarray, size: int) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.uint8).reshape(-1, size)


def _half(blocks: np.ndarray, at: int) -> np.ndarray:
    """The float16 at byte ``at`` of each block, as float32 [B]."""
    return blocks[:, at : at + 2].copy().view(np.float16)[:, 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """A 32-value block's 16 bytes as its values: the low nibbles, then the high. [B, 32]."""
    return np.concatenate([qs & 15, qs >> 4], axis=1)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0's and Q5_1's 4 bytes of fifth bits (a little-endian uint32), [B, 32] of 0 or 16."""
    return np.unpackbits(qh, axis=1, bitorder="little") << 4


def _grouped_int8(q: np.ndarray, scale: np.ndarray, rows: int, cols: int) -> Int8Weight:
    """int8 values [B, 32] and a float16 scale a block as ``Int8Weight`` [rows, cols]."""
    return Int8Weight(
        torch.from_numpy(q.astype(np.int8).reshape(rows, cols)),
        torch.from_numpy(scale.astype(np.float16).reshape(rows, cols // 32)),
    )


def q4_0_weight(raw: np.ndarray, rows: int, cols: int) -> Int8Weight:
    blocks = _blocks(raw, BLOCK_BYTES["Q4_0"])
    q = _nibbles(blocks[:, 2:]).astype(np.int16) - 8
    return _grouped_int8(q, _half(blocks, 0), rows, cols)


def q5_0_weight(raw: np.ndarray, rows: int, cols: int) -> Int8Weight:
    blocks = _blocks(raw, BLOCK_BYTES["Q5_0"])
    q = (_nibbles(blocks[:, 6:]) | _fifth_bits(blocks[:, 2:6])).astype(np.int16) - 16
    return _grouped_int8(q, _half(blocks, 0), rows, cols)


def iq4_nl_weight(raw: np.ndarray, rows: int, cols: int) -> Int8Weight:
    blocks = _blocks(raw, BLOCK_BYTES["IQ4_NL"])
    return _grouped_int8(IQ4_LEVELS[_nibbles(blocks[:, 2:])], _half(blocks, 0), rows, cols)


def iq4_xs_weight(raw: np.ndarray, rows: int, cols: int) -> Int8Weight:
    """IQ4_XS: d (float16), 16 bits of the scales' top two bits, 4 bytes of their low nibbles,
    then each 32-value group's 16 bytes of nibbles (``dequantize_row_iq4_xs``)."""
    blocks = _blocks(raw, IQ4_XS_BLOCK)
    high = blocks[:, 2:4].copy().view(np.uint16)  # [B, 1]
    low = blocks[:, 4:8, None] >> np.array([0, 4], np.uint8)  # [B, 4, 2]: group 2i, 2i + 1
    shifts = np.arange(0, 16, 2, dtype=np.uint16)
    codes = (low.reshape(-1, 8) & 15) | ((high >> shifts) & 3).astype(np.uint8) << 4
    scale = _half(blocks, 0)[:, None] * (codes.astype(np.float32) - 32)  # [B, 8]
    q = IQ4_LEVELS[_nibbles(blocks[:, 8:].reshape(-1, 16))]  # [B * 8, 32]
    return _grouped_int8(q, scale, rows, cols)


def q3_k_weight(raw: np.ndarray, rows: int, cols: int) -> Q6KBlocks:
    """Q3_K: 32 bytes of high bits, 64 of 2-bit lows, 12 of 6-bit scales, d (float16), laid
    out as ``gguf``'s ``dequantize`` reads them; q - 4 = (low | high << 2) - 4 as a Q6_K code."""
    blocks = _blocks(raw, Q3_K_BLOCK)
    packed = blocks[:, 96:108]
    low = (packed[:, None, :8] >> np.array([0, 4], np.uint8)[:, None]).reshape(-1, 16) & 15
    high = (packed[:, None, 8:] >> np.arange(0, 8, 2, dtype=np.uint8)[:, None]).reshape(-1, 16)
    sc = (low | (high & 3) << 4).astype(np.int16) - 32
    ql = blocks[:, None, 32:96].reshape(-1, 2, 1, 32) >> np.arange(0, 8, 2, dtype=np.uint8)[:, None]
    qh = blocks[:, None, None, :32] >> np.arange(8, dtype=np.uint8)[:, None]
    q = (ql.reshape(-1, 256) & 3) + ((qh.reshape(-1, 256) & 1) << 2) + 28  # q - 4 + 32
    return Q6KBlocks(
        torch.from_numpy(q.astype(np.uint8).reshape(rows, cols)),
        torch.from_numpy(blocks[:, 108:110].copy().view(np.float16).reshape(rows, cols // 256)),
        torch.from_numpy(sc.astype(np.int8).reshape(rows, cols // 16)),
    )


def q4_1_weight(raw: np.ndarray, rows: int, cols: int) -> Int4Groups:
    blocks = _blocks(raw, BLOCK_BYTES["Q4_1"])
    return _groups(Int4Groups, _nibbles(blocks[:, 4:]), blocks, rows, cols)


def q5_1_weight(raw: np.ndarray, rows: int, cols: int) -> Int6Groups:
    blocks = _blocks(raw, BLOCK_BYTES["Q5_1"])
    q = _nibbles(blocks[:, 8:]) | _fifth_bits(blocks[:, 4:8])
    return _groups(Int6Groups, q, blocks, rows, cols)


def _groups(kind, q: np.ndarray, blocks: np.ndarray, rows: int, cols: int):
    """Blocks of ``w = d * q + m`` (q [B, 32]; d and m the block's first two float16s) as
    ``kind`` [rows, cols]."""

    def half(at: int) -> torch.Tensor:
        return torch.from_numpy(blocks[:, at : at + 2].copy().view(np.float16).reshape(rows, -1))

    return kind(torch.from_numpy(q.astype(np.uint8).reshape(rows, cols)), half(0), half(2))
