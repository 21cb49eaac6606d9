"""A worker frozen past its heartbeat (`kill -STOP`: a long GC pause, a paused VM, a step longer
than the TTL) has its requests claimed by another; when it wakes it must publish nothing more
for them. Before ownership fencing both workers published the same indexes, and a sampled
stream interleaved tokens of two continuations."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections import defaultdict

import redis

from llmq.common.model_files import load_tokenizer
from llmq.common.protocol import OutputMessage
from llmq.common.sampling_params import SamplingParams
from llmq.common.transport.output_log import decode_frame
from llmq.common.transport.redis_server import RedisServer
from tests.harness import heartbeat, kill_all, recorded_tokens, start_worker, wait_for, wait_worker
from tests.pipeline_client import open_pipeline, prompts, stream_of

TTL = 1.5
N_REQUESTS = 8
MAX_TOKENS = 400


class Published:
    """Every request's message published on any API process's channel, from before the
    first."""

    def __init__(self, url: str):
        self.pubsub = redis.Redis.from_url(url).pubsub(ignore_subscribe_messages=True)
        self.pubsub.psubscribe("llmq:replies:*")
        self.messages: list[tuple[str, OutputMessage]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            msg = self.pubsub.get_message(timeout=0.1)
            if msg and msg["type"] == "pmessage":
                self.messages.extend(decode_frame(msg["data"]).items())

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.pubsub.close()


def seed(i: int) -> int | None:
    """Seeded requests continue on any worker exactly as they would have (a sample depends on
    the seed and the position only); unseeded ones diverge, and two workers publishing them
    interleave two continuations."""
    return i if i % 2 == 0 else None


def freeze(worker, r: redis.Redis, name: str) -> None:
    os.killpg(worker.proc.pid, signal.SIGSTOP)
    wait_for(lambda: not r.exists(f"llmq:engines:{name}"), 10 * TTL, f"{name}'s heartbeat gone")


def thaw(worker, name: str, url: str) -> None:
    os.killpg(worker.proc.pid, signal.SIGCONT)
    wait_worker(url, name, worker)


def owners(r: redis.Redis) -> set[bytes | None]:
    return {r.hget(f"llmq:req:f{i}", "worker") for i in range(N_REQUESTS)}


async def serve(url: str, llama_dir, r: redis.Redis, workers: dict) -> list:
    """8 sampled streams on A; B takes them over while A is frozen for three TTLs."""
    async with open_pipeline(url, llama_dir, inactivity_timeout=120) as p:
        tasks = [
            asyncio.create_task(
                p.all_tokens(
                    q,
                    SamplingParams(
                        max_tokens=MAX_TOKENS, temperature=1.0, seed=seed(i), ignore_eos=True
                    ),
                    request_id=f"f{i}",
                )
            )
            for i, q in enumerate(prompts(N_REQUESTS, seed=21))
        ]

        def running_on_a() -> bool:
            started = all(len(recorded_tokens(r, f"f{i}")) >= 5 for i in range(N_REQUESTS))
            return started and owners(r) == {b"wa"}

        await asyncio.to_thread(wait_for, running_on_a, 60, "the requests running on A", 0.01)
        await asyncio.to_thread(thaw, workers["wb"], "wb", url)
        frozen_at = time.monotonic()
        await asyncio.to_thread(freeze, workers["wa"], r, "wa")
        # Every request claimed (none had finished on A: the claims prove it)
        await asyncio.to_thread(wait_for, lambda: owners(r) == {b"wb"}, 30, "B's claims", 0.05)
        await asyncio.sleep(max(0.0, 3 * TTL - (time.monotonic() - frozen_at)))
        await asyncio.to_thread(thaw, workers["wa"], "wa", url)
        results = await asyncio.gather(*tasks)
        # A has woken and gone on: with fencing it drops the requests, without it it runs
        # them to their end; either way it is done with them once its heartbeat says so.
        await asyncio.to_thread(
            wait_for, lambda: heartbeat(url, "wa").get("running") == "0", 60, "A idle", 0.05
        )
        return results


def test_a_frozen_worker_publishes_nothing_for_requests_claimed_from_it(llama_dir, tmp_path):
    tok = load_tokenizer(str(llama_dir))
    with RedisServer() as server:
        r = redis.Redis.from_url(server.url)
        settings = dict(heartbeat_ttl=TTL, torch_threads=1)
        workers = {
            name: start_worker(server.url, llama_dir, name, tmp_path, wait=False, **settings)
            for name in ("wa", "wb")
        }
        published = None
        try:
            for name, w in workers.items():
                wait_worker(server.url, name, w)
            freeze(workers["wb"], r, "wb")  # so that A takes every request
            published = Published(server.url)
            results = asyncio.run(serve(server.url, llama_dir, r, workers))
            records = [recorded_tokens(r, f"f{i}") for i in range(N_REQUESTS)]
            # Frames name a request by the short key its API process gave it (in its hash).
            key_of = {f"f{i}": r.hget(f"llmq:req:f{i}", "reply") for i in range(N_REQUESTS)}
            request_of = {v.decode().partition("#")[2]: rid for rid, v in key_of.items()}
            assert r.xpending(stream_of(llama_dir), "engines")["pending"] == 0
        finally:
            if published is not None:
                published.close()
            kill_all(workers.values())  # frozen or not
    by_index: dict[tuple[str, int], set[int]] = defaultdict(set)
    finals: dict[str, int] = defaultdict(int)
    for key, msg in published.messages:
        rid = request_of[key]
        for j, t in enumerate(msg.tokens):
            by_index[(rid, msg.index + j)].add(t)
        finals[rid] += msg.done
    twice = {k: v for k, v in by_index.items() if len(v) > 1}
    assert not twice, f"indexes published with different tokens: {sorted(twice)[:5]}"
    assert finals == {f"f{i}": 1 for i in range(N_REQUESTS)}
    for i, (res, record) in enumerate(zip(results, records, strict=True)):
        assert len(record) == MAX_TOKENS and res.finish_reason == "length"
        assert res.token_ids == record, f"request f{i}: the client's tokens are not the record"
        assert res.text == tok.decode(record, skip_special_tokens=True)
        assert [by_index[(f"f{i}", j)] for j in range(MAX_TOKENS)] == [{t} for t in record]
    log = workers["wa"].log(10**6)
    assert "was claimed by wb" in log and "dropped here" in log, log[-3000:]
