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
pool in place (:class:`DecodeTables`). The pool (``kv_pool.py``) may hold 8-bit codes
(LLMQ_KV_CACHE_DTYPE): its ``write`` quantizes, its reads dequantize, and the kernel's 8-bit
variant (``kernels/paged_decode_q8.cpp``) dequantizes as it loads each key and value.

Everything that depends only on the step (block tables, masks, chunking) is built once per step
by the model runner; each layer only gathers, multiplies and writes, into reused buffers.

Layers that ask more than softmax(q k^T * scale) v over causal keys (``featured_attention``).

What transformers' attention seam hands a layer's attention function, and what it means here,
as the models' own eager attention computes it (float32 greedy output equals ``generate``):

- ``sliding_window`` W: a query at position p sees keys at positions p - W + 1 .. p (the mask
  transformers builds: ``kv_idx > q_idx - W``). The runner builds each step's masks for every
  window the model uses (``window_masks`` of the chunks); a window of max_model_len tokens or
  more hides nothing and is none.
- ``softcap`` c (Gemma 2): scores become ``c * tanh(scores / c)`` before the mask and softmax.
- ``s_aux`` (gpt-oss's learned sinks): one more logit per query head in the softmax's
  denominator, whose probability is dropped.
- keys and values of different widths (MLA, DeepSeek V2/V3): the pool stores both at the wider
  one, the narrower zero-padded (an exact dot product and weighted sum); the output is cut back
  to the values' width. Storing the per-head keys and values uncompressed is exact; caching
  MLA's compressed latent instead is the memory optimisation left.

Decodes go to llmq's C++ kernel where the runner turned it on (``decode_tables`` set): it takes
the window, the softcap and the sinks itself and reads the pool at its one width, as here. An
8-bit pool (``kv_quant``) serves all of these: the padded zeros quantize to zeros, and every
read (kernel, gathered decodes, prefill contexts) sees the dequantized keys and values.
Layers that ask none of these (and models without any) never come here: ``paged_attention``
keeps its own path, so a plain model's step does no extra work.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from llmq.worker.runner.attention.kv_pool import KVPool

ATTN_IMPLEMENTATION = "llmq_paged"


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
    # block tables, slots; a sliding group's only within its window, ``step_metadata.py``).
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
        return featured_attention(
            module, query, key, value, scale, step, sliding_window, softcap, s_aux
        )
    pool = step.pool
    layer = module.layer_idx
    # As the pool holds them (an 8-bit pool: dequantized), for a fresh prompt's attention.
    stored_k, stored_v = pool.write(layer, step.slot_mapping, key[0], value[0])

    _, num_heads, num_tokens, head_dim = query.shape
    out = query.new_empty(num_tokens, num_heads, head_dim)

    if step.num_decodes:
        _attend_decodes(step, query, out, layer, scale)

    for chunk in step.prefills:
        s, n = chunk.q_start, chunk.q_len
        q = query[:, :, s : s + n]
        if chunk.mask is None:
            k = stored_k[None, :, s : s + n]
            v = stored_v[None, :, s : s + n]
        else:
            k, v = pool.context(layer, chunk.block_ids, chunk.ctx_len)
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
    """Whether a layer asks more than causal softmax attention (``featured_attention``)."""
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
    ``featured_attention``); a plain layer passes none."""
    b, pool, tables = step.num_decodes, step.pool, step.decode_tables
    kv, scales = pool.kernel_cache(layer)
    args = (tables.block_tables, tables.context_lens, pool.block_size, scale, *features)
    query = query[0, :, :b].transpose(0, 1)
    if scales is None:
        torch.ops.llmq.paged_decode_attention(out[:b], query, kv, *args)
    else:  # 8-bit codes, dequantized as the kernel loads them (kernels/paged_decode_q8.cpp)
        torch.ops.llmq.paged_decode_attention_q8(out[:b], query, kv, scales, *args)


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
    ids = (pool.head_offsets + chunk.block_ids).view(-1)  # the blocks of every head, in turn
    kv = pool.gather_blocks(layer, ids, n * chunk.num_blocks)
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


# Layers with sliding windows, softcaps, sinks or MLA's widths (the docstring's second part).


def step_window(step: StepMetadata, window: int | None) -> int | None:
    """The window whose masks this layer uses; None: a full (causal) one."""
    if window is None or window >= step.max_model_len:
        return None
    if window not in step.windows:
        raise RuntimeError(f"no masks for a sliding window of {window} tokens in this step")
    return window


def featured_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, Hq, T, Dk]
    key: torch.Tensor,  # [1, Hkv, T, Dk]
    value: torch.Tensor,  # [1, Hkv, T, Dv]
    scale: float,
    step: StepMetadata,
    window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,  # [Hq]
) -> tuple[torch.Tensor, None]:
    pool, layer = step.pool, module.layer_idx
    width, value_dim = pool.head_dim, value.shape[-1]
    if key.shape[-1] < width:  # zero columns on both sides leave every dot product as it is
        key = F.pad(key, (0, width - key.shape[-1]))
        query = F.pad(query, (0, width - query.shape[-1]))
    if value_dim < width:
        value = F.pad(value, (0, width - value_dim))
    pool.write(layer, step.slot_mapping, key[0], value[0])
    window = step_window(step, window)
    num_heads, num_tokens = query.shape[1], query.shape[2]
    out = query.new_empty(num_tokens, num_heads, width)
    if step.num_decodes and step.decode_tables is not None:
        kernel_decodes(step, query, out, layer, scale, window or 0, softcap or 0.0, sinks)
    elif step.num_decodes:
        q_all = query[0, :, : step.num_decodes].unflatten(
            0, (pool.num_kv_heads, num_heads // pool.num_kv_heads)
        )
        for chunk in step.decode_chunks:
            featured_decode_chunk(chunk, q_all, out, pool, layer, scale, window, softcap, sinks)
    for chunk in step.prefills:
        s, n = chunk.q_start, chunk.q_len
        k, v = pool.context(layer, chunk.block_ids, chunk.ctx_len)
        mask = _prefill_mask(chunk, window)
        attn = _attend(query[:, :, s : s + n], k, v, mask, scale, softcap, sinks)
        out[s : s + n] = attn[0].transpose(0, 1)
    return out[..., :value_dim].unsqueeze(0), None


def _prefill_mask(chunk: PrefillChunk, window: int | None) -> torch.Tensor:
    if window is not None:
        return chunk.window_masks[window]
    if chunk.mask is None:
        raise RuntimeError("a prefill chunk without its causal mask")
    return chunk.mask


def _attend(
    q: torch.Tensor,  # [1, Hq, n, D]
    k: torch.Tensor,  # [1, Hkv, ctx, D]
    v: torch.Tensor,
    mask: torch.Tensor,  # [n, ctx] additive
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """A prefill chunk's attention: [1, Hq, n, D]."""
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * scale
    probs = _probs(scores, mask, softcap, None if sinks is None else sinks.view(1, -1, 1, 1))
    return torch.matmul(probs, v)


