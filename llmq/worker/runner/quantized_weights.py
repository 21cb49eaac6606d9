"""Quantized weights as data: int8 and int4 values with their scales (and zeros), quantized
from float weights a chunk of rows at a time and dequantized for references; the projections
that run them are ``quantized_linear``'s."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llmq.worker.runner import mapped_pages

GROUP = 32  # int4 group size: llama.cpp's Q4_K sub-block, and exact for GGUF Q4_K
ACTIVATIONS = torch.bfloat16  # the kernels' fast path

# Rows quantized at a time: their float32 copy and its temporaries stay tens of MiB (the whole
# 49,152 x 2,048 table of the 1B shape at once took 1.1 GiB more peak RSS at start).
_CHUNK_BYTES = 32 << 20


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _row_chunks(weight: torch.Tensor) -> Iterator[torch.Tensor]:
    """``weight``'s rows a chunk at a time; a weight read from its file hands the file's pages
    of each chunk back once it was read (a later read faults them in again): quantizing the 1B
    shape's tied table from its file held its 0.2 GB of pages besides the quantized copy."""
    for rows in weight.detach().split(max(1, _CHUNK_BYTES // (4 * weight.shape[1]))):
        yield rows
        mapped_pages.release(rows)


@dataclass(slots=True)
class Int8Weight:
    """``weight ~= q * scale``: q int8 [N, K] in -127..127; scale per output channel [N]
    (bfloat16: torch's kernel) or per group of 32 input columns [N, ceil(K / 32)] (float16, as
    llama.cpp's Q8_0 holds it: llmq's kernel; 6% more bytes than q, half the KL to bfloat16
    of the per-channel form on the 1B shape, bench/quant_quality.py)."""

    q: torch.Tensor
    scale: torch.Tensor

    @property
    def grouped(self) -> bool:
        return self.scale.dim() == self.q.dim()

    @classmethod
    def quantize(cls, weight: torch.Tensor, grouped: bool = True) -> Int8Weight:
        """Symmetric absmax scales, q computed against the stored (rounded) ones: the
        dequantized weight is the nearest the stored numbers allow."""
        # q filled a chunk at a time: a list and its torch.cat held it twice at start
        q, scales, start = torch.empty(weight.shape, dtype=torch.int8, device=weight.device), [], 0
        k = weight.shape[1]
        for rows in _row_chunks(weight):
            # in place on one float32 copy of the chunk: its temporaries were 5 more at start
            w = rows.to(torch.float32, copy=True)
            if grouped:
                w = F.pad(w, (0, -k % GROUP)) if k % GROUP else w
                w = w.view(w.shape[0], -1, GROUP)
                scale = (_amax(w, 2) / 127).clamp(min=2**-24).to(torch.float16)
            else:
                w = w.view(w.shape[0], 1, k)
                scale = (_amax(w, 2)[:, 0] / 127).clamp(min=1e-12).to(ACTIVATIONS)
            w.div_(scale.float().view(w.shape[0], -1, 1)).round_().clamp_(-127, 127)
            q[start : start + len(w)] = w.view(len(w), -1)[:, :k]
            scales.append(scale)
            start += len(w)
        return cls(q, torch.cat(scales))

    def dequantize(self) -> torch.Tensor:
        q = self.q.float()
        if not self.grouped:
            return q * self.scale.float()[..., None]
        return q * _group_steps(self.scale, q.shape[-1])

    def rows(self, ids: torch.Tensor) -> Int8Weight:
        return Int8Weight(self.q[ids], self.scale[ids])

    def per_channel(self) -> Int8Weight:
        """This weight with one scale per output channel (a grouped one quantized again)."""
        return Int8Weight.quantize(self.dequantize(), grouped=False) if self.grouped else self

    def to(self, device: torch.device) -> Int8Weight:
        return Int8Weight(self.q.to(device), self.scale.to(device))


def _amax(w: torch.Tensor, dim: int) -> torch.Tensor:
    """max |w| along ``dim`` without an ``abs()`` copy of ``w``."""
    return torch.linalg.vector_norm(w, float("inf"), dim=dim)


def _group_steps(scale: torch.Tensor, k: int) -> torch.Tensor:
    """Group scales [..., ceil(k / 32)] as one float32 step per input column [..., k]."""
    return scale.float().repeat_interleave(GROUP, dim=-1)[..., :k]


@dataclass(slots=True)
class Int4Weight:
    """``weight ~= (q - 8) * scale + zero`` per group of ``group`` input columns (32, 64, 128 or
    256: the kernel's): q [N, K] in 0..15 (a byte each here, packed by ``Int4Linear``; a
    checkpoint's may be int32), scale and zero
    [N, K / group] (bfloat16 for the kernel; a checkpoint's float32 ones are rounded to it by
    ``Int4Linear``)."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    group: int = GROUP

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int4Weight:
        """Asymmetric min/max per group; q computed against the stored (rounded) scale and
        zero, so that the dequantized weight is the nearest the stored numbers allow."""
        k = weight.shape[1]
        if k % GROUP:
            raise ValueError(f"int4 needs input widths in multiples of {GROUP}, not {k}")
        qs = torch.empty(weight.shape, dtype=torch.uint8, device=weight.device)
        scales, zeros, start = [], [], 0
        for rows in _row_chunks(weight):
            w = rows.to(torch.float32, copy=True).view(rows.shape[0], k // GROUP, GROUP)
            low, high = w.amin(dim=2), w.amax(dim=2)
            scale = ((high - low) / 15).clamp(min=1e-12).to(ACTIVATIONS)
            zero = (low + 8 * scale.float()).to(ACTIVATIONS)
            base = zero.float() - 8 * scale.float()  # the value of q = 0
            w.sub_(base[..., None]).div_(scale.float()[..., None]).round_().clamp_(0, 15)
            qs[start : start + len(rows)] = w.view(rows.shape[0], k)
            scales.append(scale)
            zeros.append(zero)
            start += len(rows)
        return cls(qs, torch.cat(scales), torch.cat(zeros))

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        q = self.q.float().view(n, k // self.group, self.group)
        w = (q - 8) * self.scale.float()[..., None] + self.zero.float()[..., None]
        return w.view(n, k)

    def to(self, device: torch.device) -> Int4Weight:
        move = (t.to(device) for t in (self.q, self.scale, self.zero))
        return Int4Weight(*move, group=self.group)
