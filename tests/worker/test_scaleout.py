"""Scale-out against real processes: hosts in network namespaces, several models and API
replicas on one Redis, workers joining late."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
import redis

from llmq.common.model_files import load_tokenizer
from llmq.common.sampling_params import SamplingParams
from llmq.common.transport import Keys
from llmq.common.transport.redis_server import RedisServer, free_port, redis_cli_binary
from llmq.worker.llm_engine import EngineConfig, LLMEngine
from llmq.worker.loading.model_loader import eos_token_ids, load_causal_lm
from tests import netns
from tests.harness import (
    LLMQ,
    Proc,
    base_env,
    heartbeat,
    kill_all,
    recorded_tokens,
    request_ids,
    start_worker,
    wait_for,
    wait_worker,
)

PROMPTS = [f"Tell me about item {i} of the list, please." for i in range(8)]


def greedy_texts(model_dir, prompts: list[str], max_tokens: int) -> list[str]:
    """What the in-process engine answers to each chat prompt (greedy, float32)."""
    tok = load_tokenizer(str(model_dir))
    model = load_causal_lm(str(model_dir), "float32", "cpu")
    engine = LLMEngine(model, EngineConfig(num_blocks=1024), eos_token_ids(model, tok))
    ids = [
        list(
            tok.apply_chat_template(
                [{"role": "user", "content": p}], add_generation_prompt=True, return_dict=False
            )
        )
        for p in prompts
    ]
    outs = engine.generate(
        ids, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    )
    return [tok.decode(o, skip_special_tokens=True) for o in outs]


def start_api(redis_url: str, model, log_dir, prefix=(), host="127.0.0.1", port=None, **settings):
    port = port or free_port()
    env = base_env(redis_url, model, host=host, port=port, **settings)
    proc = Proc([*prefix, LLMQ, "api"], env, log_dir / f"api-{port}.log")
    url = f"http://{host}:{port}"

    def up() -> bool:
        if not proc.alive():
            raise RuntimeError(f"api exited:\n{proc.log()}")
        if prefix:
            probe = f"import httpx,sys; sys.exit(httpx.get('{url}/health').status_code != 200)"
            return (
                subprocess.run(
                    [*prefix, sys.executable, "-c", probe], capture_output=True
                ).returncode
                == 0
            )
        try:
            return httpx.get(f"{url}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(up, 60, "the API", 0.3)
    return proc, url


# ---- 1. hosts in network namespaces --------------------------------------------------------
@pytest.fixture(scope="module")
def network():
    why = netns.available()
    if why:
        pytest.skip(f"network namespaces unavailable here: {why}")
    with netns.Network(["redis", "w1", "w2", "api", "client"]) as net:
        yield net


def test_hosts_in_namespaces_survive_a_killed_worker_host(network, llama_dir, tmp_path):
    net = network
    max_tokens = 120
    expected = greedy_texts(llama_dir, PROMPTS, max_tokens)
    assert len(set(expected)) == len(expected)
    # Each host is a fresh namespace: its ports are all free.
    server = RedisServer(host=net.addr("redis"), port=6379, exec_prefix=net.prefix("redis")).start()
    try:
        url = server.url
        cli = redis_cli_binary()
        settings = dict(heartbeat_ttl=2, torch_threads=1, inactivity_timeout=120)
        workers = {}
        for host in ("w1", "w2"):
            env = base_env(url, llama_dir, worker_name=host, **settings)
            workers[host] = Proc(
                [*net.prefix(host), LLMQ, "worker", "--name", host], env, tmp_path / f"{host}.log"
            )

        def engines_up() -> bool:
            for proc in workers.values():
                if not proc.alive():
                    raise RuntimeError(proc.log())
            out = subprocess.run(
                [
                    *net.prefix("client"),
                    cli,
                    "-h",
                    net.addr("redis"),
                    "-p",
                    str(server.port),
                    "--raw",
                    "KEYS",
                    "llmq:engines:*",
                ],
                capture_output=True,
                text=True,
            ).stdout.split()
            return len(out) == 2

        wait_for(engines_up, 120, "both workers", 0.5)
        api, api_url = start_api(
            url, llama_dir, tmp_path, prefix=net.prefix("api"), host=net.addr("api"), **settings
        )
        client = subprocess.Popen(
            [
                *net.prefix("client"),
                sys.executable,
                "-m",
                "tests.netns_client",
                "--api",
                f"{api_url}/v1",
                "--redis",
                url,
                "--model",
                str(llama_dir),
                "--prompts",
                json.dumps(PROMPTS),
                "--max-tokens",
                str(max_tokens),
            ],  # fmt: skip
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=str(__import__("pathlib").Path(__file__).resolve().parents[2]),
        )
        line = client.stdout.readline()
        assert line.startswith("RUNNING"), line + client.stderr.read()
        serving = json.loads(line.split(" ", 1)[1])
        victim = "w1" if serving.get("w1") else "w2"
        assert serving.get(victim), f"no worker is serving anything: {serving}"
        net.kill_host(victim)  # every process of that host, at once
        out, err = client.communicate(timeout=240)
        results = json.loads(out.strip().splitlines()[-1])
        for res, exp in zip(results, expected, strict=True):
            assert "error" not in res, (res, err)
            assert res["finish_reason"] == "length"
            assert res["text"] == exp, "a stream differs after its worker's host died"
        survivor = "w2" if victim == "w1" else "w1"
        assert workers[survivor].alive()
        kill_all([api, workers[survivor]])
    finally:
        server.close()


# ---- 2. two models on one Redis ---------------------------------------------------------------
def test_two_models_on_one_redis(llama_dir, qwen2_dir, tmp_path):
    expected = {m: greedy_texts(m, PROMPTS[:3], 16) for m in (llama_dir, qwen2_dir)}
    assert expected[llama_dir] != expected[qwen2_dir]
    with RedisServer() as server:
        settings = dict(heartbeat_ttl=2)
        wl = start_worker(server.url, llama_dir, "w-llama", tmp_path, wait=False, **settings)
        wq = start_worker(server.url, qwen2_dir, "w-qwen", tmp_path, wait=False, **settings)
        api, url = start_api(server.url, llama_dir, tmp_path, request_timeout=20)
        try:
            for name, proc in (("w-llama", wl), ("w-qwen", wq)):  # loaded side by side
                wait_worker(server.url, name, proc)
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
            listed = {m.id for m in client.models.list().data}
            assert listed == {str(llama_dir), str(qwen2_dir)}
            for model in (llama_dir, qwen2_dir):
                for prompt, exp in zip(PROMPTS[:3], expected[model], strict=True):
                    r = client.chat.completions.create(
                        model=str(model),
                        messages=[{"role": "user", "content": prompt}],
                        max_tokens=16,
                        temperature=0,
                        extra_body={"ignore_eos": True},
                    )
                    assert r.choices[0].message.content == exp
            assert client.models.retrieve(str(qwen2_dir)).id == str(qwen2_dir)
            wq.kill()
            wait_for(
                lambda: not heartbeat(server.url, "w-qwen"), 10, "the qwen2 heartbeat to expire"
            )
            started = time.monotonic()
            with pytest.raises(openai.APIStatusError) as info:
                client.chat.completions.create(
                    model=str(qwen2_dir), messages=[{"role": "user", "content": "hi"}], max_tokens=4
                )
            assert info.value.status_code == 503
            assert info.value.response.headers.get("retry-after")
            assert time.monotonic() - started < 20
            r = client.chat.completions.create(
                model=str(llama_dir),
                messages=[{"role": "user", "content": PROMPTS[0]}],
                max_tokens=16,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            assert r.choices[0].message.content == expected[llama_dir][0]
            with pytest.raises(openai.NotFoundError):
                client.chat.completions.create(
                    model="never-served", messages=[{"role": "user", "content": "hi"}], max_tokens=4
                )
        finally:
            wq.kill()
            kill_all([api, wl])


# ---- 3. two API replicas --------------------------------------------------------------------
async def burst(model: str, urls: tuple[str, str], worker: Proc, running, waiting) -> list[int]:
    """60 requests across both replicas while the worker (one sequence at a time) is busy with
    a long request, then frozen: it pulls nothing while the burst lands, so what was accepted
    is what the queue holds. Each request's status; 0: accepted, still queued."""
    async with httpx.AsyncClient(timeout=60) as http:
        long = {"model": model, "prompt": "busy", "max_tokens": 1900, "ignore_eos": True}
        blocker = asyncio.create_task(http.post(f"{urls[0]}/v1/completions", json=long))
        await asyncio.to_thread(wait_for, running, 10, "busy")
        worker.proc.send_signal(signal.SIGSTOP)

        async def one(i: int) -> int:
            body = {"model": model, "prompt": f"q{i}", "max_tokens": 4}
            resp = await http.post(f"{urls[i % 2]}/v1/completions", json=body, timeout=30)
            return resp.status_code

        calls = [asyncio.create_task(one(i)) for i in range(60)]
        try:
            # Every request answered (refused) or waiting in the queue: those still open then
            # are the accepted ones, queued behind the frozen worker.
            await asyncio.to_thread(
                wait_for,
                lambda: sum(c.done() for c in calls) + waiting() >= len(calls),
                30,
                "each request refused or queued",
                0.05,
            )
            return [c.result() if c.done() else 0 for c in calls]
        finally:
            for c in [*calls, blocker]:
                c.cancel()


