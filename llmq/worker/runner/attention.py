"""Paged attention over the KV block pool, plugged into transformers' attention seam.

transformers routes every attention call of Llama/Qwen2/Mistral-style models through a function
looked up by name (``AttentionInterface``); extra keyword arguments of the model's forward reach
it unchanged. llmq registers ``llmq_paged`` and passes the step's :class:`StepMetadata` as the
``llmq_step`` keyword. The model sees one packed row of all scheduled tokens: decodes first (one
token each, sorted by context length), then prefill chunks.

Decodes use grouped query heads folded into query rows and two batched matmuls over KV gathered
whole-block into a preallocated buffer (SDPA with ``enable_gqa`` is far slower at query length
one on CPU). They run in a few chunks of similar context length (:class:`DecodeChunk`), each
padded only to its own longest sequence, so a batch of mixed lengths gathers little padding.
Prefill chunks use SDPA per sequence. On a CPU with a C++ compiler, llmq's kernel
(``kernels/paged_decode.cpp``) attends the decodes instead, reading keys and values from the
pool in place (:class:`DecodeTables`).

Everything that depends only on the step (block tables, masks, chunking) is built once per step
by the model runner; each layer only gathers, multiplies and writes, into reused buffers.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

ATTN_IMPLEMENTATION = "llmq_paged"


def _zero_pages(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, mmap.mmap]:
    """A zeroed CPU tensor whose pages become resident only when written: anonymous memory
    from the kernel reads as zeros untouched, where ``torch.zeros`` writes every page. A pool
    sized for a full batch of long sequences then costs the memory of the tokens it holds
    (the SmolLM2-135M shape's 1.41 GiB pool: about 0 MiB of RSS at start, not 1.41 GiB)."""
    nbytes = math.prod(shape) * dtype.itemsize
    mapping = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE)  # not shmem: plain anonymous
    flat = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes)
    return flat.view(dtype).view(shape), mapping


class KVPool:
    """Per-layer key and value caches, laid out [kv_heads, slots, head_dim] (``k``, ``v``: views
    of one ``kv`` tensor) so a gather of whole blocks along the slot axis lands contiguous,
    batch-major, ready for batched matmuls."""

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
    ):
        """``layer_slots``: per model layer, the storage slot of its keys and values in a block
        (a model with sliding windows, ``engine/kv_groups.py``: a block holds one KV group's
        layers); None: a block holds every layer's."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        # Keys and values of a layer side by side, [2 * kv_heads, slots, head_dim], so that one
        # gather fetches both. Zeroed: masked-out slots are multiplied by zero probabilities,
        # and 0 * NaN is NaN.
        slots = num_layers if layer_slots is None else max(layer_slots) + 1
        shape = (slots, 2 * num_kv_heads, num_blocks * block_size, head_dim)
        self._mapping: mmap.mmap | None = None
        if torch.device(device).type == "cpu":
            self.kv, self._mapping = _zero_pages(shape, dtype)
        else:
            self.kv = torch.zeros(shape, dtype=dtype, device=device)
        self.k = self.kv[:, :num_kv_heads]  # [layers, kv_heads, slots, head_dim] views
        self.v = self.kv[:, num_kv_heads:]
        # Per layer, viewed as whole blocks of one head: [2 * kv_heads * blocks, block_size *
        # head_dim]. A gather along dim 0 of this flat view (block ids offset per head) runs
        # 2x faster on CPU than one along the blocks axis of [2 * kv_heads, blocks, ...].
        self.kv_blocks = [kv.view(2 * num_kv_heads * num_blocks, -1) for kv in self.kv]
        self.head_offsets = torch.arange(2 * num_kv_heads, device=device).mul_(num_blocks)[:, None]
        self._gather = torch.empty(0, dtype=dtype, device=device)
        self.storage = self.kv
        if layer_slots is not None:  # indexed by model layer, as the plain pool's views are
            self.kv = [self.storage[s] for s in layer_slots]
            self.k = [self.storage[s, :num_kv_heads] for s in layer_slots]
            self.v = [self.storage[s, num_kv_heads:] for s in layer_slots]
            self.kv_blocks = [self.kv_blocks[s] for s in layer_slots]

    @property
    def lazily_resident(self) -> bool:
        """Whether the pool's pages become resident only as they are written (the CPU)."""
        return self._mapping is not None

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block: every layer's keys and values, or one KV group's."""
        return self.storage[:, :, : self.block_size].nbytes

    @staticmethod
    def bytes_per_block(
        num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
    ) -> int:
        return 2 * num_layers * num_kv_heads * block_size * head_dim * dtype.itemsize

    def gather_buffers(self, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Reusable buffers for ``num_blocks`` gathered blocks of keys and of values, each
        [kv_heads, num_blocks, block_size * head_dim] (grown, never shrunk)."""
        kv = self.gather_buffer(num_blocks)
        return kv[: self.num_kv_heads], kv[self.num_kv_heads :]

    def gather_buffer(self, num_blocks: int) -> torch.Tensor:
        """A reusable [2 * kv_heads, num_blocks, block_size * head_dim] buffer: keys then
        values, as a gather from ``kv_blocks`` lays them out."""
        numel = 2 * self.num_kv_heads * num_blocks * self.block_size * self.head_dim
        if self._gather.numel() < numel:
            # Grown with headroom, so a batch whose contexts creep up does not reallocate (and
            # page-fault a fresh buffer) every few steps.
            self._gather = torch.empty(
                numel + numel // 4, dtype=self.storage.dtype, device=self.storage.device
            )
        shape = (2 * self.num_kv_heads, num_blocks, self.block_size * self.head_dim)
        return self._gather[:numel].view(shape)


