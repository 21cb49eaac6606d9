"""Decode-only CPU steps through a decoder layer compiled by torch.compile (Inductor's C++/OpenMP
backend): the CPU counterpart of the CUDA graphs.

Compiled, the elementwise ops of a layer (norms, rotary embedding, residuals, SiLU and product)
fuse into a few C++ loops; the projections stay the lean forward's own (packed oneDNN weights,
behind the ``llmq::linear`` op) and so does the paged attention (``llmq::decode_attention``).
On 2 cores (bfloat16, SmolLM2-135M shape, context 256) a batch-1 step measured 63% projections
(weights streamed from memory), 11% attention, 26% other ops and Python; compiled steps ran at
0.94-1.01x the eager ones at batch 1, 32 and 64 (``bench/cpu_compile.py``): what fusion saves,
entering the compiled layer 30 times a step (guards, wrappers) spends again. Hence off by
default (``Settings.cpu_compile``).

One layer is compiled, not the whole model: the layers share their code, so one graph serves
them all (the whole 30-layer model compiled measured 190 s per graph on 2 cores, most of it
compiling C++ for every layer's kernels apart). Two graphs cover every decode step: one for a
lone sequence (a batch of one is a special shape to the compiler) and one for any batch of two
or more, the batch and the context dynamic. Both are compiled ahead of serving (``warm_up``); a
shape they do not cover afterwards runs eagerly rather than stall the engine for a compile.
Block tables are padded to at least two blocks (block 0, masked), so a one-block context is no
special shape either.
"""

from __future__ import annotations

import logging
import time

import torch

from llmq.worker.runner.attention.paged import KVPool, attend_gathered
from llmq.worker.runner.forward.decoder_forward import DecoderForward, DecoderLayer

log = logging.getLogger(__name__)

MIN_BLOCKS = 2  # block tables padded to this: a size-1 dimension would be compiled apart

# The attention as one opaque op (eager kernels): traced, its KV writes into a view of the pool
# made the graph write a fresh copy of the layer's whole cache back each call (8x slower than
# eager), and its gathered keys were copied element by element (dynamic shapes hide that the
# gather's reshape is a view): 1.4x slower than eager at batch 32.
_LIB = torch.library.Library("llmq", "FRAGMENT")
_LIB.define(
    "decode_attention(Tensor query, Tensor key, Tensor value, Tensor(a!) cache, Tensor slots, "
    "Tensor ids, Tensor mask, int block_size, float scale) -> Tensor"
)


