"""Cache-aware placement against plain pull, side by side in one run, through the real API.

    python bench/routing.py [--model DIR] [--workers 1,2,3,4] [--scale 1.0] [--rounds 1]
                            [--output-tokens 32] [--load-weights 1.0,0.25]
                            [--workloads shared,multiturn,skewed]

Starts a redis-server, then for each worker count N: N `llmq worker` processes
(LLMQ_TORCH_THREADS=1, started side by side) and `llmq api` processes on them: one with
placement on per --load-weights value (its LLMQ_PLACEMENT_LOAD_WEIGHT) and one with it off
(LLMQ_PLACEMENT=false: entries carry no target, whichever worker reads one takes it). Each round
runs every workload through each API, alternating which goes first, each time with fresh random
prompts (so no run finds another's prefixes cached).
Workloads (token-id prompts through /v1/completions, streamed, greedy, ignore_eos):

- shared: 16 groups, each a 1,024-token system prompt shared by 8 requests with 128-token
  questions (SGLang's generated-shared-prefix), 32 requests in flight;
- multiturn: 32 sessions of 4 turns, each turn the whole history (the turns before, each
  followed by --output-tokens tokens standing for the reply) plus a new 64-token message;
  turns of a session one after another, sessions concurrent;
- skewed: 64 requests of 1,024 + 128 tokens, half of them on one prefix, the others each on
  its own, 32 in flight.

--scale multiplies the request counts (groups, sessions, requests) for a short run.
Reported per workload, N and mode: the share of prompt tokens served from cache (summed from
the workers' heartbeats) and that share over the one-worker share, TTFT p50/p99, output tok/s,
each worker's share of the requests, and the peak RSS of the processes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llmq.common.transport.redis_server import RedisServer  # noqa: E402
from tests.harness import Proc, heartbeat, start_api, start_worker, wait_for  # noqa: E402

SETTINGS = dict(torch_threads=1, inactivity_timeout=300, request_timeout=3600)


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def peak_rss_mib(procs: list[Proc]) -> float:
    total = 0
    for p in procs:
        for line in Path(f"/proc/{p.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM"):
                total += int(line.split()[1])
    return round(total / 1024, 1)


class Workloads:
    def __init__(self, vocab: int, scale: float, out_tokens: int, seed: int):
        self.rng = random.Random(seed)
        self.vocab, self.scale, self.out = vocab, scale, out_tokens

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(3, self.vocab) for _ in range(n)]

    def count(self, n: int) -> int:
        return max(1, round(n * self.scale))

    def shared(self) -> list[list[int]]:
        prompts = []
        for _ in range(self.count(16)):
            system = self.tokens(1024)
            prompts += [system + self.tokens(128) for _ in range(8)]
        self.rng.shuffle(prompts)
        return prompts

    def skewed(self) -> list[list[int]]:
        n = self.count(64)
        hot = self.tokens(1024)
        prompts = [hot + self.tokens(128) for _ in range(n // 2)]
        prompts += [self.tokens(1152) for _ in range(n - n // 2)]
        self.rng.shuffle(prompts)
        return prompts

    def sessions(self) -> list[list[list[int]]]:
        """Per session, its turns' new messages; the history grows as they run."""
        return [[self.tokens(64) for _ in range(4)] for _ in range(self.count(32))]


async def one(http: httpx.AsyncClient, base: str, prompt: list[int], out: int) -> tuple:
    body = {
        "prompt": [prompt],
        "max_tokens": out,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    start = time.perf_counter()
    ttft, tokens = None, 0
    async with http.stream("POST", f"{base}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if ttft is None and json.loads(line[6:]).get("choices"):
                ttft = time.perf_counter() - start
            tokens += 1
    return ttft or 0.0, out, len(prompt)


async def run_prompts(base: str, prompts: list[list[int]], out: int, concurrency: int) -> list:
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=None) as http:

        async def bounded(p):
            async with limit:
                return await one(http, base, p, out)

        return await asyncio.gather(*(bounded(p) for p in prompts))


async def run_sessions(base: str, sessions: list[list[list[int]]], out: int, rng) -> list:
    async with httpx.AsyncClient(timeout=None) as http:

        async def session(turns):
            history, results = [], []
            for message in turns:
                history += message
                results.append(await one(http, base, list(history), out))
                history += [rng.randrange(3, 100) for _ in range(out)]  # stands for the reply
            return results

        done = await asyncio.gather(*(session(t) for t in sessions))
    return [r for s in done for r in s]


def counters(url: str, workers: list[str]) -> dict[str, tuple[int, int, int]]:
    out = {}
    for w in workers:
        hb = heartbeat(url, w)
        out[w] = tuple(
            int(hb.get(f, 0) or 0)
            for f in ("prompt_tokens_cached", "prompt_tokens_computed", "requests_total")
        )
    return out


def settled(url: str, workers: list[str], before: dict, prompt_tokens: int) -> dict:
    """The workers' counters once their heartbeats count every prompt token of the run (they
    count a request's when it finishes, and are written once a second)."""

    def done():
        now = counters(url, workers)
        counted = sum(now[w][k] - before[w][k] for w in workers for k in (0, 1))
        return now if counted >= prompt_tokens else None

    return wait_for(done, 30, "the heartbeats to count the run", 0.2)


def run_workload(name: str, base: str, url: str, workers: list[str], load: Workloads) -> dict:
    before = counters(url, workers)
    start = time.perf_counter()
    if name == "multiturn":
        results = asyncio.run(run_sessions(base, load.sessions(), load.out, load.rng))
    else:
        prompts = load.shared() if name == "shared" else load.skewed()
        results = asyncio.run(run_prompts(base, prompts, load.out, 32))
    elapsed = time.perf_counter() - start
    after = settled(url, workers, before, sum(r[2] for r in results))
    cached = sum(after[w][0] - before[w][0] for w in workers)
    computed = sum(after[w][1] - before[w][1] for w in workers)
    ttfts = sorted(r[0] for r in results)
    shares = [round((after[w][2] - before[w][2]) / len(results), 3) for w in workers]
    return {
        "cache_share": round(cached / max(cached + computed, 1), 3),
        "ttft_p50": round(statistics.median(ttfts), 3),
        "ttft_p99": round(ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))], 3),
        "out_tok_s": round(sum(r[1] for r in results) / elapsed, 1),
        "request_shares": shares,
    }


