"""Quantized weights as data: int8 and int4 values with their scales (and zeros), quantized
from float weights a chunk of rows at a time and dequantized for references; the projections
that run them are ``quantized_linear``'s."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from llmq.worker.runner.loaders import mapped_pages

GROUP = 32  # int4 group size: llama.cpp's Q4_K sub-block, and exact for GGUF Q4_K
ACTIVATIONS = torch.bfloat16  # the kernels' fast path

# Rows quantized at a time: their float32 copy and its temporaries stay tens of MiB, so a large
# table does not raise the start's peak RSS (docs/performance.md, "Choices: memory").
_CHUNK_BYTES = 32 << 20


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _row_chunks(weight: torch.Tensor) -> Iterator[torch.Tensor]:
    """``weight``'s rows a chunk at a time; a weight read from its file hands the file's pages
    of each chunk back once it was read (a later read faults them in again), so the file's pages
    are not held besides the quantized copy (docs/performance.md, "Choices: memory")."""
    for rows in weight.detach().split(max(1, _CHUNK_BYTES // (4 * weight.shape[1]))):
        yield rows
        mapped_pages.release(rows)


@dataclass(slots=True)
class Int8Weight:
    """``weight ~= q * scale``: q int8 [N, K] in -127..127; scale per output channel [N]
    (bfloat16: torch's kernel) or per group of 32 input columns [N, ceil(K / 32)] (float16, as
    llama.cpp's Q8_0 holds it: llmq's kernel; a few more bytes than q for a lower KL to
    bfloat16 than the per-channel form, docs/performance.md)."""

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
    """A checkpoint's int4 weights (GPTQ, AWQ, compressed-tensors; quantization at load makes
    ``Int4Blocks``): ``weight ~= (q - 8) * scale + zero`` per group of ``group`` input columns
    (32, 64, 128 or 256: the kernel's), q [N, K] in 0..15 (int32 or a byte each), scale and zero
    [N, K / group] (the checkpoint's floats, rounded to bfloat16 by ``Int4Linear``)."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    group: int = GROUP

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        q = self.q.float().view(n, k // self.group, self.group)
        w = (q - 8) * self.scale.float()[..., None] + self.zero.float()[..., None]
        return w.view(n, k)

    def to(self, device: torch.device) -> Int4Weight:
        move = (t.to(device) for t in (self.q, self.scale, self.zero))
        return Int4Weight(*move, group=self.group)


BLOCK_GROUPS = 8  # groups of 32 in a k-quant super-block (256 inputs, as Q4_K's)


@dataclass(slots=True)
class Int4Blocks:
    """``weight ~= d * sc * q + m_step * m`` per group of 32 input columns: q [N, K] in 0..15 (a
    byte each here), d and m_step float16 per super-block of 8 groups [N, ceil(K / 256)], a
    group's codes sc uint8 and m int8 [N, K / 32]. llama.cpp's Q4_K with 8-bit codes where it
    has 6 (its ``-dmin`` and codes are held exactly): 4.625 bits a weight against the 5 of a
    bfloat16 scale and zero per group, with the same error (docs/performance.md, "Choices:
    weights")."""

    q: torch.Tensor
    d: torch.Tensor
    m_step: torch.Tensor
    sc: torch.Tensor
    m: torch.Tensor
    LEVELS: ClassVar[int] = 15  # the largest q

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int4Blocks:
        """Min/max per group, its scale and minimum coded against their super-block's largest;
        q computed against the stored (coded) ones."""
        n, k = weight.shape
        if k % GROUP:
            raise ValueError(f"k-quant blocks need input widths in multiples of {GROUP}, not {k}")
        groups = k // GROUP
        supers = -(-groups // BLOCK_GROUPS)
        dev = weight.device
        out = cls(
            torch.empty(n, k, dtype=torch.uint8, device=dev),
            torch.empty(n, supers, dtype=torch.float16, device=dev),
            torch.empty(n, supers, dtype=torch.float16, device=dev),
            torch.empty(n, groups, dtype=torch.uint8, device=dev),
            torch.empty(n, groups, dtype=torch.int8, device=dev),
        )
        start = 0
        for rows in _row_chunks(weight):
            w = rows.to(torch.float32, copy=True).view(len(rows), groups, GROUP)
            step, low = _fitted_steps(w, cls.LEVELS)
            d, sc = _codes(step, 255)
            m_step, m = _codes(low, 127)
            scale = _per_group(d, groups) * sc.float()
            base = _per_group(m_step, groups) * m.float()
            w.sub_(base[..., None]).div_(scale.clamp(min=1e-30)[..., None]).round_().clamp_(
                0, cls.LEVELS
            )
            end = start + len(rows)
            out.q[start:end] = w.view(len(rows), k)
            out.d[start:end], out.m_step[start:end] = d, m_step
            out.sc[start:end], out.m[start:end] = sc, m
            start = end
        return out

    def group_scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each group's scale and base (the value of q = 0), float32 [N, K / 32]."""
        groups = self.sc.shape[1]
        scale = _per_group(self.d, groups) * self.sc.float()
        return scale, _per_group(self.m_step, groups) * self.m.float()

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        scale, base = self.group_scales()
        q = self.q.float().view(n, k // GROUP, GROUP)
        return (q * scale[..., None] + base[..., None]).view(n, k)

    def rows(self, ids: torch.Tensor) -> Int4Blocks:
        return type(self)(*(t[ids] for t in (self.q, self.d, self.m_step, self.sc, self.m)))

    def as_int4_weight(self) -> Int4Weight:
        """The same weights as ``Int4Weight`` (torch's kernels): scale and zero rounded to
        bfloat16."""
        scale, base = self.group_scales()
        zero = base + 8 * scale
        return Int4Weight(self.q, scale.to(ACTIVATIONS), zero.to(ACTIVATIONS))


@dataclass(slots=True)
class Int6Blocks(Int4Blocks):
    """``Int4Blocks`` with q in 0..63: the tensors a 4-bit model keeps at more bits (as Q4_K_M
    keeps them in Q6_K), 6.625 bits a weight against the 8.5 of ``Int8Weight`` in groups of 32
    (``quantized_linear.Int6Linear``)."""

    LEVELS: ClassVar[int] = 63

    def as_int4_weight(self) -> Int4Weight:
        raise TypeError("6-bit blocks have no int4 form")


@dataclass(slots=True)
class Int4Groups:
    """``weight ~= d * q + m`` per group of 32 input columns: q [N, K] in 0..15 (a byte each),
    d and m float16 [N, K / 32]. GGUF's Q4_1 as its files hold it (5 bits a weight), on the
    int4 kernel with a group's float16 scale and base (``quantized_linear.f16_groups``)."""

    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor
    LEVELS: ClassVar[int] = 15  # the largest q

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int4Groups:
        """Each group's step and base fitted as ``Int4Blocks``' (a 4- or 5-bit grid found again)
        and held in float16, not coded against a super-block: a GGUF's grid, dequantized into a
        float checkpoint, comes back exactly. q against the stored numbers."""
        n, k = weight.shape
        groups = k // GROUP
        dev = weight.device
        out = cls(
            torch.empty(n, k, dtype=torch.uint8, device=dev),
            torch.empty(n, groups, dtype=torch.float16, device=dev),
            torch.empty(n, groups, dtype=torch.float16, device=dev),
        )
        start = 0
        for rows in _row_chunks(weight):
            w = rows.to(torch.float32, copy=True).view(len(rows), groups, GROUP)
            step, low = _fitted_steps(w, cls.LEVELS)
            d, m = step.clamp(min=2**-24).to(torch.float16), low.to(torch.float16)
            w.sub_(m.float()[..., None]).div_(d.float()[..., None]).round_()
            end = start + len(rows)
            out.q[start:end] = w.clamp_(0, cls.LEVELS).view(len(rows), k)
            out.d[start:end], out.m[start:end] = d, m
            start = end
        return out

    def group_scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each group's scale and base (the value of q = 0), float32 [N, K / 32]."""
        return self.d.float(), self.m.float()

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape  # k: a multiple of 32 but for Int8Groups' last group
        q = F.pad(self.q.float(), (0, -k % GROUP)).view(n, -1, GROUP)
        w = q * self.d.float()[..., None] + self.m.float()[..., None]
        return w.view(n, -1)[:, :k]

    def rows(self, ids: torch.Tensor):
        return type(self)(self.q[ids], self.d[ids], self.m[ids])

    def as_int4_weight(self) -> Int4Weight:
        """The same weights as ``Int4Weight`` (torch's kernels): scale and zero rounded to
        bfloat16."""
        scale, base = self.group_scales()
        return Int4Weight(self.q, scale.to(ACTIVATIONS), (base + 8 * scale).to(ACTIVATIONS))


@dataclass(slots=True)
class Int6Groups(Int4Groups):
    """``Int4Groups`` with q in 0..63: GGUF's Q5_1 as its files hold it, on the 6-bit kernel."""

    LEVELS: ClassVar[int] = 63

    def as_int4_weight(self) -> Int4Weight:
        raise TypeError("6-bit groups have no int4 form")


@dataclass(slots=True)
class Int8Groups(Int4Groups):
    """``Int4Groups`` with q in 0..255 (uint8): int8 with a minimum per group of 32, ``w = d *
    q + m`` (9 bits a weight). Where ``Int8Weight``'s symmetric scale holds a grid of 255
    levels around zero, this holds any grid of evenly spaced levels within the group's span:
    a float checkpoint made from a Q4_1 or Q4_K file holds a 4-bit grid with a minimum, which
    the symmetric scale rounds off (docs/performance.md, "Quantized weights")."""

    LEVELS: ClassVar[int] = 255

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int8Groups:
        """Each group's scale and base, the best (least squared error) of: the symmetric scale
        (``Int8Weight``'s, base -128 scale, exact in float16), and min/max over ``STEPS`` steps
        of the span (a 4- or 5-bit grid of a GGUF's weights, its span a whole number of its
        steps, is held exactly; 255: min/max). q against the stored (float16) numbers."""
        n, k = weight.shape
        groups = round_up(k, GROUP) // GROUP
        out = cls(
            torch.empty(n, groups * GROUP, dtype=torch.uint8, device=weight.device),
            torch.empty(n, groups, dtype=torch.float16, device=weight.device),
            torch.empty(n, groups, dtype=torch.float16, device=weight.device),
        )
        start = 0
        for rows in _row_chunks(weight):
            w = rows.to(torch.float32, copy=True)
            w = F.pad(w, (0, -k % GROUP)) if k % GROUP else w
            w = w.view(len(rows), groups, GROUP)
            d, m = _best_grid(w)
            end = start + len(rows)
            w.sub_(m.float()[..., None]).div_(d.float().clamp(min=2**-24)[..., None])
            out.q[start:end] = w.round_().clamp_(0, 255).view(len(rows), -1)
            out.d[start:end], out.m[start:end] = d, m
            start = end
        if k % GROUP:
            out.q = out.q[:, :k].contiguous()
        return out

    def as_int4_weight(self) -> Int4Weight:
        raise TypeError("int8 groups have no int4 form")


# The steps of a group's span Int8Groups tries besides the symmetric scale: 4- and 5-bit grids
# (Q4_1, Q4_K, Q5_0, Q5_1, Q5_K files' weights), and min/max.
STEPS = (*range(8, 16), 31, 255)


def _best_grid(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For w [N, G, 32], each group's float16 step and base (``Int8Groups.quantize``)."""
    low, high = w.amin(dim=2), w.amax(dim=2)
    step = (torch.maximum(high, -low) / 127).clamp(min=2**-24).to(torch.float16)
    base = step * -128  # float16: exact (a power of two times the step)
    best_err = _grid_error(w, step, base)
    base_low = low.to(torch.float16)
    for j in STEPS:
        cand = ((high - base_low.float()) / j).clamp(min=2**-24).to(torch.float16)
        err = _grid_error(w, cand, base_low)
        better = err < best_err
        step = torch.where(better, cand, step)
        base = torch.where(better, base_low, base)
        best_err = torch.where(better, err, best_err)
    return step, base


def _grid_error(w: torch.Tensor, step: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """The squared error of w [N, G, 32] rounded to q in 0..255 against float16 step and base."""
    s, b = step.float()[..., None], base.float()[..., None]
    q = (w - b).div_(s).round_().clamp_(0, 255)
    return q.mul_(s).add_(b).sub_(w).square_().sum(2)


@dataclass(slots=True)
class Q6KBlocks:
    """llama.cpp's Q6_K as its files hold it: ``w = d * sc * (q - 32)``, q [N, K] in 0..63 (a
    byte each here), d float16 per super-block of 256 values [N, K / 256], sc int8 per
    sub-block of 16 [N, K / 16]: 6.5625 bits a weight, on the 6-bit kernel (``quantized_linear.Int6Linear``).
    Read from GGUF files only (nothing is quantized to it here)."""

    q: torch.Tensor
    d: torch.Tensor
    sc: torch.Tensor

    SUB_BLOCK: ClassVar[int] = 16

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        subs = k // self.SUB_BLOCK
        scale = self.d.float().repeat_interleave(subs // self.d.shape[1], dim=1) * self.sc.float()
        values = self.q.float().sub_(32).view(n, subs, self.SUB_BLOCK)
        return (values * scale[..., None]).view(n, k)

    def rows(self, ids: torch.Tensor) -> Q6KBlocks:
        return Q6KBlocks(self.q[ids], self.d[ids], self.sc[ids])


REFITS = 2  # least-squares refits of a group's step and base (see _fitted_steps)


def _fitted_steps(w: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group's step and base (the value of q = 0) for w [N, G, 32]: min/max, then refitted
    ``REFITS`` times by least squares to the values rounded against the last fit (as llama.cpp's
    ``make_qkx2_quants`` refits its candidates): a lower error than min/max's, and a third
    refit gains little (docs/performance.md, "Choices: weights")."""
    low = w.amin(dim=2)
    step = (w.amax(dim=2) - low) / levels
    step = _grid_step(w, low, step * levels, levels)
    n, sum_w = w.shape[2], w.sum(2)
    # One buffer for q, its sums as batched dot products: a fresh tensor a pass spends more time
    # in page faults on new memory than in the arithmetic.
    q = torch.empty_like(w)
    rows, cols = q.view(-1, 1, n), w.view(-1, n, 1)
    for _ in range(REFITS):
        torch.sub(w, low[..., None], out=q)
        q.div_(step.clamp(min=1e-30)[..., None]).round_().clamp_(0, levels)
        sum_q = q.sum(2)
        sum_qq = torch.bmm(rows, q.view(-1, n, 1)).view_as(sum_q)
        sum_qw = torch.bmm(rows, cols).view_as(sum_q)
        det = n * sum_qq - sum_q * sum_q
        fit = det > 0  # not all one value
        new_step = (n * sum_qw - sum_q * sum_w) / det.clamp(min=1e-30)
        step = torch.where(fit, new_step.clamp(min=0), step)
        low = torch.where(fit, (sum_w - step * sum_q) / n, low)
    return step, low


def _grid_step(w: torch.Tensor, low: torch.Tensor, span: torch.Tensor, levels: int):
    """Each group's step among span / j for j = (levels + 1) / 2 .. levels, the one whose
    rounding (from ``low``) leaves the least squared error. Weights already on a 4-bit grid (a
    Q4_K or Q4_1 file's, dequantized) use some of its levels: their span is a whole number of
    grid steps, a divisor of one of these j, so the grid is found again (min/max alone put a
    span of 12 steps into 15: Gemma 3 270M's Q4_K_M weights, taken back to 4 bits at load,
    7.5% relative RMS error against 0.7%); on float weights it keeps min/max's step (j =
    levels) but where another rounds better."""
    best, best_err = span / levels, None
    q = torch.empty_like(w)
    # 6 bits: the even j (4- and 5-bit grids' spans have even multiples there) and 63
    every = 1 if levels < 32 else 2
    for j in [*range((levels + 1) // 2, levels, every), levels]:
        step = span / j
        torch.sub(w, low[..., None], out=q)
        q.div_(step.clamp(min=1e-30)[..., None]).round_().clamp_(0, levels)
        err = q.mul_(step[..., None]).add_(low[..., None]).sub_(w).square_().sum(2)
        if best_err is None:
            best_err = err
            continue
        better = err < best_err
        best = torch.where(better, step, best)
        best_err = torch.where(better, err, best_err)
    return best


def _per_group(steps: torch.Tensor, groups: int) -> torch.Tensor:
    """A super-block's step [N, S] (float16) for each of its groups, float32 [N, groups]."""
    return steps.float().repeat_interleave(BLOCK_GROUPS, dim=1)[:, :groups]


def _codes(values: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``values`` [N, G] as a float16 step per super-block of 8 groups [N, S] and integer codes
    within +-``top`` (uint8 for 255: non-negative values; else int8): the step the largest over
    ``top``, or over 63's largest multiple under it where that rounds the super-block closer (a
    Q4_K file's 6-bit codes, in a float checkpoint made from it, then come back exactly)."""
    n, groups = values.shape
    padded = F.pad(values, (0, -groups % BLOCK_GROUPS)).view(n, -1, BLOCK_GROUPS)
    largest = _amax(padded, 2)
    best = None
    for levels in (top, top // 63 * 63):
        step = (largest / levels).clamp(min=2**-24).to(torch.float16)
        codes = (padded / step.float()[..., None]).round_().clamp_(-top, top)
        err = (codes * step.float()[..., None] - padded).square().sum(2)
        if best is not None:
            better = err < best[2]
            step = torch.where(better, step, best[0])
            codes = torch.where(better[..., None], codes, best[1])
            err = torch.minimum(err, best[2])
        best = (step, codes, err)
    codes = best[1].view(n, -1)[:, :groups]
    return best[0], codes.to(torch.uint8 if top == 255 else torch.int8)
