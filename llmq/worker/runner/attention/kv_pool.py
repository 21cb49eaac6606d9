"""The paged KV pool: every layer's keys and values in blocks of ``block_size`` tokens, in the
model's dtype or as 8-bit codes with a float32 scale per token and KV head (``kv_quant``).

Attention writes a step's keys and values through :meth:`KVPool.write` and reads them back
through :meth:`KVPool.context` (prefill chunks) and :meth:`KVPool.gather_blocks` (the decode
chunks), both in the model's dtype; llmq's C++ decode kernel reads the codes and scales in place
(:meth:`KVPool.kernel_cache`).
"""

from __future__ import annotations

import math
import mmap

import torch

from llmq.worker.runner.attention.kv_quant import (
    SCALE_DTYPE,
    code_dtype,
    dequantize,
    quantize,
    storage_dtype,
)


def _zero_pages(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, mmap.mmap]:
    """A zeroed CPU tensor whose pages become resident only when written: anonymous memory
    from the kernel reads as zeros untouched, where ``torch.zeros`` writes every page. A pool
    sized for a full batch of long sequences then costs the memory of the tokens it holds, not
    its size, at start (docs/performance.md, "Choices: memory")."""
    nbytes = math.prod(shape) * dtype.itemsize
    mapping = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE)  # not shmem: plain anonymous
    flat = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes)
    return flat.view(dtype).view(shape), mapping


def _zeros(shape, dtype, device) -> tuple[torch.Tensor, mmap.mmap | None]:
    if torch.device(device).type == "cpu":
        return _zero_pages(shape, dtype)
    return torch.zeros(shape, dtype=dtype, device=device), None


