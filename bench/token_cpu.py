"""Where a streamed token's CPU goes: a lone stream against `llmq up` (its embedded Redis), and
the CPU each process spent per token it streamed: the worker (the engine step and its Redis
writes), the API (`llmq up`'s own process: SSE, detokenizing, the reply listener), Redis, and
this client (the openai SDK reading the stream), beside the stream's ITL.

On a 2-core host the step's threads and the rest share the cores, so every millisecond the
API, Redis and the client spend on a token is one the step may wait for. Requests run one
after another (chat, ``ignore_eos``, prompts new to the server).

    .venv/bin/python bench/token_cpu.py
    .venv/bin/python bench/token_cpu.py --requests 24 --llmq-env LLMQ_TORCH_THREADS=1
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from compare import llmq_env  # noqa: E402  (bench/, beside this file)
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


def ticks(pids: list[int]) -> int:
    now = tree_ticks()
    return sum(now.get(p, 0) for p in pids)


def tree_ticks() -> dict[int, int]:
    out = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                rest = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            out[int(d.name)] = int(rest[11]) + int(rest[12])
    return out


def stream_one(client, model: str, prompt: str, output: int) -> list[float]:
    """One streamed chat completion; the arrival time of each content chunk."""
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=output,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    arrivals = []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.append(time.perf_counter())
    return arrivals


def measure(server: Server, args, seed: int) -> dict:
    import openai

    client = openai.OpenAI(base_url=f"{server.base}/v1", api_key="x", max_retries=0)
    rng = random.Random(seed)
    prompts = [
        " ".join(str(rng.randrange(10**6)) for _ in range(args.prompt_words))
        for _ in range(args.requests)
    ]
    procs = roles(server.proc.pid)
    before = {role: ticks(pids) for role, pids in procs.items()}
    cpu0, wall0 = time.process_time(), time.perf_counter()
    gaps, chunks = [], 0
    for p in prompts:
        arrivals = stream_one(client, str(server.model), p, args.output)
        chunks += len(arrivals)
        gaps += [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    wall = time.perf_counter() - wall0
    per_token = {
        role: (ticks(pids) - before[role]) / CLK * 1e3 / chunks for role, pids in procs.items()
    }
    per_token["client"] = (time.process_time() - cpu0) * 1e3 / chunks
    return {
        "chunks": chunks,
        "tok_s": chunks / wall,
        "itl_p50_ms": statistics.median(gaps) * 1e3,
        "itl_mean_ms": statistics.fmean(gaps) * 1e3,
        "cpu_ms_per_token": per_token,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", type=Path, default=ROOT / "bench/out/models/smollm2-135m")
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--output", type=int, default=64)
    ap.add_argument("--prompt-words", type=int, default=40, help="random numbers in a prompt")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--llmq-env", action="append", default=[], help="LLMQ_NAME=VALUE")
    args = ap.parse_args()
    model = ensure_model(args.model_dir)
    server = Server("llmq", model, Path("/tmp"), 300, llmq_env(args.llmq_env))
    server.start()
    try:
        measure(server, argparse.Namespace(**{**vars(args), "requests": 2}), seed=0)  # warm-up
        for r in range(args.rounds):
            res = measure(server, args, seed=r + 1)
            cpu = "  ".join(f"{k} {v:.2f}" for k, v in res["cpu_ms_per_token"].items())
            log(
                f"round {r + 1}: {res['chunks']} tokens, {res['tok_s']:.1f} tok/s, ITL p50 "
                f"{res['itl_p50_ms']:.1f} ms (mean {res['itl_mean_ms']:.1f}); CPU ms a token: "
                f"{cpu}"
            )
    finally:
        server.stop()


if __name__ == "__main__":
    main()