def _probs(
    scores: torch.Tensor,
    mask: torch.Tensor,
    softcap: float | None,
    sinks: torch.Tensor | None,  # broadcast to scores[..., :1]
) -> torch.Tensor:
    """Softmax over the keys, after the softcap and the mask, with a sink's logit in the
    denominator (as the models' eager attention: the sink takes part in the max too)."""
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores + mask
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    sink = sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)
    combined = torch.cat([scores, sink], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    return torch.softmax(combined, dim=-1)[..., :-1]


def featured_decode_chunk(
    chunk: DecodeChunk,
    q_all: torch.Tensor,  # [Hkv, G, B, D]
    out: torch.Tensor,  # [T, Hq, D]
    pool: KVPool,
    layer: int,
    scale: float,
    window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> None:
    n = chunk.end - chunk.start
    num_kv_heads, group = q_all.shape[:2]
    q, kv = gather_decode_chunk(chunk, q_all, pool, layer)
    mask = chunk.mask if window is None else chunk.window_masks[window]
    scores = torch.bmm(q, kv[0].transpose(1, 2)) * scale  # [Hkv * n, G, ctx]
    if sinks is not None:  # query head h * G + g: row (h, i), column g
        sinks = sinks.view(num_kv_heads, 1, group, 1).expand(-1, n, -1, -1)
        sinks = sinks.reshape(num_kv_heads * n, group, 1)
    scatter_decode_chunk(chunk, torch.bmm(_probs(scores, mask, softcap, sinks), kv[1]), out)


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