class KVPool:
    """Per-layer key and value caches, laid out [kv_heads, slots, head_dim] (``k``, ``v``: views
    of one ``kv`` tensor) so a gather of whole blocks along the slot axis lands contiguous,
    batch-major, ready for batched matmuls. With 8-bit codes (``cache_dtype`` int8 or fp8),
    ``kv`` holds the codes and ``scales`` [2 * kv_heads, slots] per layer their scales."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        layer_slots: list[int] | None = None,
        cache_dtype: str | torch.dtype | None = None,
    ):
        """``layer_slots``: per model layer, the storage slot of its keys and values in a block
        (a model with sliding windows, ``engine/kv_groups.py``: a block holds one KV group's
        layers); None: a block holds every layer's. ``dtype``: the model's, which attention
        computes in; ``cache_dtype``: "int8" or "fp8" for 8-bit codes, None or "auto": none."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.codes = code_dtype(cache_dtype)
        self.quantized = self.codes is not None
        stored = storage_dtype(self.codes) if self.quantized else dtype
        # Keys and values of a layer side by side, [2 * kv_heads, slots, head_dim], so that one
        # gather fetches both. Zeroed: masked-out slots are multiplied by zero probabilities,
        # and 0 * NaN is NaN.
        slots = num_layers if layer_slots is None else max(layer_slots) + 1
        shape = (slots, 2 * num_kv_heads, num_blocks * block_size, head_dim)
        self.storage, self._mapping = _zeros(shape, stored, device)
        self.scale_storage, self._scale_mapping = (
            _zeros(shape[:3], SCALE_DTYPE, device) if self.quantized else (None, None)
        )
        order = list(range(slots)) if layer_slots is None else layer_slots
        self._layer_views(order)
        self.head_offsets = torch.arange(2 * num_kv_heads, device=device).mul_(num_blocks)[:, None]
        self._gather = torch.empty(0, dtype=dtype, device=device)
        self._gather_codes = torch.empty(0, dtype=stored, device=device)
        self._gather_scales = torch.empty(0, dtype=SCALE_DTYPE, device=device)
        if layer_slots is None:  # the plain pool's views are one tensor each
            h = num_kv_heads
            self.kv, self.k, self.v = self.storage, self.storage[:, :h], self.storage[:, h:]

    def _layer_views(self, order: list[int]) -> None:
        """Per model layer (its storage slot in ``order``): ``kv``, ``k``, ``v`` and, viewed as
        whole blocks of one head, ``kv_blocks`` [2 * kv_heads * blocks, block_size * head_dim]
        (a gather along dim 0 of this flat view, block ids offset per head, is faster on CPU
        than one along the blocks axis of [2 * kv_heads, blocks, ...]: docs/performance.md);
        ``scales`` and ``scale_blocks`` alike."""
        h, rows = self.num_kv_heads, 2 * self.num_kv_heads * self.num_blocks
        self.kv = [self.storage[s] for s in order]
        self.k = [self.storage[s, :h] for s in order]
        self.v = [self.storage[s, h:] for s in order]
        self.kv_blocks = [self.storage[s].view(rows, -1) for s in order]
        self.scales = self.scale_blocks = None
        if self.quantized:
            self.scales = [self.scale_storage[s] for s in order]
            self.scale_blocks = [self.scale_storage[s].view(rows, -1) for s in order]

    @property
    def lazily_resident(self) -> bool:
        """Whether the pool's pages become resident only as they are written (the CPU)."""
        return self._mapping is not None

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block: every layer's keys and values (and scales), or one KV group's."""
        nbytes = self.storage[:, :, : self.block_size].nbytes
        if self.quantized:
            nbytes += self.scale_storage[:, :, : self.block_size].nbytes
        return nbytes

    @property
    def nbytes(self) -> int:
        """Bytes of the whole pool, scales included."""
        return self.block_nbytes * self.num_blocks

    @staticmethod
    def bytes_per_block(
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype,
        cache_dtype: str | torch.dtype | None = None,
    ) -> int:
        """Bytes of a block of ``num_layers`` layers: keys and values in ``dtype``, or as
        ``cache_dtype``'s codes and a float32 scale per token and head."""
        codes = code_dtype(cache_dtype)
        per_row = head_dim * dtype.itemsize
        if codes is not None:
            per_row = head_dim * codes.itemsize + SCALE_DTYPE.itemsize
        return 2 * num_layers * num_kv_heads * block_size * per_row

    def write(
        self, layer: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store a step's keys and values [kv_heads, T, head_dim] of ``layer`` at ``slots``;
        return them as the pool holds them (dequantized, in the model's dtype), so that a
        fresh prompt attends the same keys as a chunked or cached one."""
        if not self.quantized:
            self.k[layer].index_copy_(1, slots, key)
            self.v[layer].index_copy_(1, slots, value)
            return key, value
        q, scale = quantize(torch.cat([key, value]), self.codes)
        self.kv[layer].index_copy_(1, slots, q)
        self.scales[layer].index_copy_(1, slots, scale)
        stored = dequantize(q, scale, self.codes, key.dtype)
        return stored[: self.num_kv_heads], stored[self.num_kv_heads :]

    def context(
        self, layer: int, block_ids: torch.Tensor, ctx_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``ctx_len`` keys and values of the blocks ``block_ids`` of ``layer``, in
        the model's dtype: each [1, kv_heads, ctx_len, head_dim]."""
        two_h, _, width = self.kv[layer].shape
        blocks = self.kv[layer].view(two_h, self.num_blocks, self.block_size, width)
        kv = blocks.index_select(1, block_ids)
        if self.quantized:
            scales = self.scales[layer].view(two_h, self.num_blocks, self.block_size)
            kv = dequantize(kv, scales.index_select(1, block_ids), self.codes, self.dtype)
        kv = kv.view(two_h, -1, width)[:, :ctx_len].unsqueeze(0)
        return kv[:, : self.num_kv_heads], kv[:, self.num_kv_heads :]

    def gather_blocks(self, layer: int, ids: torch.Tensor, num_blocks: int) -> torch.Tensor:
        """The rows ``ids`` of ``kv_blocks[layer]`` (every head's blocks, in turn; ``num_blocks``
        a head) in the model's dtype, into the reused [2 * kv_heads, num_blocks, block_size *
        head_dim] buffer of ``gather_buffer``."""
        out = self.gather_buffer(num_blocks)
        flat = out.view(ids.shape[0], -1)
        if not self.quantized:
            torch.index_select(self.kv_blocks[layer], 0, ids, out=flat)
            return out
        codes = self._grown("_gather_codes", flat.numel()).view(flat.shape)
        scales = self._grown("_gather_scales", ids.shape[0] * self.block_size)
        scales = scales.view(ids.shape[0], self.block_size)
        torch.index_select(self.kv_blocks[layer], 0, ids, out=codes)
        torch.index_select(self.scale_blocks[layer], 0, ids, out=scales)
        rows = (ids.shape[0], self.block_size, self.head_dim)
        dequantize(codes.view(rows), scales, self.codes, self.dtype, out=flat.view(rows))
        return out

    def kernel_cache(self, layer: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``layer``'s [2 * kv_heads, slots, head_dim] cache as the C++ kernel reads it (codes in
        their own dtype) and its scales (None: not quantized)."""
        if not self.quantized:
            return self.kv[layer], None
        return self.kv[layer].view(self.codes), self.scales[layer]

    def gather_buffer(self, num_blocks: int) -> torch.Tensor:
        """A reusable [2 * kv_heads, num_blocks, block_size * head_dim] buffer in the model's
        dtype: keys then values, as a gather from ``kv_blocks`` lays them out."""
        numel = 2 * self.num_kv_heads * num_blocks * self.block_size * self.head_dim
        shape = (2 * self.num_kv_heads, num_blocks, self.block_size * self.head_dim)
        return self._grown("_gather", numel).view(shape)

    def _grown(self, name: str, numel: int) -> torch.Tensor:
        """The first ``numel`` elements of the reused buffer ``name``, grown with headroom so a
        batch whose contexts creep up does not reallocate (and page-fault a fresh buffer)
        every few steps."""
        buffer = getattr(self, name)
        if buffer.numel() < numel:
            buffer = torch.empty(numel + numel // 4, dtype=buffer.dtype, device=buffer.device)
            setattr(self, name, buffer)
        return buffer[:numel]