def wait_up(server: RedisServer, name: str, proc: Proc) -> None:
    """Until worker ``name`` beats; its log shown where it exits or does not come up."""

    def up():
        if not proc.alive():
            raise RuntimeError(f"worker {name} exited:\n{proc.log()}")
        return heartbeat(server.url, name)

    try:
        wait_for(up, 120, name)
    except TimeoutError:
        print(proc.log(), file=sys.stderr)
        raise


def bench_fleet(args, server: RedisServer, n: int, logs: Path, results: dict) -> float:
    names = [f"w{i}" for i in range(1, n + 1)]
    procs = [start_worker(server.url, args.model, w, logs, wait=False, **SETTINGS) for w in names]
    apis = []
    try:
        for w, p in zip(names, procs, strict=True):
            wait_up(server, w, p)
        for mode, weight in modes(args.load_weights):
            placement = dict(placement_load_weight=weight) if weight is not None else {}
            proc, base = start_api(
                server.url,
                args.model,
                logs,
                f"api-{n}-{mode}",
                placement=weight is not None,
                **placement,
            )
            apis.append((mode, proc, base))
        vocab = int(heartbeat(server.url, names[0])["vocab_size"])
        for _, _, base in apis:  # warm up: a fresh fleet's first requests run slower
            before = counters(server.url, names)
            warm = Workloads(vocab, 0.125, args.output_tokens, seed=-n)
            done = asyncio.run(run_prompts(base, warm.shared(), args.output_tokens, 8))
            settled(server.url, names, before, sum(r[2] for r in done))  # counted before a run
        for r in range(args.rounds):
            order = apis if r % 2 == 0 else apis[::-1]
            for workload in args.workloads:
                for mode, _, base in order:
                    seed = n * 1000 + r * 10 + [m for m, _, _ in apis].index(mode)
                    load = Workloads(vocab, args.scale, args.output_tokens, seed=seed)
                    got = run_workload(workload, base, server.url, names, load)
                    results.setdefault((workload, n, mode), []).append(got)
                    print(f"  N={n} {workload:9s} {mode:3s} {got}", flush=True)
        return peak_rss_mib(procs + [p for _, p, _ in apis])
    finally:
        for _, p, _ in apis:
            p.terminate()
        for p in procs:
            p.terminate()


def modes(load_weights: list[float]) -> list[tuple[str, float | None]]:
    """(mode name, placement load weight; None: placement off): one "on" API per weight."""
    named = [("on" if len(load_weights) == 1 else f"on@{w:g}", w) for w in load_weights]
    return [*named, ("off", None)]


def report(results: dict, ns: list[int], names: list[str]) -> None:
    def mean(rows, key):
        return statistics.fmean(r[key] for r in rows)

    print("\nworkload   N mode    cache  x1-worker ttft_p50 ttft_p99 out_tok/s  request shares")
    for workload in ("shared", "multiturn", "skewed"):
        # One worker: placement has no choice to make, both modes are one baseline.
        base_rows = [r for mode in names for r in results.get((workload, 1, mode), [])]
        one = mean(base_rows, "cache_share") if base_rows else None
        for n in ns:
            for mode in names:
                rows = results.get((workload, n, mode))
                if not rows:
                    continue
                share = mean(rows, "cache_share")
                rel = f"{share / one:.2f}x" if one else "-"
                print(
                    f"{workload:10s} {n} {mode:7s} {share:.3f} {rel:>9s} "
                    f"{mean(rows, 'ttft_p50'):8.3f} {mean(rows, 'ttft_p99'):8.3f} "
                    f"{mean(rows, 'out_tok_s'):9.1f}  {rows[-1]['request_shares']}"
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="model folder (default: a tiny random llama)")
    parser.add_argument("--workers", default="1,2,3,4")
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument(
        "--workloads", default="shared,multiturn,skewed", help="which to run, comma-separated"
    )
    parser.add_argument(
        "--load-weights",
        default="1.0",
        help="LLMQ_PLACEMENT_LOAD_WEIGHT of the placing APIs, one API each (e.g. 1.0,0.25)",
    )
    args = parser.parse_args()
    args.load_weights = [float(w) for w in args.load_weights.split(",")]
    args.workloads = args.workloads.split(",")
    ns = [int(x) for x in args.workers.split(",")]
    print(f"CPU: {cpu_model()}; workers {ns}, scale {args.scale}, rounds {args.rounds}")
    with tempfile.TemporaryDirectory() as tmp:
        logs = Path(tmp)
        if not args.model:
            from llmq.tools.model_factory import make_model

            args.model = str(logs / "model")
            make_model(args.model, "llama", "tiny")
        results: dict = {}
        with RedisServer() as server:
            for n in ns:
                rss = bench_fleet(args, server, n, logs, results)
                print(f"  N={n}: peak RSS of workers and APIs {rss} MiB", flush=True)
        report(results, ns, [m for m, _ in modes(args.load_weights)])


if __name__ == "__main__":
    main()
