"""The KV pool on the CPU: zeros, resident only where written."""

from __future__ import annotations

import torch

from llmq.worker.runner.attention.paged import KVPool

MIB = 2**20


def _rss(field: str = "VmRSS") -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field}")


def test_pool_reads_zeros_and_costs_memory_only_where_written():
    before, shared_before = _rss(), _rss("RssShmem")
    # 30 layers, 3 KV heads of 64, 2048 blocks of 16 tokens, bfloat16: 720 MiB.
    pool = KVPool(30, 3, 64, 2048, 16, torch.bfloat16, torch.device("cpu"))
    assert pool.kv.numel() * 2 == 720 * MIB
    assert _rss() - before < 32 * MIB
    assert not pool.kv[:, :, ::997].any()  # reading maps no memory of its own either
    pool.kv[:, :, : 512 * 16].fill_(1.5)  # a quarter of the blocks: 180 MiB
    grown = _rss() - before
    assert 160 * MIB < grown < 240 * MIB, grown / MIB
    # Private memory, not shared memory (which `free` would show as shared, not as used).
    assert _rss("RssShmem") - shared_before < 16 * MIB
    assert pool.kv[:, :, 512 * 16 :].abs().sum() == 0
    assert pool.k.shape == (30, 3, 2048 * 16, 64) and pool.v.shape == pool.k.shape
    pool.kv_blocks[0][5].fill_(2.0)  # the per-layer views write into the same memory
    assert pool.kv[0, 0, 5 * 16, 0] == 2.0
