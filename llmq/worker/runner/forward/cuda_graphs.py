"""CUDA graphs of decode-only steps.

On a GPU a small or mid-sized model's decode step is bound by kernel launches, not arithmetic:
the lean forward still issues a few hundred kernels per step, each queued from Python
(docs/performance.md, "On a GPU"). A decode-only step has
the same shapes from one step to the next once its batch and its longest context are rounded up
to buckets, so each (batch, blocks) bucket is captured once, on first use, and replayed after:
one launch per step.

Padding: rows past the real batch decode token 0 into a scratch KV block that no sequence owns;
block-table entries past a sequence's own blocks point at that block too, and the mask hides
every slot at or past a sequence's context (built inside the graph from the context lengths).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from llmq.worker.runner.attention.paged import DecodeChunk, KVPool, StepMetadata
from llmq.worker.runner.forward.decoder_forward import DecoderForward

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
# Longest context a graph covers; longer decodes run eagerly. Bounds the gather buffer the
# graphs share: 2 * kv_heads * batch * context * head_dim elements.
MAX_GRAPH_CONTEXT = 4096


def _bucket(n: int, buckets: list[int]) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} is past the largest bucket {buckets[-1]}")


@dataclass(slots=True)
class _Captured:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # static output, [batch bucket, vocab]


class DecodeGraphs:
    def __init__(
        self,
        forward: DecoderForward,
        pool: KVPool,
        scratch_block: int,
        max_batch: int,
        max_len: int,
    ):
        self.forward = forward
        self.pool = pool
        self.scratch_block = scratch_block
        bs = pool.block_size
        self.batch_buckets = [b for b in BATCH_BUCKETS if b < max_batch] + [max_batch]
        max_blocks = -(-min(max_len, MAX_GRAPH_CONTEXT) // bs)
        blocks = [1]
        while blocks[-1] < max_blocks:
            blocks.append(min(2 * blocks[-1], max_blocks))
        self.block_buckets = blocks
        dev = pool.kv.device
        n, m = max_batch, max_blocks
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slots = torch.zeros(n, dtype=torch.long, device=dev)
        self.context = torch.zeros(n, dtype=torch.long, device=dev)
        self.block_ids = torch.zeros(n * m, dtype=torch.long, device=dev)
        self.keep = torch.arange(n, device=dev)
        self.slot_index = torch.arange(m * bs, device=dev)
        # The graphs read and write the gather buffer they were captured with: grown to its
        # largest here, and held, so a later eager step that grows the pool's buffer cannot free
        # it under them.
        self.gather = pool.gather_buffer(n * m)
        self.mempool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, int], _Captured] = {}
        self.steps = 0  # decode steps run through a graph

    def fits(self, batch: int, blocks: int) -> bool:
        return batch <= self.batch_buckets[-1] and blocks <= self.block_buckets[-1]

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
        b = len(input_ids)
        bs = self.pool.block_size
        context = [p + 1 for p in positions]
        bp = _bucket(b, self.batch_buckets)
        mp = _bucket(-(-max(context) // bs), self.block_buckets)
        pad = bp - b
        scratch = self.scratch_block
        flat: list[int] = []
        for table, ctx in zip(tables, context, strict=True):
            own = -(-ctx // bs)
            flat.extend(table[:own])
            flat.extend([scratch] * (mp - own))
        flat.extend([scratch] * (pad * mp))
        host = torch.tensor(
            [
                *input_ids,
                *([0] * pad),
                *positions,
                *([0] * pad),
                *slots,
                *([scratch * bs] * pad),
                *context,
                *([mp * bs] * pad),
                *flat,
            ],
            dtype=torch.long,
        ).pin_memory()
        dev = host.to(self.input_ids.device, non_blocking=True)
        self.input_ids[:bp].copy_(dev[:bp])
        self.positions[:bp].copy_(dev[bp : 2 * bp])
        self.slots[:bp].copy_(dev[2 * bp : 3 * bp])
        self.context[:bp].copy_(dev[3 * bp : 4 * bp])
        self.block_ids[: bp * mp].copy_(dev[4 * bp :])
        captured = self.graphs.get((bp, mp))
        if captured is None:
            captured = self._capture(bp, mp)
        else:
            captured.graph.replay()
        return captured.logits[:b].clone()

    def _step(self, bp: int, mp: int) -> torch.Tensor:
        pool = self.pool
        ctx = mp * pool.block_size
        hidden = self.slot_index[:ctx][None, :] >= self.context[:bp, None]
        mask = torch.zeros(hidden.shape, dtype=pool.kv.dtype, device=hidden.device)
        mask.masked_fill_(hidden, float("-inf"))
        mask = mask.repeat(pool.num_kv_heads, 1).unsqueeze(1)  # [Hkv * bp, 1, ctx]
        meta = StepMetadata(
            pool=pool,
            slot_mapping=self.slots[:bp],
            num_decodes=bp,
            decode_chunks=[DecodeChunk(0, bp, mp, self.block_ids[: bp * mp], mask)],
            prefills=[],
        )
        return self.forward(self.input_ids[:bp], self.positions[:bp], self.keep[:bp], meta)

    def _capture(self, bp: int, mp: int) -> _Captured:
        """Capture the (bp, mp) graph. The warm-up run on a side stream computes this step for
        real (its KV writes are the step's own), so the first use needs no replay."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            warm = self._step(bp, mp)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.mempool):
            logits = self._step(bp, mp)
        logits.copy_(warm)
        captured = _Captured(graph, logits)
        self.graphs[(bp, mp)] = captured
        log.info("captured the decode graph for batch %d, %d blocks", bp, mp)
        return captured
