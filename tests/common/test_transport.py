"""The Redis + Celery path against real processes: redis-server, `llmq worker`, the pipeline."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import time

import pytest
import redis

from llmq.common.model_files import load_tokenizer
from llmq.common.sampling_params import SamplingParams
from llmq.common.transport import Keys
from llmq.common.transport.redis_server import RedisServer, redis_cli_binary
from tests import harness
from tests.harness import LLMQ, heartbeat, recorded_tokens, start_worker, start_workers, wait_for
from tests.pipeline_client import GREEDY, greedy_reference, open_pipeline, prompts, stream_of


@pytest.fixture(scope="module")
def reference(llama_dir):
    """The in-process engine: what the workers must reproduce token for token."""
    return greedy_reference(llama_dir)


@pytest.fixture(scope="module")
def served(llama_dir, tmp_path_factory):
    """One Redis and one worker shared by the tests of this module that need nothing special."""
    logs = tmp_path_factory.mktemp("logs")
    with RedisServer() as server:
        # A long heartbeat TTL: one test freezes this worker for a moment (SIGSTOP). With
        # torch's ops, not llmq's C++ kernels: with those the tiny model makes one test's 1,500
        # tokens in under the second a heartbeat takes to show the request running.
        worker = start_worker(
            server.url,
            llama_dir,
            "w-main",
            logs,
            request_ttl=2,
            heartbeat_ttl=30,
            cpu_kernels=False,
        )
        try:
            yield server, worker
        finally:
            harness.kill_all([worker])


def test_concurrent_requests_equal_in_process_engine(served, llama_dir, reference):
    server, _ = served
    batch = prompts(32, seed=1)
    expected = reference(batch, 24)
    tok = load_tokenizer(str(llama_dir))

    async def run():
        async with open_pipeline(server.url, llama_dir) as p:
            return await asyncio.gather(
                *[p.all_tokens(q, SamplingParams(max_tokens=24, **GREEDY)) for q in batch]
            )

    results = asyncio.run(run())
    assert len({tuple(e) for e in expected}) > 16, "reference outputs are not varied"
    for res, exp in zip(results, expected, strict=True):
        assert res.token_ids == exp
        assert res.text == tok.decode(exp, skip_special_tokens=True)
        assert res.finish_reason == "length"
        assert res.completion_tokens == 24


def test_cancel_and_stop_string_free_kv_blocks(served, llama_dir, reference):
    server, _ = served
    client = redis.Redis.from_url(server.url)
    tok = load_tokenizer(str(llama_dir))
    prompt = prompts(1, seed=7)[0]
    full = reference([prompt], 40)[0]
    full_text = tok.decode(full, skip_special_tokens=True)
    stop = full_text[len(full_text) // 2 : len(full_text) // 2 + 3]

    async def run():
        async with open_pipeline(server.url, llama_dir) as p:
            # A client that leaves after a few chunks.
            long = p.generate(prompt, SamplingParams(max_tokens=2000, **GREEDY), request_id="gone")
            seen = 0
            async for _ in long:
                seen += 1
                if seen == 3:
                    break
            await long.aclose()
            stopped = await p.all_tokens(
                prompt, SamplingParams(max_tokens=1000, **GREEDY), stop=[stop], request_id="stopped"
            )
            return stopped

    stopped = asyncio.run(run())
    assert stopped.finish_reason == "stop"
    assert stopped.text == full_text[: full_text.index(stop)]
    wait_for(
        lambda: heartbeat(server.url, "w-main").get("kv_blocks_used") == "0", 5, "blocks freed"
    )
    # The worker stopped generating: far fewer tokens were recorded than asked for.
    for rid, asked in (("gone", 2000), ("stopped", 1000)):
        recorded = len(recorded_tokens(client, rid))
        assert recorded < asked / 4, (rid, recorded)


def test_redis_cli_shows_readable_json(served, llama_dir):
    server, _ = served
    cli = redis_cli_binary()
    assert cli, "redis-cli not found"

    def rcli(*args: str) -> str:
        return subprocess.run(
            [cli, "-p", str(server.port), "--no-raw", *args],
            capture_output=True,
            text=True,
            check=True,
        ).stdout

    async def run():
        async with open_pipeline(server.url, llama_dir) as p:
            gen = p.generate(
                [5, 6, 7], SamplingParams(max_tokens=1500, **GREEDY), request_id="shown"
            )
            await gen.__anext__()
            raw = subprocess.run(
                [cli, "-p", str(server.port), "--raw", "XRANGE", stream_of(llama_dir), "-", "+"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.splitlines()
            await gen.aclose()
            return raw

    lines = asyncio.run(run())
    payload = json.loads(lines[lines.index("payload") + 1])
    assert payload["id"] == "shown" and payload["prompt_token_ids"] == [5, 6, 7]
    assert payload["params"]["max_tokens"] == 1500
    assert "engines" in rcli("XINFO", "GROUPS", stream_of(llama_dir))
    hb = subprocess.run(
        [cli, "-p", str(server.port), "--raw", "HGETALL", "llmq:engines:w-main"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    fields = dict(zip(hb[::2], hb[1::2], strict=True))
    assert fields["model"] == str(llama_dir)
    assert int(fields["kv_blocks_total"]) > 0 and int(fields["max_model_len"]) > 0


def test_llmq_inspect_shows_the_worker_serving_a_request(served, llama_dir):
    server, worker = served
    r = redis.Redis.from_url(server.url)

    def inspect(*flags: str) -> str:
        return subprocess.run(
            [LLMQ, "inspect", "--redis-url", server.url, *flags],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout

    def serving() -> bool:  # in the heartbeat (refreshed once a second) and the stream
        running = heartbeat(server.url, "w-main").get("running") == "1"
        return running and r.xpending(stream_of(llama_dir), "engines")["pending"] == 1

    async def run():
        async with open_pipeline(server.url, llama_dir) as p:
            gen = p.generate([5, 6, 7], SamplingParams(max_tokens=1500, **GREEDY))
            await gen.__anext__()
            try:
                await asyncio.to_thread(wait_for, serving, 30, "the request being served")
                # Frozen while inspected: on a fast machine the request could end between the
                # heartbeat and the snapshot (the heartbeat outlives the freeze: TTL 30 s).
                os.killpg(worker.proc.pid, signal.SIGSTOP)
                try:
                    return inspect("--json"), inspect()
                finally:
                    os.killpg(worker.proc.pid, signal.SIGCONT)
            finally:
                await gen.aclose()

    as_json, text = asyncio.run(run())
    snap = json.loads(as_json)
    (engine,) = [e for e in snap["engines"] if e["name"] == "w-main"]
    assert engine["model"] == str(llama_dir)
    # numbers as numbers, text as text
    assert engine["running"] == 1 and engine["waiting"] == 0
    assert isinstance(engine["kv_blocks_total"], int) and engine["kv_blocks_used"] > 0
    assert isinstance(engine["tokens_per_s"], int | float)
    (queue,) = [q for q in snap["queues"] if q["stream"] == stream_of(llama_dir)]
    assert queue["pending"] == 1 and [c["pending"] for c in queue["consumers"]] == [1]
    assert "w-main: " in text and "running 1" in text and f"{stream_of(llama_dir)}: " in text


def test_a_fresh_request_costs_no_record_read_and_no_pending_count(served, llama_dir, reference):
    """A request never run before has no record: its pull reads none (no LRANGE), and a queue
    far under its limit is not counted closer (no XPENDING); the answers stay exact."""
    server, _ = served
    batch = prompts(6, seed=21)
    expected = reference(batch, 12)
    client = redis.Redis.from_url(server.url)

    def calls(name: str) -> int:
        return client.info("commandstats").get(f"cmdstat_{name}", {}).get("calls", 0)

    before: dict[str, int] = {}

    async def run():
        async with open_pipeline(server.url, llama_dir) as p:
            params = SamplingParams(max_tokens=12, **GREEDY)
            # A request first: a worker's first write after its log is new or gone (its TTL
            # here is 2 s) checks every request it holds apart (StepWriter._write_alone), an
            # owner check more for each, whichever of the batch it holds then.
            await p.all_tokens(prompts(1, seed=22)[0], params)
            before.update({name: calls(name) for name in ("lrange", "xpending", "hmget")})
            return await asyncio.gather(*[p.all_tokens(q, params) for q in batch])

    results = asyncio.run(run())
    assert [r.token_ids for r in results] == expected
    assert calls("lrange") == before["lrange"]
    assert calls("xpending") == before["xpending"]
    # Its owner checked twice, as it is taken into service and as it finishes.
    assert calls("hmget") - before["hmget"] == 2 * len(batch)


def test_nothing_left_behind(served, llama_dir):
    """Runs after the others in this module: no pending entries, no subscriptions once the
    API's side closed, and the request records and the worker's log expire after their TTL
    (2 s here)."""
    server, _ = served

    async def run():
        async with open_pipeline(server.url, llama_dir) as p:
            await asyncio.gather(
                *[p.all_tokens(q, SamplingParams(max_tokens=8, **GREEDY)) for q in prompts(8, 3)]
            )

    asyncio.run(run())
    client = redis.Redis.from_url(server.url)
    assert client.xpending(stream_of(llama_dir), "engines")["pending"] == 0
    assert client.xlen(stream_of(llama_dir)) == 0
    assert client.pubsub_channels("llmq:replies:*") == []
    assert client.pubsub_channels("llmq:out:*") == []
    wait_for(lambda: not client.keys("llmq:req:*"), 8, "request records to expire")
    wait_for(lambda: not client.exists("llmq:log:w-main"), 8, "the worker's log to expire")


def test_killed_worker_requests_resume_exactly(llama_dir, reference, tmp_path):
    batch = prompts(12, seed=5)
    expected = reference(batch, 150)
    with RedisServer() as server:
        # Coalescing on (LLMQ_STREAM_INTERVAL_MS): tokens that waited unsent die with w1 and
        # are generated again by w2; what was sent is what w2 resumes from.
        settings = dict(heartbeat_ttl=2, torch_threads=1, stream_interval_ms=50)
        w1 = start_worker(server.url, llama_dir, "w1", tmp_path, **settings)
        client = redis.Redis.from_url(server.url)

        async def run():
            # The only worker dies and its successor takes seconds to load: a long grace keeps
            # the requests waiting for it instead of failing them with 503 no_worker.
            patient = dict(inactivity_timeout=120, no_worker_grace=120)
            async with open_pipeline(server.url, llama_dir, **patient) as p:
                tasks = [
                    asyncio.create_task(
                        p.all_tokens(
                            q, SamplingParams(max_tokens=150, **GREEDY), request_id=f"r{i}"
                        )
                    )
                    for i, q in enumerate(batch)
                ]
                # Every request running on w1 with some tokens out, then w1 dies.
                await asyncio.to_thread(
                    wait_for,
                    lambda: all(
                        len(recorded_tokens(client, f"r{i}")) >= 3 for i in range(len(batch))
                    ),
                    30,
                    "first tokens",
                    0.01,
                )
                w1.kill()
                done_before = [len(recorded_tokens(client, f"r{i}")) for i in range(len(batch))]
                w2 = await asyncio.to_thread(
                    start_worker, server.url, llama_dir, "w2", tmp_path, **settings
                )
                try:
                    return await asyncio.gather(*tasks), done_before
                finally:
                    await asyncio.to_thread(w2.terminate)

        results, done_before = asyncio.run(run())
        assert any(n < 150 for n in done_before), "the kill came too late to interrupt anything"
        for i, (res, exp) in enumerate(zip(results, expected, strict=True)):
            assert res.token_ids == exp, f"request {i} differs after resuming"
        workers = {client.hget(f"llmq:req:r{i}", "worker") for i in range(len(batch))}
        assert workers == {b"w2"}
        assert client.xpending(stream_of(llama_dir), "engines")["pending"] == 0


def test_operator_mistakes_get_one_line_errors(tmp_path):
    """A bad URL, port or setting is one line naming it and exit code 1, not a traceback."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMQ_")}
    cases = [
        ([LLMQ, "inspect", "--redis-url", "notaurl"], {}, "llmq inspect: Redis URL must"),
        ([LLMQ, "api", "--port", "99999"], {}, "llmq api: LLMQ_PORT: Input should be less"),
        ([LLMQ, "api"], {"LLMQ_PORT": "abc"}, "llmq api: LLMQ_PORT: Input should be a valid"),
        ([LLMQ, "batch", "submit", str(tmp_path / "none.jsonl")], {}, "llmq batch: [Errno 2]"),
    ]
    for argv, extra, expected in cases:
        proc = subprocess.run(
            argv, capture_output=True, text=True, timeout=60, env={**env, **extra}, cwd=tmp_path
        )
        assert proc.returncode == 1, (argv, proc.stderr)
        assert proc.stderr.startswith(expected) and proc.stderr.count("\n") == 1, proc.stderr
    # An unknown flag is the verb's error, with the verb's usage.
    proc = subprocess.run([LLMQ, "worker", "--bogus"], capture_output=True, text=True, env=env)
    assert proc.returncode == 2 and proc.stderr.startswith("usage: llmq worker"), proc.stderr
    assert "llmq worker: error: unrecognized arguments: --bogus" in proc.stderr


