"""The client host of the scale-out test: runs inside its own network namespace.

Streams chat completions from the API, prints RUNNING (with how many requests each worker is
serving) once a stream has produced a few chunks and the workers' records show requests running,
then prints one JSON line with each stream's text and the number of chunks it received."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

import openai
import redis


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--api")
    ap.add_argument("--redis")
    ap.add_argument("--model")
    ap.add_argument("--prompts", help="JSON list of user messages")
    ap.add_argument("--max-tokens", type=int)
    args = ap.parse_args()
    prompts = json.loads(args.prompts)
    client = openai.AsyncOpenAI(base_url=args.api, api_key="x", max_retries=0, timeout=300)
    started = asyncio.Event()  # a stream has produced a few chunks

    async def one(text: str) -> dict:
        stream = await client.chat.completions.create(
            model=args.model,
            messages=[{"role": "user", "content": text}],
            max_tokens=args.max_tokens,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        parts, chunks, reason = [], 0, None
        async for chunk in stream:
            chunks += 1
            if chunk.choices:
                parts.append(chunk.choices[0].delta.content or "")
                reason = chunk.choices[0].finish_reason or reason
            if chunks == 4:
                started.set()
        return {"text": "".join(parts), "chunks": chunks, "finish_reason": reason}

    tasks = [asyncio.create_task(one(p)) for p in prompts]
    await asyncio.wait_for(started.wait(), 120)
    # The streams' chunks reach this process later than the workers write them (a loaded host
    # buffers them): the workers' records, not the chunks, say what is running now.
    r = redis.Redis.from_url(args.redis)
    workers = running_by_worker(r)
    while not workers and not all(t.done() for t in tasks):
        await asyncio.sleep(0.02)
        workers = running_by_worker(r)
    print("RUNNING " + json.dumps(workers), flush=True)
    results = await asyncio.gather(*tasks, return_exceptions=True)
    out = [r if isinstance(r, dict) else {"error": repr(r)} for r in results]
    print(json.dumps(out), flush=True)


def running_by_worker(r: redis.Redis) -> dict[str, int]:
    """How many requests each worker's records show running."""
    workers: dict[str, int] = {}
    for key in r.scan_iter(match="llmq:req:*", count=1000):
        if key.endswith(b":tokens"):
            continue
        if r.hget(key, "state") == b"running":
            w = (r.hget(key, "worker") or b"?").decode()
            workers[w] = workers.get(w, 0) + 1
    return workers


if __name__ == "__main__":
    asyncio.run(main())
    sys.exit(0)
