"""The paged attention for layers that ask more than softmax(q k^T * scale) v over causal keys.

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

import torch
import torch.nn.functional as F

from llmq.worker.runner.attention import (
    DecodeChunk,
    KVPool,
    PrefillChunk,
    StepMetadata,
    gather_decode_chunk,
    kernel_decodes,
    scatter_decode_chunk,
)


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
            _decode_chunk(chunk, q_all, out, pool, layer, scale, window, softcap, sinks)
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


def _decode_chunk(
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
