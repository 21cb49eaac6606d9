"""Redis state broken under a running worker: the request stream deleted mid-load (a FLUSHALL,
a restart without persistence, an eviction), an entry of the wrong types (written with
redis-cli), a token record that lost its tail (AOF `everysec` after a crash). Each used to end
the engine loop for good, or could misalign a record; now the requests concerned end with a
clear error or finish exactly (a record that lost its tail is written again from the
worker's own tokens), none hangs, and the worker serves what comes after."""

from __future__ import annotations

import asyncio
import json

import pytest
import redis

from llmq.common.errors import EngineFailure
from llmq.common.protocol import EngineRequest
from llmq.common.sampling_params import SamplingParams
from llmq.common.transport.redis_server import RedisServer
from tests.harness import kill_all, recorded_tokens, start_worker, wait_for
from tests.pipeline_client import GREEDY, greedy_reference, open_pipeline, prompts, stream_of


@pytest.fixture(scope="module")
def reference(llama_dir):
    """The in-process engine: what the worker must reproduce token for token."""
    return greedy_reference(llama_dir)


@pytest.fixture(scope="module")
def served(llama_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    with RedisServer() as server:
        worker = start_worker(server.url, llama_dir, "w-broken", logs)
        try:
            yield server, worker
        finally:
            kill_all([worker])


def serves_next(server, llama_dir, reference) -> None:
    """The worker is still serving: a new request comes back exact."""
    prompt = prompts(1, seed=99)[0]

    async def run():
        async with open_pipeline(server.url, llama_dir) as p:
            return await p.all_tokens(prompt, SamplingParams(max_tokens=12, **GREEDY))

    assert asyncio.run(run()).token_ids == reference([prompt], 12)[0]


def loop_alive(worker) -> bool:
    return worker.alive() and "engine loop crashed" not in worker.log(10**6)


def test_a_record_that_lost_its_tail_is_written_again_by_its_worker(served, llama_dir, reference):
    """The worker holds every token it generated: it writes the lost part of the record again
    (a final message refused this way fails its request: tests/worker/test_engine_loop_faults)."""
    server, worker = served
    r = redis.Redis.from_url(server.url)
    max_tokens = 400

    async def run():
        async with open_pipeline(server.url, llama_dir, inactivity_timeout=60) as p:
            params = SamplingParams(max_tokens=max_tokens, **GREEDY)
            task = asyncio.create_task(p.all_tokens([5, 6, 7], params, request_id="trimmed"))
            # Its worker's log moved into the record at least once (every 64 steps): the
            # record holds two values; keep the first alone, as an AOF that lost its tail.
            key = "llmq:req:trimmed:tokens"
            await asyncio.to_thread(wait_for, lambda: r.llen(key) >= 2, 30, "a move", 0.01)
            r.ltrim(key, 0, 0)
            return await asyncio.wait_for(task, 60)

    answer = asyncio.run(run())
    expected = reference([[5, 6, 7]], max_tokens)[0]
    assert answer.token_ids == expected
    recorded = recorded_tokens(r, "trimmed")
    assert recorded == expected  # the whole record again, nothing out of place
    assert r.hget("llmq:req:trimmed", "state") == b"finished"
    assert "written again from this worker" in worker.log(10**6)
    serves_next(server, llama_dir, reference)
    assert loop_alive(worker)


def test_a_poisoned_entry_fails_alone(served, llama_dir, reference):
    server, worker = served
    r = redis.Redis.from_url(server.url)
    poison = {"id": "poison", "prompt_token_ids": ["a"], "params": {}}
    r.xadd(
        stream_of(llama_dir), {"id": "poison", "kind": "generate", "payload": json.dumps(poison)}
    )
    wait_for(lambda: r.hget("llmq:req:poison", "state") == b"failed", 20, "poison failed")
    assert r.hget("llmq:req:poison", "error") == b"malformed request"
    # A well-formed entry whose token record is not token ids (written by hand): it fails
    # alone too, where parsing the record once raised on every pull and every restart.
    r.rpush("llmq:req:poisoned-record:tokens", "x")
    request = EngineRequest("poisoned-record", [5, 6, 7], SamplingParams(max_tokens=4))
    r.xadd(
        stream_of(llama_dir),
        {"id": request.id, "kind": "generate", "payload": request.to_json()},
    )
    failed = lambda: r.hget("llmq:req:poisoned-record", "state") == b"failed"  # noqa: E731
    wait_for(failed, 20, "poisoned record failed")
    serves_next(server, llama_dir, reference)
    assert loop_alive(worker)


def test_a_stream_deleted_mid_load_ends_every_request(served, llama_dir, reference):
    server, worker = served
    r = redis.Redis.from_url(server.url)
    batch = prompts(4, seed=11)
    expected = reference(batch, 40)

    def generating() -> bool:
        return all(recorded_tokens(r, f"d{i}") for i in range(len(batch)))

    async def run():
        async with open_pipeline(server.url, llama_dir) as p:
            params = SamplingParams(max_tokens=40, **GREEDY)
            tasks = [
                asyncio.create_task(p.all_tokens(q, params, request_id=f"d{i}"))
                for i, q in enumerate(batch)
            ]
            await asyncio.to_thread(wait_for, generating, 30, "every request generating", 0.01)
            r.delete(stream_of(llama_dir))
            return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 60)

    results = asyncio.run(run())
    for i, (res, exp) in enumerate(zip(results, expected, strict=True)):
        if isinstance(res, BaseException):  # allowed: a clear error, never a hang
            assert isinstance(res, EngineFailure) and res.code, (i, res)
        else:
            assert res.token_ids == exp, f"request d{i} differs"
    serves_next(server, llama_dir, reference)
    assert loop_alive(worker)