def test_two_api_replicas_share_cancels_and_one_queue_limit(llama_dir, tmp_path):
    with RedisServer() as server:
        # torch's ops, not llmq's C++ kernels: with those the tiny model makes its long
        # requests (1,500 tokens) in under the second a heartbeat takes to show them running.
        worker = start_worker(
            server.url, llama_dir, "w-rep", tmp_path, wait=False, heartbeat_ttl=60,
            max_batch_size=1, cpu_kernels=False,
        )  # fmt: skip
        limit = 10
        a, url_a = start_api(server.url, llama_dir, tmp_path, max_queue=limit)
        b, url_b = start_api(server.url, llama_dir, tmp_path, max_queue=limit)
        r = redis.Redis.from_url(server.url)
        stream = Keys().requests(str(llama_dir))
        try:
            wait_worker(server.url, "w-rep", worker)  # loaded while the APIs started
            # A stream opened on replica A and dropped by its client frees its blocks.
            body = {"model": str(llama_dir), "prompt": "hello", "max_tokens": 1500}
            body |= {"stream": True, "ignore_eos": True}

            def running() -> bool:
                return heartbeat(server.url, "w-rep").get("running") == "1"

            with httpx.stream("POST", f"{url_a}/v1/completions", json=body, timeout=30) as resp:
                lines = resp.iter_lines()
                for _ in range(6):
                    next(lines)
                wait_for(running, 3, "running")
                # Paused while its client leaves, the worker cannot finish the request first.
                worker.proc.send_signal(signal.SIGSTOP)
            (rid,) = request_ids(r)
            state = lambda: r.hget(f"llmq:req:{rid}", "state")  # noqa: E731
            wait_for(lambda: state() == b"cancelled", 5, "the cancel recorded")
            worker.proc.send_signal(signal.SIGCONT)
            dropped = time.time()

            def freed() -> bool:
                beat = heartbeat(server.url, "w-rep")
                return float(beat.get("updated", 0)) > dropped and beat["kv_blocks_used"] == "0"

            wait_for(freed, 3, "blocks freed")
            assert time.time() - dropped < 1.5
            assert len(recorded_tokens(r, rid)) < 1500

            # A burst split across both replicas meets one global limit.
            def waiting() -> int:  # the requests queued: in the stream, taken by no engine
                return r.xlen(stream) - r.xpending(stream, "engines")["pending"]

            try:
                codes = asyncio.run(burst(str(llama_dir), (url_a, url_b), worker, running, waiting))
                queued = waiting()
                metrics = httpx.get(f"{url_b}/metrics", timeout=10).text
            finally:
                worker.proc.send_signal(signal.SIGCONT)
            label = f'{{model_name="{llama_dir}"}}'
            assert f"llmq:queue_lag{label} {float(limit)}" in metrics
            assert f"llmq:queue_pending{label} 1.0" in metrics
            assert f"llmq:num_engines{label} 1.0" in metrics
            assert set(codes) <= {0, 429}, codes
            assert codes.count(0) == limit, codes
            assert queued == limit
        finally:
            kill_all([a, b, worker])


