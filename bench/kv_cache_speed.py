"""The 8-bit KV cache's speed beside the model-dtype cache, on the same machine in one run.

1. The decode attention kernel alone (``paged_decode_attention`` against ``_q8``): one layer of
   the SmolLM2-135M shape (9 query heads, 3 KV heads of 64), bfloat16 queries, per batch and
   context; microseconds a call, the median of ``--repeats``.
2. The engine's decode: ``--batch`` sequences of ``--prompt`` random tokens, each generating
   ``--tokens``, through LLMEngine on a random-weight model of ``--size`` in bfloat16, per
   LLMQ_KV_CACHE_DTYPE; output tokens a second once every prompt is in (the fused C++ step
   serves the auto cache; an 8-bit one takes the per-layer loop).

    .venv/bin/python bench/kv_cache_speed.py
    .venv/bin/python bench/kv_cache_speed.py --skip-engine --repeats 300
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from llmq.common.sampling_params import SamplingParams  # noqa: E402
from llmq.tools.model_factory import make_model  # noqa: E402
from llmq.worker.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from llmq.worker.loading.model_loader import load_causal_lm  # noqa: E402
from llmq.worker.runner import cpu_kernels  # noqa: E402
from llmq.worker.runner.attention.kv_quant import code_dtype, quantize  # noqa: E402

OUT = ROOT / "bench" / "out"
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def kernel_us(batch: int, context: int, cache: str, repeats: int) -> float:
    g = torch.Generator().manual_seed(0)
    blocks = batch * (-(-context // BLOCK))
    kv = torch.randn(2 * KV_HEADS, blocks * BLOCK, HEAD_DIM, generator=g).to(torch.bfloat16)
    tables = torch.randperm(blocks, generator=g).view(batch, -1).to(torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32)
    query = torch.randn(batch, HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)
    out = torch.empty_like(query)
    codes = code_dtype(cache)
    if codes is None:

        def call():
            torch.ops.llmq.paged_decode_attention(out, query, kv, tables, lens, BLOCK, 0.125)
    else:
        q, scales = quantize(kv, codes)
        q = q.view(codes)

        def call():
            torch.ops.llmq.paged_decode_attention_q8(
                out, query, q, scales, tables, lens, BLOCK, 0.125
            )

    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def engine_tokens_per_s(model_dir: str, cache: str, args) -> float:
    model = load_causal_lm(model_dir, "bfloat16", "cpu")
    config = EngineConfig(max_batch_size=args.batch, kv_cache_dtype=cache)
    engine = LLMEngine(model, config)
    rng = random.Random(0)
    vocab = model.config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(str(i), [rng.randrange(3, vocab) for _ in range(args.prompt)], params)
    generated, start = 0, None
    while engine.has_unfinished():
        outs = engine.step()
        if start is None and all(
            s.num_computed_tokens >= args.prompt for s in engine.requests.values()
        ):
            start, generated = time.perf_counter(), 0
        generated += sum(len(o.token_ids) for o in outs)
    return generated / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--caches", default="auto,int8,fp8")
    p.add_argument("--repeats", type=int, default=100)
    p.add_argument("--size", default="smollm2-135m")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--skip-engine", action="store_true")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: least noise)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    caches = args.caches.split(",")
    assert cpu_kernels.load(), "the C++ kernels did not build"
    print(f"torch threads {torch.get_num_threads()}")
    print("| batch | context | " + " | ".join(f"{c} us" for c in caches) + " |")
    print("| --- | --- | " + " | ".join("---" for _ in caches) + " |")
    for batch, context in [(1, 256), (1, 2048), (16, 256), (64, 256), (16, 1024)]:
        row = [f"{kernel_us(batch, context, c, args.repeats):.1f}" for c in caches]
        print(f"| {batch} | {context} | " + " | ".join(row) + " |", flush=True)
    if args.skip_engine:
        return
    path = OUT / "models" / args.size
    if not (path / "config.json").exists():
        make_model(path, arch="llama", size=args.size)
    for cache in caches:
        rate = engine_tokens_per_s(str(path), cache, args)
        print(
            f"engine, {args.size} bf16, batch {args.batch}, {cache}: {rate:.1f} tok/s", flush=True
        )


if __name__ == "__main__":
    main()
