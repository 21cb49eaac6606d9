"""Models on demand: the time from a request for a model no worker holds to its first token,
against that model's load alone, through the real API.

    python bench/on_demand.py [--models PATH,PATH,...] [--budget-mb MB]

Starts a redis-server, two `llmq worker` processes with LLMQ_CATALOGUE set to --models (default:
the real SmolLM2-135M-Instruct Q4_1 and Gemma 3 270M Q4_K_M GGUF files of tests/real_models.py,
and the Gemma file again under another name) and LLMQ_MODEL_MEMORY_MB --budget-mb (default:
room for the largest model alone, so that each worker holds one), and an `llmq api`. It asks
every model in turn, then the first again (the third and fourth requests evict), each twice: a
cold request (streamed, greedy, 8 tokens) while no worker holds it, then a warm one. Reported per request: the cold TTFT; the load the worker logged
("loaded X in Y s") and any eviction it made for it ("unloaded Z (evicted for X) in Y s"); the
warm TTFT; and the overhead, cold TTFT - load - warm TTFT (the queue, the wait for a worker, the
eviction, the API's polling).
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llmq.common.catalogue import model_size, scan  # noqa: E402
from llmq.common.transport.redis_server import RedisServer  # noqa: E402
from tests.harness import kill_all, start_api, start_worker, wait_for  # noqa: E402


def default_models(tmp: Path) -> list[Path]:
    from tests.real_models import gemma3_gguf, smollm2_gguf

    again = tmp / "gemma-3-270m-b-q4_k_m.gguf"
    again.symlink_to(gemma3_gguf())
    return [smollm2_gguf(), gemma3_gguf(), again]


def ttft(base: str, model: str) -> tuple[float, float]:
    """Seconds from sending a streamed completion to its first token, and the wall-clock
    time it was sent."""
    body = {
        "model": model,
        "prompt": "The capital of France is",
        "max_tokens": 8,
        "temperature": 0,
        "stream": True,
    }
    sent, started = time.time(), time.monotonic()
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and '"text"' in line:
                return time.monotonic() - started, sent
    raise RuntimeError(f"{model}: no token")


def logged(workers, pattern: str, model: str, seen: set[str]) -> tuple[float, float]:
    """The seconds the first log line of ``pattern`` about ``model`` not counted yet gives, and
    its time (0, 0 for none)."""
    for w in workers:
        for line in w.log(1 << 22).splitlines():
            found = re.search(pattern.format(model=re.escape(model)), line)
            if found and line not in seen:
                seen.add(line)
                stamp = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
                return float(found.group(1)), stamp.timestamp()
    return 0.0, 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", help="comma-separated model folders or GGUF files")
    parser.add_argument("--budget-mb", type=float, help="LLMQ_MODEL_MEMORY_MB of each worker")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="llmq-on-demand-"))
    paths = [Path(p) for p in args.models.split(",")] if args.models else default_models(tmp)
    catalogue = scan(",".join(str(p) for p in paths))
    budget = args.budget_mb or max(model_size(p) for p in paths) * 1.02 / 2**20
    settings = dict(catalogue=",".join(map(str, paths)), model_memory_mb=budget, torch_threads=1)
    print(f"catalogue: {', '.join(catalogue)}; two workers of {budget:.0f} MB each")
    procs, seen = [], set()
    with RedisServer() as server:
        try:
            for name in ("w1", "w2"):
                procs.append(start_worker(server.url, paths[0], name, tmp, wait=False, **settings))
            workers = list(procs)
            wait_for(lambda: all("serving models on demand" in w.log() for w in workers), 300, "w")
            api, base = start_api(server.url, paths[0], tmp, request_timeout=600)
            procs.append(api)
            print(
                "model                  cold TTFT   load  evict  warm TTFT  overhead "
                "(to the load's start, after its end)"
            )
            for name in [*catalogue, next(iter(catalogue))]:
                cold, sent = ttft(base, name)
                load, loaded_at = logged(workers, r"loaded {model} in ([\d.]+) s", name, seen)
                evict, _ = logged(workers, r"evicted for {model}\) in ([\d.]+) s", name, seen)
                warm, _ = ttft(base, name)
                before = loaded_at - load - evict - sent
                after = sent + cold - loaded_at - warm
                print(
                    f"{name:22s} {cold:7.2f} s {load:6.2f} {evict:5.2f} {warm:8.3f} s "
                    f"{cold - load - warm:7.2f} s ({before:.2f} s, {after:.2f} s)",
                    flush=True,
                )
        finally:
            kill_all(procs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
