"""Models on demand: a catalogue worker's resident memory (RSS) idle, with a model loaded and
after its unload, over several cycles, and the load and unload times it logged.

    python bench/on_demand_rss.py [--model PATH] [--cycles N] [--env NAME=VALUE ...]

Starts a redis-server, one `llmq worker` with LLMQ_CATALOGUE set to --model (default: the real
SmolLM2-135M-Instruct Q4_1 GGUF of tests/real_models.py) and an `llmq api`. Each cycle loads the
model (`POST /models/load`), answers one greedy completion, unloads it (`POST /models/unload`),
and prints the worker's RSS at each stage and the best of five 64-token greedy completions' speed; --env sets a variable for the worker (for example
PYTHONMALLOC=malloc). With --sleep, each cycle puts the model to sleep and wakes it instead.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import httpx
import redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llmq.common.catalogue import fresh_residents, scan  # noqa: E402
from llmq.common.transport import Keys  # noqa: E402
from llmq.common.transport.redis_server import RedisServer  # noqa: E402
from tests.harness import kill_all, start_api, start_worker, wait_for  # noqa: E402

KEYS = Keys("llmq")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def holding(r) -> dict[str, dict]:
    return {w: rec["models"] for w, rec in fresh_residents(r.hgetall(KEYS.resident)).items()}


def settled_rss(pid: int, seconds: float = 3.0) -> float:
    """The RSS once it stopped moving (the unload's trim, the collector)."""
    time.sleep(seconds)
    return rss_mib(pid)


def answer(base: str, model: str) -> list[int]:
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": 8}
    body |= {"temperature": 0, "logprobs": 0, "ignore_eos": True}
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    return r.json()["choices"][0]["logprobs"]["tokens"]


def decode_speed(base: str, model: str, tokens: int = 64, runs: int = 5) -> float:
    """Tokens a second of a greedy completion of ``tokens`` tokens (its prompt is short): the
    best of ``runs``, the one least slowed by other work on the host."""
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": tokens}
    body |= {"temperature": 0, "ignore_eos": True}
    best = 0.0
    for _ in range(runs):
        started = time.monotonic()
        httpx.post(f"{base}/v1/completions", json=body, timeout=600).raise_for_status()
        best = max(best, tokens / (time.monotonic() - started))
    return best


def cycle(base: str, r, model: str, pid: int, sleep: bool) -> dict[str, float]:
    out = {}
    started = time.monotonic()
    httpx.post(f"{base}/models/load", json={"model": model, "keep_alive": -1}, timeout=600)
    out["load_s"] = time.monotonic() - started
    out["tokens"] = answer(base, model)
    out["decode_tps"] = decode_speed(base, model)
    out["loaded"] = settled_rss(pid)
    route = "sleep" if sleep else "unload"
    httpx.post(f"{base}/models/{route}", json={"model": model}, timeout=60).raise_for_status()
    if sleep:
        wait_for(
            lambda: (
                holding(r)
                and all(m.get(model, {}).get("state") == "sleeping" for m in holding(r).values())
            ),
            60,
            "asleep",
        )
    else:
        wait_for(lambda: not any(holding(r).values()), 60, "unloaded")
    out["after"] = settled_rss(pid)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path)
    ap.add_argument("--cycles", type=int, default=2)
    ap.add_argument("--env", action="append", default=[])
    ap.add_argument("--sleep", action="store_true")
    args = ap.parse_args()
    if args.model is None:
        from tests.real_models import smollm2_gguf

        args.model = smollm2_gguf()
    (name,) = scan(str(args.model))
    extra = dict(e.split("=", 1) for e in args.env)
    logs = Path(tempfile.mkdtemp(prefix="on-demand-rss-"))
    with RedisServer() as server:
        procs = []
        try:
            r = redis.Redis.from_url(server.url)
            os.environ.update(extra)  # the worker's alone
            worker = start_worker(
                server.url, args.model, "w1", logs, wait=False, catalogue=args.model
            )
            for key in extra:
                os.environ.pop(key)
            procs.append(worker)
            wait_for(lambda: holding(r), 120, "the worker")
            pid = worker.proc.pid
            idle = settled_rss(pid, 5.0)
            api, base = start_api(server.url, args.model, logs)
            procs.append(api)
            print(f"idle: {idle:.0f} MiB")
            for k in range(args.cycles):
                c = cycle(base, r, name, pid, args.sleep)
                print(
                    f"cycle {k + 1}: load {c['load_s']:.2f} s, loaded {c['loaded']:.0f} MiB, "
                    f"after {'sleep' if args.sleep else 'unload'} {c['after']:.0f} MiB "
                    f"({(c['after'] / idle - 1) * 100:+.1f}% of idle), "
                    f"decode {c['decode_tps']:.1f} tokens/s, tokens {json.dumps(c['tokens'])}"
                )
            text = worker.log(1_000_000)
            for line in re.findall(r"(?:loaded|unloaded|asleep|woke|load phase)[^\n]*", text):
                print("  log:", line)
        finally:
            kill_all(procs)


if __name__ == "__main__":
    main()
