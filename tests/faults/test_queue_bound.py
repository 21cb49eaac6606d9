"""The queue's bound (LLMQ_MAX_QUEUE=8) holds against requests of many prompts and choices: a
request takes one entry per prompt x n, counted as a whole before its first choice is enqueued,
so one too large is refused before anything reaches Redis, never half-way through."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest

from llmq.common.transport import GROUP
from tests.faults.stack import Served, served
from tests.harness import wait_for

LIMIT = 8
ONE = {
    "messages": [{"role": "user", "content": "What does XREADGROUP do?"}],
    "max_tokens": 2,
    "temperature": 0,
    "ignore_eos": True,
}


@pytest.fixture(scope="module")
def s(llama_dir, tmp_path_factory) -> Iterator[Served]:
    logs = tmp_path_factory.mktemp("queue-bound")
    # A long heartbeat TTL: the worker is frozen (SIGSTOP) for a moment, yet stays registered.
    with served(llama_dir, logs, "w-bound", dict(heartbeat_ttl=15), dict(max_queue=LIMIT)) as s:
        warm = httpx.post(f"{s.base}/v1/chat/completions", json=ONE, timeout=60)
        assert warm.status_code == 200, warm.text
        yield s


def prompts(k: int, n: int = 1) -> dict:
    return {
        "prompt": [[5 + i, 6, 7] for i in range(k)],
        "n": n,
        "max_tokens": 2,
        "ignore_eos": True,
    }


def assert_refused(resp: httpx.Response, status: int, code: str) -> None:
    assert resp.status_code == status, resp.text
    assert resp.json()["error"]["code"] == code
    if status == 429:
        assert resp.headers["retry-after"] == "1"


def test_a_200_prompt_request_is_refused_before_anything_is_enqueued(s):
    r = s.redis()
    url = f"{s.base}/v1/completions"
    records = set(r.keys("llmq:req:*"))  # the warm-up's
    for k, n in ((200, 4), (200, 1), (LIMIT + 1, 1), (LIMIT // 2 + 1, 2)):
        assert_refused(httpx.post(url, json=prompts(k, n), timeout=30), 400, "request_too_large")
        assert r.xlen(s.stream) == 0 and set(r.keys("llmq:req:*")) == records
    assert httpx.post(url, json=prompts(2049), timeout=30).status_code == 400
    assert r.xlen(s.stream) == 0


@contextmanager
def stopped(s: Served) -> Iterator[None]:
    """The worker frozen (SIGSTOP) but registered: the queue holds what it is given."""
    os.kill(s.worker.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(s.worker.proc.pid, signal.SIGCONT)


def test_the_queue_counts_every_prompt_and_choice(s):
    """With two requests waiting, one of 7 prompts (2 + 7 > 8) is a 429 that enqueued none of
    them (a client's retry of a late 429 would redo the work); one of 6 fits exactly."""
    r = s.redis()

    def waiting() -> int:
        return r.xlen(s.stream) - r.xpending(s.stream, GROUP)["pending"]

    async def run():
        async with httpx.AsyncClient(base_url=s.base, timeout=60) as http:
            with stopped(s):
                queued = []
                for n in range(1, 4):  # until two wait (a read blocked before may take one)
                    queued.append(
                        asyncio.ensure_future(http.post("/v1/chat/completions", json=ONE))
                    )
                    await asyncio.to_thread(
                        wait_for, lambda n=n: r.xlen(s.stream) == n, 10, "queued", 0.02
                    )
                    if waiting() == 2:
                        break
                length = r.xlen(s.stream)
                refused = await http.post("/v1/completions", json=prompts(LIMIT - 1))
                assert r.xlen(s.stream) == length  # none of its prompts was enqueued
                fits = asyncio.ensure_future(http.post("/v1/completions", json=prompts(LIMIT - 2)))
                await asyncio.to_thread(
                    wait_for, lambda: waiting() == LIMIT, 10, "a full queue", 0.02
                )
            return refused, await asyncio.gather(*queued, fits)

    refused, answered = asyncio.run(run())
    assert_refused(refused, 429, "queue_full")
    for a in answered:
        assert a.status_code == 200, a.text
    assert sorted(ch["index"] for ch in answered[-1].json()["choices"]) == list(range(LIMIT - 2))
    wait_for(lambda: r.xlen(s.stream) == 0, 10, "an empty queue")
