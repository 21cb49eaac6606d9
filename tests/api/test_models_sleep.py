"""Sleep and wake, memory after an unload, and a request's deadline while it waits for a load,
against real processes: one worker of LLMQ_CATALOGUE (the real SmolLM2-135M-Instruct, Q4_1 GGUF
of ``tests/real_models.py``, and a tiny random Llama; room for one) and an API.

The tiny model answers as transformers' generate; SmolLM2's first request evicts it and waits
for SmolLM2's load. A model put to sleep gives its memory back (the worker's RSS falls by most of what its load
added) and is listed as sleeping; the next request wakes it on the same worker and gets the same
greedy token ids as before. ``keep_alive: 0`` unloads it and the RSS falls back near its idle
figure. A request for a catalogue model no worker can load ends at its deadline with the error
every deadline gives."""

from __future__ import annotations

import contextlib
import json
import re
import time
from pathlib import Path

import httpx
import ollama
import pytest
import redis

from llmq.common.catalogue import fresh_residents, model_size, scan
from llmq.common.transport import Keys
from llmq.common.transport.redis_server import RedisServer
from tests import real_models
from tests.harness import kill_all, llmq_inspect, rss_bytes, start_api, start_worker, wait_for

KEYS = Keys("llmq")
PROMPT = "The capital of France is"
TINY_PROMPT = [5, 17, 42, 99, 7]
# The worker's RSS after an unload or a sleep, against its idle figure: within 15% (5-8%
# measured with SmolLM2: docs/models-on-demand.md, "Memory after an unload"; 10.1% on a fresh
# clone under a full suite's load, 498 -> 548 MB), and no more than 15 MB over the one before
# (the check a leak fails: a model left referenced keeps ~100 MB resident; pymalloc's arenas
# kept 15-20% and 8 MB more a cycle).
UNLOADED_OVER_IDLE = 1.15
UNLOAD_CREEP_MB = 15


def rss_mb(pid: int) -> float:
    return rss_bytes(pid) / 2**20


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, model_dir):
    """Redis, a worker of a catalogue of SmolLM2 and a tiny random Llama (``alpha``) with room
    for SmolLM2 alone, and an API."""
    gguf = real_models.smollm2_gguf()
    folder = tmp_path_factory.mktemp("sleep-catalogue")
    (folder / gguf.name).symlink_to(gguf)
    (folder / "alpha").symlink_to(model_dir("llama"))
    name = next(n for n in scan(str(folder)) if n != "alpha")
    budget = (model_size(gguf) + model_size(folder / "alpha") / 2) / 2**20  # not both
    logs = tmp_path_factory.mktemp("sleep-logs")
    procs = []
    with RedisServer() as server:
        try:
            r = redis.Redis.from_url(server.url)
            worker = start_worker(
                server.url, gguf, "w1", logs, wait=False, catalogue=folder, model_memory_mb=budget
            )
            procs.append(worker)
            wait_for(lambda: fresh_residents(r.hgetall(KEYS.resident)), 120, "the worker")
            api, base = start_api(server.url, gguf, logs, request_timeout=300)
            procs.append(api)
            idle = rss_mb(worker.proc.pid)  # the worker's start is long done by the API's
            yield dict(
                r=r, url=server.url, base=base, worker=worker, name=name, gguf=gguf, idle=idle
            )
        finally:
            kill_all(procs)


def greedy_ids(base: str, model: str, **extra) -> list[int]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    body |= {"logprobs": 0, "return_tokens_as_token_ids": True, "ignore_eos": True, **extra}
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return [int(t.removeprefix("token_id:")) for t in r.json()["choices"][0]["logprobs"]["tokens"]]


