"""The 8-bit KV cache's codes: keys and values stored as int8 or float8 (e4m3) with one float32
scale per token per KV head, quantized as they are written and dequantized as they are read.

Symmetric, scale = max |x| of the head's row / the code's largest value (127; 448 for e4m3), as
llama.cpp's q8_0 (a scale per 32 values) and vLLM's fp8 cache. The scale is per token and head,
not per block: a block is written a token at a time (decodes), so a block scale would either
be fixed by the block's first tokens (later outliers clip) or requantize the tokens already
stored. Per token, no stored code ever changes, and the int8 round trip errs by half a step at
most: 1/254 of the row's largest value, closer to the float cache than a scale per block
(docs/performance.md, "Choices: weights"). The scales cost 4 bytes a row of 64 codes.

fp8 codes are kept in uint8 storage: torch's CPU index_copy_ has no float8 kernel.
"""

from __future__ import annotations

import torch

# LLMQ_KV_CACHE_DTYPE -> the codes' dtype ("auto": the model's dtype, no codes).
CODE_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
SCALE_DTYPE = torch.float32
_CODE_MAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def code_dtype(setting: str | torch.dtype | None) -> torch.dtype | None:
    """The codes' dtype of a LLMQ_KV_CACHE_DTYPE value; None: the model's dtype (no codes)."""
    if setting is None or setting == "auto":
        return None
    if isinstance(setting, torch.dtype):
        if setting not in _CODE_MAX:
            raise ValueError(f"no 8-bit KV cache of {setting}")
        return setting
    if setting not in CODE_DTYPES:
        raise ValueError(f"kv_cache_dtype {setting!r}: auto, int8 or fp8")
    return CODE_DTYPES[setting]


def storage_dtype(codes: torch.dtype) -> torch.dtype:
    """How the pool stores ``codes``: int8 as is, float8 as its bytes."""
    return torch.uint8 if codes.is_floating_point else codes


def quantize(x: torch.Tensor, codes: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> codes [..., D] (in ``storage_dtype``) and float32 scales [...]."""
    top = _CODE_MAX[codes]
    xf = x.float()
    # A row of zeros: scale tiny, codes zero, dequantized zero (no 0 / 0).
    scale = (xf.abs().amax(-1) / top).clamp_min_(torch.finfo(torch.float32).tiny)
    scaled = xf / scale.unsqueeze(-1)
    if codes == torch.int8:
        q = scaled.round_().clamp_(-top, top).to(torch.int8)
    else:
        q = scaled.clamp_(-top, top).to(codes).view(torch.uint8)
    return q, scale


def dequantize(
    q: torch.Tensor,  # [..., D] in storage_dtype(codes)
    scale: torch.Tensor,  # [...] float32
    codes: torch.dtype,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """codes * scale in ``dtype`` (the product in float32): [..., D]."""
    if out is None:
        out = torch.empty(q.shape, dtype=dtype, device=q.device)
    out.copy_(q.view(codes))  # exact: every int8 and e4m3 value is a bfloat16/float16 value
    return out.mul_(scale.unsqueeze(-1))