def test_a_gap_is_filled_with_its_logprobs(llama_dir):
    """Tokens a client missed (published while it was not subscribed: a Redis restart, a
    pub/sub gap) come back from the request's record with their logprobs: the first from its
    list (a worker's first write goes there), the second from its worker's log."""
    from llmq.common.protocol import EngineRequest, OutputMessage
    from llmq.common.transport import Emission, EngineTransport, PulledRequest

    with RedisServer() as server:

        async def run():
            async with open_pipeline(server.url, llama_dir) as p:
                engine = EngineTransport(redis.Redis.from_url(server.url), Keys(), "w", "m", 60)
                params = SamplingParams(max_tokens=3, logprobs=1)
                asked = EngineRequest(id="gap", prompt_token_ids=[1, 2], params=params)
                lps = [{"token_id": t, "logprob": -0.5, "top": [[t, -0.5]]} for t in (5, 6)]
                assert not engine.mark_running([PulledRequest("0-1", asked, [])])
                for i in (0, 1):  # nobody listens: missed
                    msg = OutputMessage(index=i, tokens=[5 + i], logprobs=lps[i : i + 1])
                    assert not engine.emit([Emission("gap", "0-1", msg)])
                whole, _, _ = await p.output.recover(asked, 0)
                tail, _, _ = await p.output.recover(asked, 1)
                plain = EngineRequest(id="gap", prompt_token_ids=[1, 2])
                none, _, _ = await p.output.recover(plain, 0)
                return whole, tail, none

        whole, tail, none = asyncio.run(run())
    assert whole.tokens == [5, 6] and [e["token_id"] for e in whole.logprobs] == [5, 6]
    assert tail.tokens == [6] and [e["token_id"] for e in tail.logprobs] == [6]
    assert none.tokens == [5, 6] and none.logprobs is None