def _decode_attention(
    query: torch.Tensor,  # [Hq, B, D]
    key: torch.Tensor,  # [Hkv, B, D]
    value: torch.Tensor,
    cache: torch.Tensor,  # the layer's [2 * Hkv, slots, D] in the pool
    slots: torch.Tensor,  # [B]
    ids: torch.Tensor,  # the rows of every head's blocks in the cache's [-1, block] view
    mask: torch.Tensor,  # [Hkv * B, 1, ctx]
    block_size: int,
    scale: float,
) -> torch.Tensor:
    hq, b, d = query.shape
    hkv = key.shape[0]
    cache[:hkv].index_copy_(1, slots, key)
    cache[hkv:].index_copy_(1, slots, value)
    q = query.unflatten(0, (hkv, hq // hkv)).transpose(1, 2).reshape(hkv * b, hq // hkv, d)
    kv = cache.view(-1, block_size * d).index_select(0, ids).view(2, hkv * b, -1, d)
    attn = attend_gathered(q, kv, mask, scale)  # [Hkv * B, G, D]
    return attn.view(hkv, b, hq // hkv, d).transpose(0, 1).reshape(b, hq, d)


def _decode_attention_shape(query, key, value, cache, slots, ids, mask, block_size, scale):
    hq, b, d = query.shape
    return query.new_empty(b, hq, d)


_LIB.impl("decode_attention", _decode_attention, "CPU")
torch.library.register_fake("llmq::decode_attention", _decode_attention_shape, lib=_LIB)


class CompiledDecode:
    def __init__(self, forward: DecoderForward, pool: KVPool):
        self.forward = forward
        self.pool = pool
        self.compiled = torch.compile(self._layer, fullgraph=True)
        self.warm = False
        self.warm_up_s = 0.0
        self.steps = 0  # decode steps run through the compiled layer

    def warm_up(self) -> float:
        """Compile both graphs on dummy steps (their KV lands in block 0, which no sequence
        holds yet). Returns the seconds it took."""
        start = time.perf_counter()
        ctx = MIN_BLOCKS * self.pool.block_size
        for batch in (1, 2):
            tables = [[0] * MIN_BLOCKS] * batch
            self.run([0] * batch, [ctx - 1] * batch, list(range(batch)), tables)
        self.warm = True
        self.steps = 0
        self.warm_up_s = time.perf_counter() - start
        log.info("compiled the CPU decode step in %.1f s", self.warm_up_s)
        return self.warm_up_s

    def run(
        self,
        input_ids: list[int],
        positions: list[int],
        slots: list[int],
        tables: list[list[int]],
    ) -> torch.Tensor:
        """Logits [batch, vocab] of one decode step (row i: the token at ``positions[i]``,
        whose KV goes to ``slots[i]``; ``tables[i]``: its sequence's block table)."""
        self.steps += 1
        pool = self.pool
        b, bs = len(input_ids), pool.block_size
        context = [p + 1 for p in positions]
        m = max(MIN_BLOCKS, -(-max(context) // bs))
        flat: list[int] = []
        for table, ctx in zip(tables, context, strict=True):
            own = -(-ctx // bs)
            flat.extend(table[:own])
            flat.extend([0] * (m - own))
        host = torch.tensor([*input_ids, *positions, *slots, *context, *flat], dtype=torch.long)
        ids, pos, slot, ctx_t = host[: 4 * b].view(4, b)
        rows = (pool.head_offsets + host[4 * b :]).view(-1)  # every head's blocks, in turn
        hidden = torch.arange(m * bs)[None, :] >= ctx_t[:, None]
        mask = torch.zeros(hidden.shape, dtype=pool.kv.dtype).masked_fill_(hidden, float("-inf"))
        mask = mask.repeat(pool.num_kv_heads, 1).unsqueeze(1)  # [Hkv * B, 1, ctx]
        forward = self.forward
        h, cos, sin = forward.embed(ids, pos)
        if not self.warm:
            for t in (h, cos, sin, slot, rows, mask) if b > 1 else ():
                torch._dynamo.mark_dynamic(t, 0)
            torch._dynamo.mark_dynamic(rows, 0)
            torch._dynamo.mark_dynamic(mask, 2)
        # After the warm-up, a shape the graphs do not cover runs eagerly, not compiled.
        with torch.compiler.set_stance("eager_on_recompile" if self.warm else "default"):
            for layer in forward.layers:
                cache = pool.kv[layer.module.layer_idx]
                h = self.compiled(h, cos, sin, layer, cache, slot, rows, mask)
        return forward.head(h, None)

    def _layer(
        self,
        h: torch.Tensor,  # [B, hidden]
        cos: torch.Tensor,  # [B, 1, head_dim]
        sin: torch.Tensor,
        layer: DecoderLayer,
        cache: torch.Tensor,  # the layer's [2 * kv_heads, slots, head_dim] in the pool
        slots: torch.Tensor,  # [B]
        rows: torch.Tensor,  # the rows of every head's blocks in the cache's [-1, block] view
        mask: torch.Tensor,  # [Hkv * B, 1, ctx]
    ) -> torch.Tensor:
        bs = self.pool.block_size

        def attend(layer: DecoderLayer, query, key, value) -> torch.Tensor:
            return torch.ops.llmq.decode_attention(
                query[0], key[0], value[0], cache, slots, rows, mask, bs, layer.scaling
            )

        return self.forward.layer(h, cos, sin, layer, attend)