@dataclass(slots=True)
class DecodeChunk:
    """Decode rows ``[start, end)`` of the packed batch, attended together."""

    start: int
    end: int
    num_blocks: int  # blocks gathered per sequence: the chunk's longest context
    block_ids: torch.Tensor  # [(end - start) * num_blocks], row-major, padded with block 0
    mask: (
        torch.Tensor | None
    )  # [1, end - start, 1, num_blocks * block_size] additive; None: no padding
    # Models with sliding windows: per window, the mask that also hides keys out of it.
    window_masks: dict[int, torch.Tensor] | None = None


@dataclass(slots=True)
class PrefillChunk:
    q_start: int  # offset of its tokens in the packed row
    q_len: int
    ctx_len: int  # tokens in the cache after this step, its new ones included
    block_ids: torch.Tensor  # blocks covering ctx_len
    mask: (
        torch.Tensor | None
    )  # [q_len, ctx_len] (bool, or additive in the model's dtype); None: fresh causal prefill
    window_masks: dict[int, torch.Tensor] | None = None  # as DecodeChunk's


@dataclass(slots=True)
class DecodeTables:
    """The decodes' block tables for the C++ kernel, which reads the pool in place."""

    block_tables: torch.Tensor  # [B, most blocks of any] int32, padded with block 0
    context_lens: torch.Tensor  # [B] int32: tokens in the cache, the new one included