def test_a_worker_stopped_warm_hands_its_request_over_at_once(llama_dir, reference, tmp_path):
    """SIGTERM with a short grace: the worker hands back what it could not finish and says so,
    and the other worker takes it over at once, not once the entry has sat idle for the
    heartbeat TTL (5 s here); the output is exact across the hand-over. Long requests beside it
    keep the tiny model busy: alone, it sometimes made all 1,800 tokens before the shutdown."""
    batch = prompts(1, seed=11)
    fillers = prompts(12, seed=12)
    expected = reference(batch, 1800)
    with RedisServer() as server:
        settings = dict(heartbeat_ttl=5, shutdown_grace=0.3)
        workers = start_workers(server.url, llama_dir, ("wa", "wb"), tmp_path, **settings)
        client = redis.Redis.from_url(server.url)

        async def run():
            async with open_pipeline(server.url, llama_dir, inactivity_timeout=60) as p:
                arrivals: list[float] = []
                tokens: list[int] = []

                async def consume():
                    params = SamplingParams(max_tokens=1800, **GREEDY)
                    async for chunk in p.generate(batch[0], params, request_id="hb"):
                        tokens.extend(chunk.token_ids)
                        arrivals.append(time.monotonic())

                async def fill(i: int, prompt: list[int]) -> None:
                    params = SamplingParams(max_tokens=1800, **GREEDY)
                    async for _ in p.generate(prompt, params, request_id=f"fill{i}"):
                        pass

                filling = [asyncio.create_task(fill(i, x)) for i, x in enumerate(fillers)]
                task = asyncio.create_task(consume())
                await asyncio.to_thread(
                    wait_for,
                    lambda: len(recorded_tokens(client, "hb")) >= 20,
                    30,
                    "tokens",
                    0.01,
                )
                holder = client.hget("llmq:req:hb", "worker").decode()
                await asyncio.to_thread(workers[holder].terminate)
                await task
                await asyncio.gather(*filling)
                return tokens, arrivals, holder, client.hget("llmq:req:hb", "worker").decode()

        try:
            tokens, arrivals, holder, finisher = asyncio.run(run())
        finally:
            harness.kill_all(workers.values())  # the holder's warm stop is the scenario's
    assert tokens == expected[0]
    assert re.search(r"handing back \d+ unfinished requests", workers[holder].log(100_000))
    other = "wb" if holder == "wa" else "wa"
    assert finisher == other  # it was handed over
    # The stream's one pause is the hand-over.
    pause = max(b - a for a, b in zip(arrivals, arrivals[1:], strict=False))
    assert pause < 1.5, f"the stream paused {pause:.1f}s at the hand-over"
