"""What Redis spends per generated token, this tree against an earlier revision, in one run.

    python bench/redis_cost.py [--streams 1,8,64,256] [--output-tokens 128]
                               [--baseline REV] [--worker-tok-s 9872] [--model DIR]

For each of the two trees (the baseline checked out in a temporary git worktree; this tree a
second time with LLMQ_STREAM_INTERVAL_MS, --stream-interval-ms), starts a real
redis-server and one `llmq worker` of that tree, and drives it with N concurrent requests (128
random prompt tokens, --output-tokens each, ignore_eos, greedy) through that tree's own
pipeline (the API's side), for each N of --streams. Redis's commands (``total_commands_processed``,
which counts the commands a script runs too) and CPU (``used_cpu_user + used_cpu_sys``) are read
from INFO before and after each load, and Redis's idle CPU rate (its cron, the worker's polls)
over 3 s before them, which is subtracted for the net figure. Prints them per generated token,
the ratio of the net CPU, and how many
workers of --worker-tok-s output tokens per second (default: the H100 figure of docs/performance.md) one
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
IDLE_S = 3.0


def child(args: argparse.Namespace) -> None:
    """Runs inside one tree (its root first on sys.path): one worker, every load in turn."""

    from llmq.common.transport.redis_server import RedisServer
    from tests.harness import start_worker

    logs = Path(tempfile.mkdtemp(prefix="llmq-redis-cost-"))
    streams = [int(s) for s in args.streams.split(",")]
    extra = {"stream_interval_ms": args.stream_interval_ms} if args.stream_interval_ms else {}
    with RedisServer() as server:
        worker = start_worker(
            server.url,
            args.model,
            "w0",
            logs,
            max_batch_size=max(streams),
            torch_threads=1,
            **extra,
        )
        try:
            asyncio.run(_loads(server.url, args, streams))
        finally:
            worker.terminate()


async def _loads(url: str, args: argparse.Namespace, streams: list[int]) -> None:
    """Every load through one API side, as a long-running API process: its connections and
    scripts are set up by a warm-up load first, not counted against the first measured one."""
    import redis

    from llmq.common.engine_client.pipeline import TokenGeneratorPipeline
    from llmq.common.model_files import load_tokenizer
    from llmq.common.transport import AsyncTransport, Keys
    from llmq.common.transport.redis_clients import async_client

    client = async_client(url, 64)  # a blocking pool, as the API's: 256 streams share it
    transport = AsyncTransport(client, Keys())
    pipeline = TokenGeneratorPipeline(transport, load_tokenizer(args.model), args.model)
    stats = redis.Redis.from_url(url)
    try:
        await _drive(pipeline, max(streams), 2)
        cpu0, _ = _cost(stats)
        await asyncio.sleep(IDLE_S)  # Redis's own idle work (its cron, the worker's polls)
        idle = (_cost(stats)[0] - cpu0) / IDLE_S
        print(json.dumps({"idle_cpu_per_s": idle}), flush=True)
        for n in streams:
            cpu0, cmds0 = _cost(stats)
            elapsed, tokens = await _drive(pipeline, n, args.output_tokens)
            cpu1, cmds1 = _cost(stats)
            row = {"streams": n, "tokens": tokens, "seconds": elapsed}
            row |= {"commands": cmds1 - cmds0, "cpu_s": cpu1 - cpu0}
            print(json.dumps(row), flush=True)
    finally:
        await transport.close()
        await client.aclose()


def _cost(client) -> tuple[float, int]:
    cpu, stats = client.info("cpu"), client.info("stats")
    return cpu["used_cpu_sys"] + cpu["used_cpu_user"], stats["total_commands_processed"]


async def _drive(pipeline, n: int, out_tokens: int) -> tuple[float, int]:
    from llmq.common.sampling_params import SamplingParams

    rng = random.Random(n * 1000 + out_tokens)
    prompts = [[rng.randrange(3, 500) for _ in range(128)] for _ in range(n)]
    params = SamplingParams(temperature=0, max_tokens=out_tokens, ignore_eos=True)
    start = time.perf_counter()
    results = await asyncio.gather(*[pipeline.all_tokens(p, params) for p in prompts])
    return time.perf_counter() - start, sum(r.completion_tokens for r in results)


def run_tree(tree: Path, args: argparse.Namespace, interval: float = 0) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree), HF_HUB_OFFLINE="1")
    cmd = [sys.executable, str(tree / "bench" / "redis_cost.py"), "--child"]
    cmd += ["--streams", args.streams, "--output-tokens", str(args.output_tokens)]
    cmd += ["--model", args.model, "--stream-interval-ms", str(interval)]
    # The baseline tree may lack this script: run this one with the tree's code first on the
    # path (the child imports llmq from it).
    cmd[1] = str(Path(__file__).resolve())
    out = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{tree}: failed\n{out.stdout}\n{out.stderr[-3000:]}")
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    idle = next(r["idle_cpu_per_s"] for r in rows if "idle_cpu_per_s" in r)
    for r in rows:  # Redis's CPU net of what it spends idle over the same time
        r["net_cpu_s"] = r.get("cpu_s", 0) - idle * r.get("seconds", 0)
    return {r["streams"]: r for r in rows if "streams" in r} | {"idle": idle}


def _per_token(row: dict) -> tuple[float, float, float]:
    """Commands, Redis CPU (us) and Redis CPU net of its idle work (us) per generated token."""
    t = row["tokens"]
    return row["commands"] / t, 1e6 * row["cpu_s"] / t, 1e6 * row["net_cpu_s"] / t


def report(runs: dict[str, dict], worker_tok_s: float) -> None:
    names = list(runs)
    print(
        "Redis per generated token: commands | CPU us | CPU us net of idle (idle: "
        + ", ".join(f"{n} {1e3 * runs[n]['idle']:.1f} ms/s" for n in names)
        + ")"
    )
    print(f"{'streams':>7} | " + " | ".join(f"{n:>26}" for n in names) + " | net CPU ratio")
    for streams in sorted(k for k in runs[names[-1]] if k != "idle"):
        cells, nets = [], []
        for n in names:
            c, u, net = _per_token(runs[n][streams])
            cells.append(f"{c:8.3f} {u:8.2f} {net:8.2f}")
            nets.append(net)
        ratio = nets[0] / nets[1] if len(nets) > 1 and nets[1] > 0 else float("nan")
        print(f"{streams:>7} | " + " | ".join(cells) + f" | {ratio:6.1f}x")
    after = runs[names[1] if len(names) > 1 else names[0]]
    if 64 in after:
        c, u, net = _per_token(after[64])
        print(
            f"\nat 64 streams ({names[1] if len(names) > 1 else names[0]}): {c:.3f} commands, "
            f"{u:.2f} us of Redis CPU ({net:.2f} us net of idle) per token; goal <= "
            f"{GOAL_COMMANDS} and <= {GOAL_CPU_US}. One Redis core carries about "
            f"{1e6 / net:,.0f} tokens/s: {1e6 / net / worker_tok_s:.0f} workers of "
            f"{worker_tok_s:,.0f} tok/s"
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--streams", default="1,8,64,256")
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--baseline", default=DEFAULT_BASELINE)
    ap.add_argument("--worker-tok-s", type=float, default=9872.0)
    ap.add_argument("--model", help="model folder (default: a tiny random llama, built once)")
    ap.add_argument(
        "--stream-interval-ms",
        type=float,
        default=20.0,
        help="also run this tree with LLMQ_STREAM_INTERVAL_MS set so (0: not)",
    )
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return 0
    sys.path.insert(0, str(ROOT))
    if args.model is None:
        from llmq.tools.model_factory import make_model

        path = Path(tempfile.gettempdir()) / "llmq-bench-tiny-llama"
        args.model = str(path if (path / "config.json").exists() else make_model(path))
    base = Path(tempfile.mkdtemp(prefix="llmq-baseline-")) / "tree"
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(base), args.baseline],
        check=True,
    )
    runs: dict[str, dict] = {}
    try:
        print(f"baseline {args.baseline} ...", flush=True)
        runs["before"] = run_tree(base, args)
        print("this tree ...", flush=True)
        runs["after"] = run_tree(ROOT, args)
        if args.stream_interval_ms:
            print(f"this tree, LLMQ_STREAM_INTERVAL_MS={args.stream_interval_ms:g} ...")
            runs[f"after, {args.stream_interval_ms:g} ms"] = run_tree(
                ROOT, args, args.stream_interval_ms
            )
    finally:
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=False
        )
    report(runs, args.worker_tok_s)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