@dataclass(slots=True)
class StepMetadata:
    pool: KVPool
    slot_mapping: torch.Tensor  # [T] cache slot of every packed token
    num_decodes: int
    decode_chunks: list[DecodeChunk]  # the decodes' rows, cut by context length
    prefills: list[PrefillChunk]
    decode_tables: DecodeTables | None = None  # set: the kernel attends every decode
    windows: frozenset[int] = frozenset()  # the sliding windows the chunks have masks for
    max_model_len: int = 0  # a window this long or longer hides nothing
    # A model with KV groups (``engine/kv_groups.py``): per layer, its group's metadata (its
    # block tables, slots; a sliding group's only within its window, ``group_steps.py``).
    layer_steps: list[StepMetadata] | None = None
    # The window this group's layers must ask: its tables reach back no further (None: no
    # query of the step sees more keys than the window in them).
    group_window: int | None = None


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, Hq, T, D]
    key: torch.Tensor,  # [1, Hkv, T, D]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    llmq_step: StepMetadata | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    step = llmq_step
    if step is None:
        raise RuntimeError("llmq_paged attention called without step metadata")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if sliding_window is not None and sliding_window >= step.max_model_len:
        sliding_window = None  # it covers every key a query can see
    if step.layer_steps is not None:
        step = _layer_step(step, module.layer_idx, sliding_window)
    if _asks_more(step, key, value, sliding_window, softcap, s_aux):
        return attention_features.featured_attention(
            module, query, key, value, scale, step, sliding_window, softcap, s_aux
        )
    pool = step.pool
    layer = module.layer_idx
    k_cache, v_cache = pool.k[layer], pool.v[layer]  # [Hkv, slots, D]
    k_cache.index_copy_(1, step.slot_mapping, key[0])
    v_cache.index_copy_(1, step.slot_mapping, value[0])

    _, num_heads, num_tokens, head_dim = query.shape
    out = query.new_empty(num_tokens, num_heads, head_dim)

    if step.num_decodes:
        _attend_decodes(step, query, out, layer, scale)

    for chunk in step.prefills:
        s, n = chunk.q_start, chunk.q_len
        q = query[:, :, s : s + n]
        if chunk.mask is None:
            k = key[:, :, s : s + n]
            v = value[:, :, s : s + n]
        else:
            k = gather_context(k_cache, pool, chunk)
            v = gather_context(v_cache, pool, chunk)
        attn = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=chunk.mask,
            is_causal=chunk.mask is None,
            scale=scale,
            enable_gqa=True,
        )  # [1, Hq, n, D]
        out[s : s + n] = attn[0].transpose(0, 1)
    return out.unsqueeze(0), None


def _layer_step(step: StepMetadata, layer: int, window: int | None) -> StepMetadata:
    """The metadata of ``layer``'s KV group, whose window the layer must ask."""
    step = step.layer_steps[layer]
    if step.group_window not in (None, window):  # its tables cut off keys the layer reads
        raise RuntimeError(
            f"layer {layer} asks a window of {window}; its KV group holds {step.group_window}"
        )
    return step


def _asks_more(step: StepMetadata, key, value, window, softcap, sinks) -> bool:
    """Whether a layer asks more than causal softmax attention (``attention_features``)."""
    width = step.pool.head_dim
    if window is not None or softcap is not None or sinks is not None:
        return True
    return key.shape[-1] != width or value.shape[-1] != width


