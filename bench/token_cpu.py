"""Where a streamed token's CPU goes: a lone stream against `llmq up` (its embedded Redis), and
the CPU each process spent per token it streamed: the worker (the engine step and its Redis
writes), the API (`llmq up`'s own process: SSE, detokenizing, the reply listener), Redis, and
this client, beside the stream's output and ITL.

On a 2-core host the step's threads and the rest share the cores, so every millisecond the
API, Redis and the client spend on a token is one the step may wait for. Requests run one
after another through `llmq bench`'s client, as bench/compare.py drives load (c): chat,
``ignore_eos``, prompts new to the server.

    .venv/bin/python bench/token_cpu.py
    .venv/bin/python bench/token_cpu.py --requests 24 --llmq-env LLMQ_TORCH_THREADS=1
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from compare import bench_argv, llmq_env, run_bench  # noqa: E402  (bench/, beside this file)
from compare_procs import CLK, tree  # noqa: E402
from compare_server import Server, log  # noqa: E402
from engine_paths import ensure_model  # noqa: E402


def roles(root: int) -> dict[str, list[int]]:
    """The server's processes by role: api (`llmq up` itself), worker, redis."""
    found: dict[str, list[int]] = {"api": [root], "worker": [], "redis": []}
    for pid in tree(root):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "redis-server" in cmd:
            found["redis"].append(pid)
        elif " worker" in cmd:
            found["worker"].append(pid)
    return found


def cpu_ticks(root: int, procs: dict[str, list[int]]) -> dict[str, int]:
    """CPU ticks each role has used, from one read of the server's process tree."""
    now = tree(root)
    return {role: sum(now.get(p, 0) for p in pids) for role, pids in procs.items()}


def measure(server: Server, args, seed: int, requests: int) -> dict:
    """One round of lone-stream requests with `llmq bench`'s client (compare.py's, in this
    process); the CPU each role spent per output token."""
    load = {"concurrency": 1, "prompt": args.prompt, "output": args.output, "requests": requests}
    argv = bench_argv(server.base, server.model, load, f"token_cpu {seed}", seed)
    root = server.proc.pid
    procs = roles(root)
    before = cpu_ticks(root, procs)
    cpu0 = time.thread_time()  # the client runs on this thread (the sampler on its own)
    summary = run_bench(argv, progress=False)["summary"]
    tokens = summary["output_tokens"]
    after = cpu_ticks(root, procs)
    per_token = {role: (after[role] - before[role]) / CLK * 1e3 / tokens for role in procs}
    per_token["client"] = (time.thread_time() - cpu0) * 1e3 / tokens
    return {"summary": summary, "cpu_ms_per_token": per_token}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", type=Path, default=ROOT / "bench/out/models/smollm2-135m")
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--output", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--llmq-env", action="append", default=[], help="LLMQ_NAME=VALUE")
    args = ap.parse_args()
    model = ensure_model(args.model_dir)
    server = Server("llmq", model, Path("/tmp"), 300, llmq_env(args.llmq_env))
    server.start()
    try:
        measure(server, args, seed=100, requests=2)  # warm-up
        for r in range(args.rounds):
            res = measure(server, args, seed=101 + r, requests=args.requests)
            s = res["summary"]
            cpu = "  ".join(f"{k} {v:.2f}" for k, v in res["cpu_ms_per_token"].items())
            log(
                f"round {r + 1}: {s['output_tokens']} tokens, {s['output_tok_s']:.1f} tok/s, "
                f"ITL p50 {s['itl_s']['p50'] * 1e3:.1f} ms; CPU ms a token: {cpu}"
            )
    finally:
        server.stop()


if __name__ == "__main__":
    main()
