"""One worker against two, side by side in one run, and what Redis spends per token.

    python bench/scaleout.py [--model DIR] [--requests 64] [--output-tokens 256]

Starts a real redis-server, then one `llmq worker` (LLMQ_TORCH_THREADS=1) and drives it with
--requests concurrent requests (short prompts, --output-tokens each, ignore_eos) through the
pipeline; then the same with two workers. Prints requests/s, output tok/s, the ratio, and
Redis's own CPU time and commands per generated token (from INFO), from which docs/performance.md
estimates how many workers one Redis can feed. Before that it measures how far the machine
itself scales two CPU-bound processes (a matmul loop alone, then two at once), the ceiling the
two workers' ratio is read against.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis
import redis.asyncio as aioredis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llmq.common.engine_client.pipeline import TokenGeneratorPipeline  # noqa: E402
from llmq.common.model_files import load_tokenizer
from llmq.common.sampling_params import SamplingParams  # noqa: E402
from llmq.common.transport import AsyncTransport, Keys  # noqa: E402
from llmq.common.transport.redis_server import RedisServer  # noqa: E402
from llmq.worker.loading.model_loader import resolve_dtype  # noqa: E402
from tests.harness import start_worker  # noqa: E402


def redis_cost(client: redis.Redis) -> tuple[float, int]:
    cpu = client.info("cpu")
    stats = client.info("stats")
    return cpu["used_cpu_sys"] + cpu["used_cpu_user"], stats["total_commands_processed"]


async def drive(url: str, model: str, n: int, out_tokens: int) -> tuple[float, int]:
    client = aioredis.Redis.from_url(url)
    transport = AsyncTransport(client, Keys())
    pipeline = TokenGeneratorPipeline(transport, load_tokenizer(model), model)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 1000) for _ in range(rng.randint(4, 16))] for _ in range(n)]
    params = SamplingParams(temperature=0, max_tokens=out_tokens, ignore_eos=True)
    # Warm up each engine's first steps outside the timed run.
    await asyncio.gather(
        *[
            pipeline.all_tokens(p, SamplingParams(max_tokens=4, ignore_eos=True))
            for p in prompts[:4]
        ]
    )
    start = time.perf_counter()
    results = await asyncio.gather(*[pipeline.all_tokens(p, params) for p in prompts])
    elapsed = time.perf_counter() - start
    await transport.close()
    await client.aclose()
    return elapsed, sum(r.completion_tokens for r in results)


def process_cpu(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# One process's matmul loop: one torch thread, the decode-shaped matmul of a worker's MLP.
_MATMUL_LOOP = """
import sys, time, torch
torch.set_num_threads(1)
x, w = torch.randn(64, 576), torch.randn(3072, 576)
for _ in range(10):
    x @ w.T
n, start = 0, time.perf_counter()
while time.perf_counter() - start < float(sys.argv[1]):
    x @ w.T
    n += 1