def _attend_decodes(
    step: StepMetadata,
    query: torch.Tensor,  # [1, Hq, T, D]
    out: torch.Tensor,  # [T, Hq, D]
    layer: int,
    scale: float,
) -> None:
    """The decodes' attention, written into their rows of ``out``."""
    b, pool = step.num_decodes, step.pool
    if step.decode_tables is not None:
        kernel_decodes(step, query, out, layer, scale)
        return
    # [Hq, B, D] -> [Hkv, G, B, D]: the G query heads sharing a KV head become G rows.
    num_heads, num_kv_heads = query.shape[1], pool.num_kv_heads
    q_all = query[0, :, :b].unflatten(0, (num_kv_heads, num_heads // num_kv_heads))
    for chunk in step.decode_chunks:
        _decode_chunk(chunk, q_all, out, pool, layer, scale)


def kernel_decodes(
    step: StepMetadata,
    query: torch.Tensor,  # [1, Hq, T, D]
    out: torch.Tensor,  # [T, Hq, D]
    layer: int,
    scale: float,
    *features: int | float | torch.Tensor | None,
) -> None:
    """The decodes' attention by llmq's C++ kernel, reading the pool in place (the step's
    ``decode_tables``). ``features``: a layer's window, softcap and sinks (0, 0.0, None: none;
    ``attention_features``); a plain layer passes none."""
    b, pool, tables = step.num_decodes, step.pool, step.decode_tables
    torch.ops.llmq.paged_decode_attention(
        out[:b],
        query[0, :, :b].transpose(0, 1),
        pool.kv[layer],
        tables.block_tables,
        tables.context_lens,
        pool.block_size,
        scale,
        *features,
    )


def _decode_chunk(
    chunk: DecodeChunk,
    q_all: torch.Tensor,  # [Hkv, G, B, D]
    out: torch.Tensor,  # [T, Hq, D]
    pool: KVPool,
    layer: int,
    scale: float,
) -> None:
    q, kv = gather_decode_chunk(chunk, q_all, pool, layer)
    scatter_decode_chunk(chunk, attend_gathered(q, kv, chunk.mask, scale), out)


def gather_decode_chunk(
    chunk: DecodeChunk, q_all: torch.Tensor, pool: KVPool, layer: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunk's queries [Hkv * n, G, D] (query heads sharing a KV head as rows) and its
    sequences' keys and values gathered from the pool [2, Hkv * n, ctx, D]."""
    s, e = chunk.start, chunk.end
    n = e - s
    num_kv_heads, group, _, head_dim = q_all.shape
    ctx = chunk.num_blocks * pool.block_size
    # [Hkv * n, G, D], contiguous (one copy out of the packed row)
    q = q_all[:, :, s:e].transpose(1, 2).reshape(num_kv_heads * n, group, head_dim)
    kv = pool.gather_buffer(n * chunk.num_blocks)
    ids = (pool.head_offsets + chunk.block_ids).view(-1)  # the blocks of every head, in turn
    torch.index_select(pool.kv_blocks[layer], 0, ids, out=kv.view(ids.shape[0], -1))
    return q, kv.view(2, num_kv_heads * n, ctx, head_dim)


def scatter_decode_chunk(chunk: DecodeChunk, attn: torch.Tensor, out: torch.Tensor) -> None:
    """The chunk's attention [Hkv * n, G, D] into its rows of ``out`` [T, Hq, D]."""
    s, e = chunk.start, chunk.end
    n, head_dim = e - s, attn.shape[-1]
    num_kv_heads, group = attn.shape[0] // n, attn.shape[1]
    out[s:e].view(n, num_kv_heads, group, head_dim).copy_(
        attn.view(num_kv_heads, n, group, head_dim).transpose(0, 1)
    )


def attend_gathered(
    q: torch.Tensor,  # [Hkv * n, G, D]: the query heads sharing a KV head as rows
    kv: torch.Tensor,  # [2, Hkv * n, ctx, D]: keys, values
    mask: torch.Tensor,  # additive, broadcast to [Hkv * n, G, ctx]
    scale: float,
) -> torch.Tensor:
    """Decode attention over gathered keys and values: [Hkv * n, G, D]."""
    # scale * q @ k^T + mask in one call: [Hkv * n, G, ctx]
    scores = torch.baddbmm(mask, q, kv[0].transpose(1, 2), alpha=scale)
    # In the model's dtype: on CPU a reduced-precision softmax accumulates in float32 inside.
    probs = torch.softmax(scores, dim=-1)
    return torch.bmm(probs, kv[1])


def gather_context(cache: torch.Tensor, pool: KVPool, chunk: PrefillChunk) -> torch.Tensor:
    num_kv_heads, _, head_dim = cache.shape
    blocks = cache.view(num_kv_heads, pool.num_blocks, pool.block_size, head_dim)
    gathered = blocks.index_select(1, chunk.block_ids).view(num_kv_heads, -1, head_dim)
    return gathered[:, : chunk.ctx_len].unsqueeze(0)


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)

# Layers with sliding windows, softcapping, sinks or MLA's widths; imported last (it reads the
# dataclasses above).
from llmq.worker.runner import attention_features  # noqa: E402
