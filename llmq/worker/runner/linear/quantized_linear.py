"""Projections with quantized weights: llmq's integer kernels where they are loaded, torch's CPU
weight-only kernels elsewhere.

- ``Int8Linear``: int8 weights with one symmetric scale per group of 32 input columns (llmq's
  kernel) or per output channel (torch's), or a float16 scale and base per group of 32
  (``Int8Groups``: int8 at load on llmq's kernel where ``LLMQ_INT8_MIN``).
- ``Int4Linear``: 4-bit weights in groups of 32 input columns, each group's scale and base
  coded in 8 bits against its super-block of 256 inputs (``Int4Blocks``, llama.cpp's Q4_K
  form: quantization at load and GGUF files), a float16 scale and base per group of 32
  (``Int4Groups``: GGUF's Q4_1), or a checkpoint's float scale and zero per group of 32 to 256
  (``Int4Weight``, ``w = (q - 8) * scale + zero``), q in 0..15.
- ``Int6Linear``: 6 bits (``Int6Blocks``, ``Int6Groups``: GGUF's Q5_1; on llmq's kernel only),
  built on the 4-bit panels.

On a CPU with AVX512-VNNI or AVX2, with llmq's kernels loaded (``kernels/int_matmul.cpp``), both
run with integer dot products as llama.cpp runs its quantized types (W8A8, W4A8): each row of
activations quantized to int8 per block of 32 inputs, one float32 scaling per block; by default
(``LLMQ_INT_ACTIVATIONS=2``) in two terms, the residual quantized again (closer to the float
product than bfloat16 activations; llama.cpp's single Q8_1 term moved a real model's answers).
They beat torch's weight-only kernels at every row count, by most from a few rows on
(docs/performance.md, "Choices: CPU kernels").
Tolerance (tests/worker/runner/test_int_matmul.py): against the float64 product of the
activations as quantized and the dequantized weights, within ``1e-5`` of the sum of the terms'
magnitudes (the rounding to bfloat16 of a bfloat16 output besides); a row gets the same bits in
any batch. ``bench/quality_lib.py`` measures a served form's distance to the float model.

Elsewhere (W8A16, W4A16) on ``aten._weight_int8pack_mm`` and
``aten._convert_weight_to_int4pack_for_cpu`` + ``aten._weight_int4pack_mm_for_cpu``.

torch's kernels have vectorized (AVX2 / AVX-512) paths for bfloat16 activations only: float32
activations fall to scalar code, many times slower (docs/performance.md, "Choices: weights").
So the activations enter the kernels in bfloat16 (the A16 of W8A16) whatever the model's dtype, and
the output comes back in it.

Their tolerance (tested over odd shapes): against the float32 matmul of the bfloat16-rounded
activations with the dequantized weights, each output is within ``2**-8`` of its magnitude (the
kernels round their output to bfloat16) plus ``1e-5`` of ``|x| @ |w|.T`` (float32 sums in
another order).

6-bit projections (``Int6Linear``, ``Int6Blocks``) on llmq's integer kernel (``kernels/int6_matmul.cpp``): the
tensors a 4-bit model keeps at more bits, as llama.cpp's Q4_K_M keeps them in Q6_K.

The panels ``q6_matmul`` takes, [P, K / 32, 6, 16, 4] bytes: a group's values' low nibbles as
``q4_panels`` lays them out (parts 0-3), then their top two bits (parts 4-5: byte i of a column
in part j holds, from its low bits up, those of step 2j's low and high nibble, then step
2j + 1's); the scales are ``Int4Blocks``' super-blocks (``k_blocks``), or a GGUF's Q6_K ones
(``Q6KLinear``: ``q6k_blocks``). Where the kernel is not
loaded (no AVX2), or on CUDA, the tensors take int8 instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmq.common.settings import get_settings
from llmq.worker.runner.linear.dynamic_quantized import Int8DynamicLinear
from llmq.worker.runner.linear.quantized_weights import (
    ACTIVATIONS,
    BLOCK_GROUPS,
    GROUP,
    Int4Blocks,
    Int4Groups,
    Int4Weight,
    Int6Blocks,
    Int6Groups,
    Int8Groups,
    Int8Weight,
    Q6KBlocks,
    round_up,
)

_INT8_K_MULTIPLE = (
    16  # _weight_int8pack_mm crashes on other widths (torch 2.13; 24, 40, 56 on AVX2)
)
_INT4_N_MULTIPLE = 16  # _convert_weight_to_int4pack_for_cpu's requirement
PANEL_COLS = 16  # output columns of a panel of llmq's kernels (int_matmul.cpp's kCols)


_PACK_ROWS = 1024  # rows packed into a kernel's panels at a time (a multiple of 16)


class Int8Linear:
    """``y = x @ dequantize(weight).T + bias`` for 2-D ``x``, on llmq's integer kernel where it
    is loaded (``q8_matmul``: activations quantized to int8 per block of 32; weights' scales per
    group of 32 or per channel, or a scale and base per group: ``Int8Groups``), else on torch's
    ``_weight_int8pack_mm`` (bfloat16 activations; per-channel scales: a grouped weight is
    quantized again per channel)."""

    bits = 8

    def __init__(
        self,
        weight: Int8Weight | Int8Groups | torch.Tensor,
        bias: torch.Tensor | None,
        kernel: bool | None = None,
        with_min: bool = False,
    ):
        """``weight``: an ``Int8Weight`` or ``Int8Groups``, or float weights to quantize (in
        groups of 32 on llmq's kernel, a slice of rows at a time, with a minimum per group where
        ``with_min``; else per channel)."""
        n, k = weight.shape if isinstance(weight, torch.Tensor) else weight.q.shape
        self.out_features, self.in_features = n, k
        self.kernel = int_kernel_available() if kernel is None else kernel
        self.bias = bias
        if self.kernel:
            if isinstance(weight, torch.Tensor):
                self.q, self.scale = q8_panels_from_float(weight, with_min)
            else:
                self.q, self.scale = q8_panels(weight)
            self.bias = kernel_bias(bias)
            return
        if isinstance(weight, Int8Groups):
            weight = weight.dequantize()
        if isinstance(weight, torch.Tensor):
            weight = Int8Weight.quantize(weight, grouped=False)
        weight = weight.per_channel()
        self.pad = round_up(k, _INT8_K_MULTIPLE) - k
        self.q = F.pad(weight.q, (0, self.pad)) if self.pad else weight.q
        self.scale = weight.scale.to(ACTIVATIONS)

    @property
    def weight(self) -> torch.Tensor:  # what a caller that reads ``.weight`` should find
        return self.q

    def rows(self, ids: torch.Tensor) -> Int8Weight | Int8Groups:
        """The rows ``ids`` (1-D) of the weight (a tied embedding reads them)."""
        if not self.kernel:
            return Int8Weight(self.q[ids, : self.in_features], self.scale[ids])
        panel, lane = ids // PANEL_COLS, ids % PANEL_COLS
        lanes = self.q[panel, :, :, lane]  # [n, K / 32, 8, 4]
        if self.scale.dim() == 4:  # a scale and base per group: the bytes as they are
            u = lanes.reshape(len(ids), -1)[:, : self.in_features]
            pair = self.scale[panel, :, :, lane]  # [n, K / 32, 2]
            return Int8Groups(u, pair[:, :, 0], pair[:, :, 1])
        q = lanes.reshape(len(ids), -1)[:, : self.in_features].to(torch.int16) - 128
        scale = self.scale[panel, :, lane] if self.scale.dim() == 3 else self.scale[ids]
        return Int8Weight(q.to(torch.int8), scale)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel:
            return on_kernel(torch.ops.llmq.q8_matmul, x, self.q, self.scale, self)
        dtype = x.dtype
        a = x.to(ACTIVATIONS)
        if self.pad:
            a = F.pad(a, (0, self.pad))
        y = torch.ops.aten._weight_int8pack_mm(a.contiguous(), self.q, self.scale).to(dtype)
        return y + self.bias if self.bias is not None else y

    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes


def q8_panels(weight: Int8Weight | Int8Groups) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` in q8_matmul's layout: q + 128 (``Int8Groups``: q) [P, K / 32, 8, 16, 4]
    (output channels padded to a multiple of 16, inputs to one of 32, with zeros; a byte run of
    4 inputs per column), and the scales: a grouped weight's [P, K / 32, 16] float16, an
    ``Int8Groups``' scale and base [P, K / 32, 2, 16] float16, else the columns' [P * 16]
    float32."""
    n, k = weight.q.shape
    rows, cols = round_up(n, PANEL_COLS), round_up(k, GROUP)
    panels = torch.empty(rows // PANEL_COLS, cols // GROUP, 8, PANEL_COLS, 4, dtype=torch.uint8)
    offset = 0 if isinstance(weight, Int8Groups) else 128
    for start, q in panel_rows(weight.q, rows):
        q = F.pad(q, (0, cols - k))
        biased = (q.to(torch.int16) + offset).to(torch.uint8)
        biased = biased.view(-1, PANEL_COLS, cols // GROUP, 8, 4)
        first = start // PANEL_COLS
        panels[first : first + biased.shape[0]] = biased.permute(0, 2, 3, 1, 4)
    if isinstance(weight, Int8Groups):
        return panels, f16_groups(weight, rows)
    if not weight.grouped:
        return panels, F.pad(weight.scale.float(), (0, rows - n))
    scale = F.pad(weight.scale.to(torch.float16), (0, 0, 0, rows - n))
    return panels, scale.view(-1, PANEL_COLS, cols // GROUP).transpose(1, 2).contiguous()


def q8_panels_from_float(
    weight: torch.Tensor, with_min: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q8_panels(Int8Weight.quantize(weight))`` (``with_min``: ``Int8Groups.quantize``)
    built ``_PACK_ROWS`` rows at a time: the whole int8 weight is never held beside its panels,
    which lowers the start's peak RSS (docs/performance.md, "Choices: memory")."""
    n, k = weight.shape
    panels, groups = round_up(n, PANEL_COLS) // PANEL_COLS, round_up(k, GROUP) // GROUP
    packed = torch.empty(panels, groups, 8, PANEL_COLS, 4, dtype=torch.uint8)
    pair = (2,) if with_min else ()
    scales = torch.empty(panels, groups, *pair, PANEL_COLS, dtype=torch.float16)
    quantize = Int8Groups.quantize if with_min else Int8Weight.quantize
    for start in range(0, n, _PACK_ROWS):
        part, scale = q8_panels(quantize(weight[start : start + _PACK_ROWS]))
        first = start // PANEL_COLS
        packed[first : first + len(part)] = part
        scales[first : first + len(part)] = scale
    return packed, scales


def panel_rows(q: torch.Tensor, rows: int, step: int = _PACK_ROWS):
    """(first row, rows [step or fewer, K]) of ``q`` padded with zero rows (a copy) up to
    ``rows``: a panel layout is built a slice at a time, its temporaries a few MiB, so a large
    head does not raise the start's peak RSS (docs/performance.md, "Choices: memory")."""
    for start in range(0, rows, step):
        part = q[start : start + step]
        yield start, F.pad(part, (0, 0, 0, min(step, rows - start) - part.shape[0]))


def kernel_bias(bias: torch.Tensor | None) -> torch.Tensor | None:
    """The bias as llmq's kernels add it, in float32 (held so: the fused step passes it on
    as it is, no conversion a call)."""
    return bias.float() if bias is not None else None


def on_kernel(op, x: torch.Tensor, weight, scales, linear) -> torch.Tensor:
    """``linear`` (an Int8Linear or Int4Linear on llmq's kernels) of ``x`` through ``op``:
    float32 or bfloat16 rows as they are, the output back in x's dtype."""
    dtype = x.dtype
    a = x if dtype in (torch.float32, ACTIVATIONS) else x.float()
    y = op(a.contiguous(), weight, scales, linear.out_features, linear.bias)
    return y.to(dtype)


def int8_with_min() -> bool:
    """Whether int8 at load takes a minimum per group (``Int8Groups``, ``LLMQ_INT8_MIN``) on
    llmq's kernel instead of a symmetric scale (docs/performance.md, "Quantized weights")."""
    return get_settings().int8_min


def int_kernel_available() -> bool:
    """Whether llmq's int4 and int8 kernels (``kernels/int_matmul.cpp``) are loaded and built
    for this CPU (AVX512-VNNI or AVX2)."""
    try:
        return bool(torch.ops.llmq.int_matmul_available())
    except (AttributeError, RuntimeError):  # the kernels are not loaded
        return False


def q4_panels(
    weight: Int4Weight | Int4Blocks | Int4Groups, rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` (its output channels padded to ``rows``, a multiple of 16) in q4_matmul's
    layout: nibbles [P, K / 32, 4, 16, 4] (a byte: inputs k + i low, k + 4 + i high, of 8), and
    the scales: an ``Int4Weight``'s scale and zero [P, K / 32, 2, 16] bfloat16 (a larger group's
    repeated onto its 32s), an ``Int4Blocks``' super-blocks (``k_blocks``), or an
    ``Int4Groups``' float16 scale and base (``f16_groups``)."""
    if isinstance(weight, Int4Blocks):
        return q4_nibbles(weight.q, rows), k_blocks(weight, rows)
    if isinstance(weight, Int4Groups):
        return q4_nibbles(weight.q, rows), f16_groups(weight, rows)
    n, k = weight.q.shape
    scale, zero = F.pad(weight.scale, (0, 0, 0, rows - n)), F.pad(weight.zero, (0, 0, 0, rows - n))
    repeat = weight.group // GROUP
    if repeat > 1:
        scale, zero = scale.repeat_interleave(repeat, 1), zero.repeat_interleave(repeat, 1)
    panels, groups = rows // PANEL_COLS, k // GROUP
    sz = torch.stack([scale, zero], dim=1).to(ACTIVATIONS)
    sz = sz.view(panels, PANEL_COLS, 2, groups).permute(0, 3, 2, 1)
    return q4_nibbles(weight.q, rows), sz.contiguous()


def q4_nibbles(q: torch.Tensor, rows: int) -> torch.Tensor:
    """q [N, K] in 0..15 as q4_matmul's nibbles [P, K / 32, 4, 16, 4], its padding rows
    (scale 0) q = 8."""
    n, k = q.shape
    panels, groups = rows // PANEL_COLS, k // GROUP
    packed = torch.empty(panels, groups, 4, PANEL_COLS, 4, dtype=torch.uint8)
    for start, part in panel_rows(q, rows):
        if start + part.shape[0] > n:  # its padding rows (new memory)
            part[max(n - start, 0) :] = 8
        nibbles = part.to(torch.uint8).view(-1, PANEL_COLS, groups, 4, 2, 4)
        both = nibbles[:, :, :, :, 0] | (nibbles[:, :, :, :, 1] << 4)
        first = start // PANEL_COLS
        packed[first : first + both.shape[0]] = both.permute(0, 2, 3, 1, 4)
    return packed


def f16_groups(weight: Int4Groups, rows: int) -> torch.Tensor:
    """An ``Int4Groups``' (or 6- or 8-bit groups') d and m as the kernels' float16 scale and
    base [P, K / 32, 2, 16] (padding rows: 0)."""
    n, groups = weight.d.shape
    pair = torch.stack([weight.d, weight.m], dim=1).to(torch.float16)  # [N, 2, G]
    pair = F.pad(pair, (0, 0, 0, 0, 0, rows - n)).view(rows // PANEL_COLS, PANEL_COLS, 2, groups)
    return pair.permute(0, 3, 2, 1).contiguous()


def k_blocks(weight: Int4Blocks, rows: int) -> torch.Tensor:
    """An ``Int4Blocks``' steps and codes as q4_matmul's super-blocks [P, ceil(K / 256), 320]
    bytes: float16 d [16] and m step [16], then the groups' sc uint8 [8][16] and m int8 [8][16]
    (padding rows: steps 0; a last super-block's missing groups: codes 0)."""
    n, groups = weight.sc.shape
    supers = weight.d.shape[1]
    panels, pad_rows, pad_groups = rows // PANEL_COLS, rows - n, supers * BLOCK_GROUPS - groups

    def steps(t: torch.Tensor) -> torch.Tensor:  # [N, S] float16 -> [P, S, 32] bytes
        t = F.pad(t, (0, 0, 0, pad_rows)).view(panels, PANEL_COLS, supers).permute(0, 2, 1)
        return t.contiguous().view(torch.uint8)

    def codes(t: torch.Tensor) -> torch.Tensor:  # [N, G] -> [P, S, 128] bytes
        t = F.pad(t, (0, pad_groups, 0, pad_rows)).view(panels, PANEL_COLS, supers, -1)
        return t.permute(0, 2, 3, 1).reshape(panels, supers, -1).view(torch.uint8)

    parts = (steps(weight.d), steps(weight.m_step), codes(weight.sc), codes(weight.m))
    return torch.cat(parts, dim=2)


class Int4Linear:
    """``y = x @ dequantize(weight).T + bias`` for 2-D ``x``, on llmq's integer kernel where it
    is loaded (``q4_matmul``: activations quantized to int8 per block of 32), else on torch's
    int4pack kernels (bfloat16 activations; on CUDA tinygemm's, ``_weight_int4pack_mm``, which
    takes the same ``(q - 8) * scale + zero`` groups). Output channels are padded to a multiple
    of 16 with zero rows."""

    bits = 4

    def __init__(
        self,
        weight: Int4Weight | Int4Blocks | Int4Groups,
        bias: torch.Tensor | None,
        kernel: bool | None = None,
    ):
        n, k = weight.q.shape
        self.out_features, self.in_features = n, k
        rows = round_up(n, _INT4_N_MULTIPLE)
        self.kernel = kernel if kernel is not None else int_kernel_available()
        self.kernel = self.kernel and not weight.q.is_cuda
        self.bias = bias
        if self.kernel:
            self.group = GROUP
            self.packed, self.scales_and_zeros = q4_panels(weight, rows)
            self.bias = kernel_bias(bias)
            return
        if isinstance(weight, (Int4Blocks, Int4Groups)):
            weight = weight.as_int4_weight()
        self.group = weight.group
        q, scale, zero = weight.q, weight.scale, weight.zero
        if rows > n:
            q = F.pad(q, (0, 0, 0, rows - n), value=8)
            scale, zero = F.pad(scale, (0, 0, 0, rows - n)), F.pad(zero, (0, 0, 0, rows - n))
        if q.is_cuda:  # tinygemm: [N, K / 2] bytes, the even input in the high nibble
            nibbles = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)
            tiles = next(t for t in (8, 4, 2) if k % (16 * t) == 0)
            self.packed = torch.ops.aten._convert_weight_to_int4pack(nibbles.contiguous(), tiles)
        else:
            q = q.to(torch.int32).contiguous()  # the CPU packing takes int32
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        # The kernels' layout: [K / group, N, 2], scale then zero.
        self.scales_and_zeros = torch.stack([scale.t(), zero.t()], dim=2).to(ACTIVATIONS)

    @property
    def weight(self) -> torch.Tensor:
        return self.packed

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel:
            return on_kernel(torch.ops.llmq.q4_matmul, x, self.packed, self.scales_and_zeros, self)
        dtype = x.dtype
        a = x.to(ACTIVATIONS).contiguous()
        aten = torch.ops.aten
        mm = aten._weight_int4pack_mm if a.is_cuda else aten._weight_int4pack_mm_for_cpu
        y = mm(a, self.packed, self.group, self.scales_and_zeros)
        if y.shape[1] != self.out_features:
            y = y[:, : self.out_features]
        y = y.to(dtype)
        return y + self.bias if self.bias is not None else y

    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales_and_zeros.nbytes


# 6-bit projections: their docstring is the module's last part.
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

    def __init__(self, weight: Int6Blocks | Int6Groups | Q6KBlocks, bias: torch.Tensor | None):
        n, k = weight.q.shape
        self.out_features, self.in_features = n, k
        rows = round_up(n, PANEL_COLS)
        self.kernel = True
        self.packed = q6_panels(weight.q, rows)
        self.scales_and_zeros = self._scales(weight, rows)
        self.bias = kernel_bias(bias)

    @staticmethod
    def _scales(weight: Int6Blocks | Int6Groups, rows: int) -> torch.Tensor:
        return (
            f16_groups(weight, rows) if isinstance(weight, Int6Groups) else k_blocks(weight, rows)
        )

    @property
    def weight(self) -> torch.Tensor:
        return self.packed

    def _panel_rows(self, ids: torch.Tensor) -> tuple:
        """The rows ``ids``' values (q [n, K]), their panels' scales [n, S, bytes], and each
        row's index into those and lane in its panel."""
        panel, lane = ids // PANEL_COLS, ids % PANEL_COLS
        q = _panel_values(self.packed[panel, :, :, lane])
        return q, self.scales_and_zeros[panel], torch.arange(len(ids)), lane

    def rows(self, ids: torch.Tensor) -> Int6Blocks | Int6Groups:
        """The rows ``ids`` (1-D) of the weight (a tied embedding reads them)."""
        q, blocks, picked, lane = self._panel_rows(ids)  # d, m step [16]; sc, m [8][16]
        if blocks.dtype == torch.float16:  # a group's scale and base [G, 2, 16]
            pair = blocks[picked, :, :, lane]
            return Int6Groups(q, pair[:, :, 0], pair[:, :, 1])
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


QuantizedLinear = Int8Linear | Int4Linear


def int8_linear(weight: Int8Weight, bias: torch.Tensor | None, kernel: bool | None = None):
    """``weight`` on its device's int8 kernel: on CUDA ``Int8DynamicLinear`` (per-channel scales:
    a grouped weight is quantized again per channel), else ``Int8Linear``."""
    if not weight.q.is_cuda:
        return Int8Linear(weight, bias, kernel)
    return Int8DynamicLinear(weight.per_channel(), bias)


def quantized_linear(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    bits: int,
    kernel: bool | None = None,
    groups: bool = False,
) -> QuantizedLinear:
    """``weight`` [N, K] (any float dtype) quantized to ``bits`` (8; 4 where K is a multiple of
    the group, 6 there on llmq's kernel: else 8). ``kernel``: on llmq's integer kernels (None:
    where they are loaded). ``groups``: a float16 step and base per group on llmq's kernels,
    6 bits ``Int6Groups`` (7 bits a weight) instead of k-quant blocks, 8 ``Int8Groups`` (9)
    whatever ``LLMQ_INT8_MIN`` says."""
    blocks = weight.shape[1] % GROUP == 0
    if bits == 4 and blocks:
        return Int4Linear(Int4Blocks.quantize(weight), bias, kernel)
    kernels = int_kernel_available() if kernel is None else kernel
    if bits == 6 and blocks and kernels and not weight.is_cuda:
        kind = Int6Groups if groups else Int6Blocks
        return Int6Linear(kind.quantize(weight), bias)
    if bits not in (4, 6, 8):
        raise ValueError(f"unsupported weight bits {bits}")
    if weight.is_cuda:
        return int8_linear(Int8Weight.quantize(weight, grouped=False), bias)
    return Int8Linear(weight, bias, kernel, with_min=groups or int8_with_min())
