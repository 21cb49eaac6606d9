"""What Redis spends per generated token, this tree against an earlier revision, in one run.

    python bench/redis_cost.py [--streams 1,8,64,256] [--output-tokens 128]
                               [--baseline REV] [--worker-tok-s 9872] [--model DIR]

For each of the two trees (the baseline checked out in a temporary git worktree), starts a real
redis-server and one `llmq worker` of that tree, and drives it with N concurrent requests (128
random prompt tokens, --output-tokens each, ignore_eos, greedy) through that tree's own
pipeline (the API's side), for each N of --streams. Redis's commands (``total_commands_processed``,
which counts the commands a script runs too) and CPU (``used_cpu_user + used_cpu_sys``) are read
from INFO before and after each load. Prints both per generated token, the ratio, and how many
workers of --worker-tok-s output tokens per second (default: the README's H100 figure) one
Redis core feeds. The model is tiny by default: Redis's work per token depends on how many
sequences a step carries, not on the model.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_BASELINE = "b4428b2"  # the last revision that wrote and published per request a step
GOAL_COMMANDS, GOAL_CPU_US = 0.3, 4.0  # per token at 64 streams


def child(args: argparse.Namespace) -> None:
    """Runs inside one tree (its root first on sys.path): one worker, every load in turn."""
    import redis

    from llmq.common.redis_server import RedisServer
    from tests.harness import start_worker

    logs = Path(tempfile.mkdtemp(prefix="llmq-redis-cost-"))
    streams = [int(s) for s in args.streams.split(",")]
    with RedisServer() as server:
        worker = start_worker(
            server.url, args.model, "w0", logs, max_batch_size=max(streams), torch_threads=1
        )
        try:
            client = redis.Redis.from_url(server.url)
            for n in streams:
                cpu0, cmds0 = _cost(client)
                elapsed, tokens = asyncio.run(_drive(server.url, args.model, n, args.output_tokens))
                cpu1, cmds1 = _cost(client)
                row = {"streams": n, "tokens": tokens, "seconds": elapsed}
                row |= {"commands": cmds1 - cmds0, "cpu_s": cpu1 - cpu0}
                print(json.dumps(row), flush=True)
        finally:
            worker.terminate()


def _cost(client) -> tuple[float, int]:
    cpu, stats = client.info("cpu"), client.info("stats")
    return cpu["used_cpu_sys"] + cpu["used_cpu_user"], stats["total_commands_processed"]


async def _drive(url: str, model: str, n: int, out_tokens: int) -> tuple[float, int]:
    import redis.asyncio as aioredis

    from llmq.common.model_loader import load_tokenizer
    from llmq.common.pipeline import TokenGeneratorPipeline
    from llmq.common.sampling_params import SamplingParams
    from llmq.common.transport import AsyncTransport, Keys

    client = aioredis.Redis.from_url(url)
    transport = AsyncTransport(client, Keys())
    pipeline = TokenGeneratorPipeline(transport, load_tokenizer(model), model)
    rng = random.Random(n)
    prompts = [[rng.randrange(3, 500) for _ in range(128)] for _ in range(n)]
    params = SamplingParams(temperature=0, max_tokens=out_tokens, ignore_eos=True)
    start = time.perf_counter()
    results = await asyncio.gather(*[pipeline.all_tokens(p, params) for p in prompts])
    elapsed = time.perf_counter() - start
    await transport.close()
    await client.aclose()
    return elapsed, sum(r.completion_tokens for r in results)


def run_tree(tree: Path, args: argparse.Namespace) -> dict[int, dict]:
    env = dict(os.environ, PYTHONPATH=str(tree), HF_HUB_OFFLINE="1")
    cmd = [sys.executable, str(tree / "bench" / "redis_cost.py"), "--child"]
    cmd += ["--streams", args.streams, "--output-tokens", str(args.output_tokens)]
    cmd += ["--model", args.model]
    # The baseline tree may lack this script: run this one with the tree's code first on the
    # path (the child imports llmq from it).
    cmd[1] = str(Path(__file__).resolve())
    out = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{tree}: failed\n{out.stdout}\n{out.stderr[-3000:]}")
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    return {r["streams"]: r for r in rows}


def report(before: dict[int, dict], after: dict[int, dict], worker_tok_s: float) -> None:
    print(f"{'streams':>7} | {'commands/token':>22} | {'Redis CPU us/token':>22} | workers/core")
    print(
        f"{'':>7} | {'before':>7} {'after':>6} {'ratio':>7} | {'before':>7} {'after':>6} "
        f"{'ratio':>7} | before after"
    )
    for n in sorted(after):
        b, a = before[n], after[n]
        cb, ca = b["commands"] / b["tokens"], a["commands"] / a["tokens"]
        ub, ua = 1e6 * b["cpu_s"] / b["tokens"], 1e6 * a["cpu_s"] / a["tokens"]
        wb, wa = 1e6 / ub / worker_tok_s, 1e6 / ua / worker_tok_s
        print(
            f"{n:>7} | {cb:7.2f} {ca:6.3f} {cb / ca:6.1f}x | {ub:7.1f} {ua:6.2f} "
            f"{ub / ua:6.1f}x | {wb:6.1f} {wa:5.1f}"
        )
    if 64 in after:
        a = after[64]
        cmds, cpu = a["commands"] / a["tokens"], 1e6 * a["cpu_s"] / a["tokens"]
        print(
            f"\nat 64 streams: {cmds:.3f} commands and {cpu:.2f} us of Redis CPU per token "
            f"(goal: <= {GOAL_COMMANDS} and <= {GOAL_CPU_US}); one Redis core carries about "
            f"{1e6 / cpu:,.0f} tokens/s"
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--streams", default="1,8,64,256")
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--baseline", default=DEFAULT_BASELINE)
    ap.add_argument("--worker-tok-s", type=float, default=9872.0)
    ap.add_argument("--model", help="model folder (default: a tiny random llama, built once)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return 0
    sys.path.insert(0, str(ROOT))
    if args.model is None:
        from llmq.common.model_factory import make_model

        path = Path(tempfile.gettempdir()) / "llmq-bench-tiny-llama"
        args.model = str(path if (path / "config.json").exists() else make_model(path))
    base = Path(tempfile.mkdtemp(prefix="llmq-baseline-")) / "tree"
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(base), args.baseline],
        check=True,
    )
    try:
        print(f"baseline {args.baseline} ...", flush=True)
        before = run_tree(base, args)
        print("this tree ...", flush=True)
        after = run_tree(ROOT, args)
    finally:
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=False
        )
    report(before, after, args.worker_tok_s)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