def served_ids(base: str, model: str, prompt: list[int]) -> list[int]:
    body = {"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0}
    body |= {"logprobs": 0, "return_tokens_as_token_ids": True, "ignore_eos": True}
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return [int(t.removeprefix("token_id:")) for t in r.json()["choices"][0]["logprobs"]["tokens"]]


def generated_ids(path: Path, prompt: list[int]) -> list[int]:
    """transformers' greedy generate of the float32 model at ``path``."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=6, min_new_tokens=6, do_sample=False
    )
    return out[0, len(prompt) :].tolist()


def record(r) -> dict:
    return json.loads(r.hget(KEYS.resident, "w1"))


def settled_rss(pid: int, bound: float) -> float:
    """The RSS once it is within ``bound`` MiB, or what it is after 10 s: the unload's
    collection and trim are done before its record is published, but a busy host may show the
    pages given back a moment later."""
    reading = {}

    def within() -> bool:
        reading["mb"] = rss_mb(pid)
        return reading["mb"] <= bound

    with contextlib.suppress(TimeoutError):
        wait_for(within, 10, "the RSS", 0.1)
    return reading["mb"]


def test_a_request_for_smollm2_evicts_the_tiny_model_and_waits_for_its_load(fleet, model_dir):
    """Room for one: the tiny model answers as transformers' generate, then SmolLM2's first
    request waits while the worker evicts it and loads SmolLM2."""
    base, name = fleet["base"], fleet["name"]
    assert served_ids(base, "alpha", TINY_PROMPT) == generated_ids(model_dir("llama"), TINY_PROMPT)
    assert len(greedy_ids(base, name)) == 12
    assert set(record(fleet["r"])["models"]) == {name}
    log = fleet["worker"].log(100_000)
    assert f"unloaded alpha (evicted for {name})" in log and f"loaded {name} in" in log


def test_sleep_frees_memory_and_wake_answers_as_before(fleet):
    base, name, pid = fleet["base"], fleet["name"], fleet["worker"].proc.pid
    before = greedy_ids(base, name)
    loaded = rss_mb(pid)
    asked = httpx.post(f"{base}/models/sleep", json={"model": name}, timeout=60)
    assert asked.json() == {"model": name, "state": "sleeping"}, asked.text
    assert name in record(fleet["r"])["asleep"] and not record(fleet["r"])["models"]
    asleep = fleet["asleep_rss"] = settled_rss(pid, fleet["idle"] * UNLOADED_OVER_IDLE)
    # SmolLM2's weights (~100 MB resident) and KV cache go: back near the idle worker's RSS.
    assert loaded - asleep > 60, (loaded, asleep)
    assert asleep <= fleet["idle"] * UNLOADED_OVER_IDLE, (fleet["idle"], asleep)
    sleeping = httpx.get(f"{base}/models/is_sleeping", params={"model": name}).json()
    assert sleeping["is_sleeping"] is True
    card = httpx.get(f"{base}/v1/models/{name}").json()
    assert card["state"] == "sleeping" and card["workers"] == ["w1"], card
    shown = llmq_inspect(fleet["url"])
    assert re.search(rf"{name} \(\d+ MB\): sleeping on w1", shown), shown
    assert greedy_ids(base, name) == before  # woken by the request, as for a load
    assert "woke smollm2-135m-instruct in" in fleet["worker"].log(100_000)
    assert httpx.get(f"{base}/models/is_sleeping", params={"model": name}).json() == {
        "model": name,
        "is_sleeping": False,
        "state": "ready",
    }


def test_keep_alive_zero_gives_the_memory_back(fleet):
    """``keep_alive: 0`` unloads the model once answered (loaded first where the test before
    left it asleep); the RSS comes back within 15% of the idle worker's, and within
    UNLOAD_CREEP_MB of its figure after the sleep before."""
    base, name, pid = fleet["base"], fleet["name"], fleet["worker"].proc.pid
    oc = ollama.Client(host=base, timeout=300)
    answer = oc.generate(model=name, prompt=PROMPT, keep_alive=0, options={"num_predict": 4})
    assert answer.done
    wait_for(lambda: not record(fleet["r"])["models"], 60, "unloaded at once")
    bound = fleet["idle"] * UNLOADED_OVER_IDLE
    if "asleep_rss" in fleet:
        bound = min(bound, fleet["asleep_rss"] + UNLOAD_CREEP_MB)
    unloaded = settled_rss(pid, bound)
    assert unloaded <= fleet["idle"] * UNLOADED_OVER_IDLE, (fleet["idle"], unloaded)
    if "asleep_rss" in fleet:  # the two give back the same memory, by the same code
        assert unloaded - fleet["asleep_rss"] < UNLOAD_CREEP_MB, (fleet["asleep_rss"], unloaded)
    assert "still referenced" not in fleet["worker"].log(100_000)


def test_a_request_waiting_for_a_load_ends_at_its_deadline(fleet, tmp_path):
    """A catalogue model no worker has room for (published by a worker gone): the wait for its
    load ends at the request's deadline (LLMQ_REQUEST_TIMEOUT from its arrival), 504 with the
    message any request past its deadline gets."""
    r = fleet["r"]
    ghost = {"name": "ghost", "source": str(fleet["gguf"]), "size": 1 << 20}
    r.hset(KEYS.catalogue, "ghost", json.dumps(ghost))
    api, base = start_api(fleet["url"], fleet["gguf"], tmp_path, "api-deadline", request_timeout=2)
    try:
        started = time.monotonic()
        body = {"model": "ghost", "prompt": PROMPT, "max_tokens": 4}
        answer = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
        waited = time.monotonic() - started
    finally:
        r.hdel(KEYS.catalogue, "ghost")
        kill_all([api])
    assert answer.status_code == 504, answer.text
    error = answer.json()["error"]
    assert error["code"] == "deadline_exceeded" and error["type"] == "timeout", error
    assert error["message"].startswith("the request did not finish within 2s: no worker loaded")
    assert 2.0 <= waited < 4.0, waited