print(n / (time.perf_counter() - start))
"""


def machine_ceiling(seconds: float = 3.0, rounds: int = 3) -> dict:
    """How far this machine itself scales two independent CPU-bound processes: a one-thread
    matmul loop alone, then two at once, alternating for ``rounds`` rounds (medians: a shared
    host's load drifts). Where the cores are SMT siblings or shared with the host, two
    processes make far less than twice one, whatever the program."""

    def loops(copies: int) -> list[float]:
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", _MATMUL_LOOP, str(seconds)], stdout=subprocess.PIPE
            )
            for _ in range(copies)
        ]
        return [float(p.communicate()[0]) for p in procs]

    alone, together = [], []
    for _ in range(rounds):
        alone.append(loops(1)[0])
        together.append(sum(loops(2)))
    ratio = statistics.median(together) / statistics.median(alone)
    return {"alone_per_s": alone, "together_per_s": together, "ratio": ratio}


def run(model: str, workers: int, n: int, out_tokens: int, dtype: str, logs: Path) -> dict:
    with RedisServer() as server:
        procs = [
            start_worker(
                server.url, model, f"w{i}", logs, torch_threads=1, max_batch_size=n, dtype=dtype
            )
            for i in range(workers)
        ]
        try:
            client = redis.Redis.from_url(server.url)
            cpu0, cmds0 = redis_cost(client)
            workers_cpu0 = sum(process_cpu(p.proc.pid) for p in procs)
            elapsed, tokens = asyncio.run(drive(server.url, model, n, out_tokens))
            workers_cpu = sum(process_cpu(p.proc.pid) for p in procs) - workers_cpu0
            cpu1, cmds1 = redis_cost(client)
        finally:
            for p in procs:
                p.terminate()
    return {
        "workers": workers,
        "requests_per_s": n / elapsed,
        "output_tok_per_s": tokens / elapsed,
        "seconds": elapsed,
        "worker_cores": workers_cpu / elapsed,
        "tokens": tokens,
        "redis_cpu_s": cpu1 - cpu0,
        "redis_commands": cmds1 - cmds0,
        "redis_cpu_us_per_token": 1e6 * (cpu1 - cpu0) / tokens,
        "redis_commands_per_token": (cmds1 - cmds0) / tokens,
    }


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--model",
        help="model folder (default: the SmolLM2-135M-shaped random model, built if missing; "
        "on the tiny test model the client, not the engines, is the bottleneck)",
    )
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--output-tokens", type=int, default=256)
    ap.add_argument(
        "--dtype",
        default="auto",
        help="the workers' LLMQ_DTYPE (auto: bfloat16 where the CPU has it in hardware, else "
        "float32)",
    )
    ap.add_argument("--json", default="bench/out/scaleout.json")
    args = ap.parse_args()
    model = args.model
    if model is None:
        from llmq.tools.model_factory import make_model

        model = "bench/out/models/smollm2-135m"
        if not (Path(model) / "config.json").exists():
            make_model(model, "llama", "smollm2-135m")
    logs = Path(tempfile.mkdtemp(prefix="llmq-scaleout-"))
    dtype = str(resolve_dtype(args.dtype, "cpu")).removeprefix("torch.")
    print(
        f"model {model} ({dtype}), {args.requests} concurrent requests, "
        f"{args.output_tokens} output tokens each, one torch thread per worker"
    )
    ceiling = machine_ceiling()
    one = run(model, 1, args.requests, args.output_tokens, args.dtype, logs)
    two = run(model, 2, args.requests, args.output_tokens, args.dtype, logs)
    print(
        f"{'workers':>8} {'req/s':>8} {'tok/s':>9} {'worker cores':>13} "
        f"{'redis cpu us/tok':>17} {'redis cmds/tok':>15}"
    )
    for r in (one, two):
        print(
            f"{r['workers']:>8} {r['requests_per_s']:>8.2f} {r['output_tok_per_s']:>9.1f} "
            f"{r['worker_cores']:>13.2f} "
            f"{r['redis_cpu_us_per_token']:>17.1f} {r['redis_commands_per_token']:>15.2f}"
        )
    ratio = two["output_tok_per_s"] / one["output_tok_per_s"]
    print(f"two workers / one: {ratio:.2f}x output tok/s (target >= 1.7x)")
    print(
        f"this machine, two one-thread matmul loops against one: {ceiling['ratio']:.2f}x "
        f"(what two independent processes make here); two workers reach "
        f"{ratio / ceiling['ratio']:.0%} of it"
    )
    us = two["redis_cpu_us_per_token"]
    print(
        f"one Redis core at {us:.1f} us per token carries about {1e6 / us:,.0f} tokens/s: "
        f"{1e6 / us / one['output_tok_per_s']:,.0f} workers at one worker's rate here"
    )
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(
        json.dumps({"one": one, "two": two, "ratio": ratio, "machine": ceiling}, indent=2)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