# ---- 4. a worker that joins late --------------------------------------------------------------
BACKLOG = 8  # requests kept waiting in the stream until the late worker takes one


def test_three_workers_one_joining_late(llama_dir, tmp_path):
    with RedisServer() as server:
        # One sequence per worker, and a backlog kept up until the late worker takes work.
        settings = dict(max_batch_size=1, torch_threads=1)
        w1 = start_worker(server.url, llama_dir, "w1", tmp_path, wait=False, **settings)
        w2 = start_worker(server.url, llama_dir, "w2", tmp_path, wait=False, **settings)
        api, url = start_api(server.url, llama_dir, tmp_path)
        for name, proc in (("w1", w1), ("w2", w2)):  # loaded side by side
            wait_worker(server.url, name, proc)
        r, stream = redis.Redis.from_url(server.url), Keys().requests(str(llama_dir))
        body = {"model": str(llama_dir), "prompt": "x", "max_tokens": 300, "ignore_eos": True}

        async def feed(http: httpx.AsyncClient, took: asyncio.Event) -> list[httpx.Response]:
            """BACKLOG requests waiting beside the two running until w3 takes work: it outlasts
            w3's start however fast w1 and w2 go, and little is left to finish after."""
            sent: list[asyncio.Task] = []
            while not took.is_set():
                short = BACKLOG + 2 - sum(not t.done() for t in sent)
                sent += [
                    asyncio.create_task(http.post(f"{url}/v1/completions", json=body))
                    for _ in range(short)
                ]
                await asyncio.sleep(0.05)
            return list(await asyncio.gather(*sent))

        async def scenario():
            took_work = asyncio.Event()
            async with httpx.AsyncClient(timeout=300) as http:
                feeding = asyncio.create_task(feed(http, took_work))
                try:
                    await asyncio.to_thread(
                        wait_for, lambda: r.xlen(stream) >= BACKLOG, 30, "a backlog", 0.05
                    )
                    w3 = await asyncio.to_thread(
                        start_worker, server.url, llama_dir, "w3", tmp_path, wait=False, **settings
                    )
                    joined = await asyncio.to_thread(
                        wait_for,
                        lambda: r.exists("llmq:engines:w3") and time.monotonic(),
                        120,
                        "w3",
                        0.01,
                    )
                    took = await asyncio.to_thread(
                        wait_for,
                        lambda: (
                            int(heartbeat(server.url, "w3").get("requests_total", 0)) > 0
                            and time.monotonic()
                        ),
                        10,
                        "w3 to take work",
                        0.02,
                    )
                finally:
                    took_work.set()
                responses = await feeding
            return [x.status_code for x in responses], took - joined, w3

        codes, delay, w3 = asyncio.run(scenario())
        try:
            assert len(codes) >= BACKLOG + 2 and set(codes) == {200}
            # The heartbeat refreshes once a second, so this bounds "took work within a second".
            assert delay < 2.0, f"w3 took {delay:.2f}s to take work"
            counts = {
                w: int(heartbeat(server.url, w)["requests_total"]) for w in ("w1", "w2", "w3")
            }
            assert all(c > 0 for c in counts.values()), counts
        finally:
            kill_all([api, w1, w2, w3])
