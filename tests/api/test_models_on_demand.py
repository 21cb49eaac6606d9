"""Models on demand against real processes: two workers of LLMQ_CATALOGUE (a folder of three
tiny random models, Llama, Qwen2 and Gemma 3, and a corrupt GGUF file), each with memory for
one model, and an API. Requests for all three are answered (each waits for a load, the third
evicts the least recently used), greedy as transformers' generate; keep_alive 0 unloads and the
workers' RSS falls back near its idle figure; the corrupt file answers with a clear error; a
worker SIGKILLed while loading leaves the model to the other; the ollama package's ps, list and
chat work on models not loaded."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import ollama
import openai
import pytest
import redis

from llmq.common.catalogue import fresh_residents, model_size
from llmq.common.transport import Keys
from llmq.common.transport.redis_server import RedisServer
from tests.harness import LLMQ, kill_all, start_api, start_worker, wait_for

KEYS = Keys("llmq")
NAMES = ("alpha", "beta", "gamma")
PROMPT = [5, 17, 42, 99, 7]
MAX_TOKENS = 6


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def fleet(model_dir, tmp_path_factory):
    """Redis, two catalogue workers (budget: one model each) and an API."""
    folder = tmp_path_factory.mktemp("catalogue")
    sources = dict(zip(NAMES, ("llama", "qwen2", "gemma3"), strict=True))
    for name, arch in sources.items():
        (folder / name).symlink_to(model_dir(arch))
    (folder / "broken.gguf").write_bytes(b"GGUF" + os.urandom(2048))
    biggest = max(model_size(folder / n) for n in NAMES)
    logs = tmp_path_factory.mktemp("on-demand-logs")
    settings = dict(catalogue=folder, model_memory_mb=biggest * 1.5 / 2**20, heartbeat_ttl=2)
    procs = []
    with RedisServer() as server:
        try:
            r = redis.Redis.from_url(server.url)
            for name in ("w1", "w2"):
                procs.append(start_worker(server.url, folder, name, logs, wait=False, **settings))
            wait_for(lambda: len(fresh_residents(r.hgetall(KEYS.resident))) == 2, 90, "workers")
            idle = {p.proc.pid: rss(p.proc.pid) for p in procs}
            api, base = start_api(server.url, folder / "alpha", logs)
            procs.append(api)
            yield dict(r=r, url=server.url, base=base, workers=procs[:2], idle=idle, dirs=sources)
        finally:
            kill_all(procs)


def held(r) -> dict[str, list[str]]:
    """Worker -> the models it holds."""
    return {
        w: sorted(rec["models"]) for w, rec in fresh_residents(r.hgetall(KEYS.resident)).items()
    }


def reference(model_dir, arch: str) -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = model_dir(arch)
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    out = model.generate(
        torch.tensor([PROMPT]),
        max_new_tokens=MAX_TOKENS,
        min_new_tokens=MAX_TOKENS,
        do_sample=False,
    )
    tok = AutoTokenizer.from_pretrained(path)
    return tok.decode(out[0, len(PROMPT) :], skip_special_tokens=True)


def complete(base: str, model: str) -> str:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", timeout=120, max_retries=0)
    answer = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    return answer.choices[0].text


def models(base: str) -> dict[str, dict]:
    return {m["id"]: m for m in httpx.get(f"{base}/v1/models").json()["data"]}


def test_catalogue_listed_with_states(fleet):
    listed = models(fleet["base"])
    assert {listed[n]["state"] for n in (*NAMES, "broken")} == {"available"}
    tags = {m.model for m in ollama.Client(host=fleet["base"]).list().models}
    assert {*NAMES, "broken"} <= tags


def test_three_models_on_two_workers(fleet, model_dir):
    """Each request waits for a load; the third evicts the least recently used model."""
    for name in NAMES:
        assert complete(fleet["base"], name) == reference(model_dir, fleet["dirs"][name]), name
    holding = held(fleet["r"])
    assert sorted(m for ms in holding.values() for m in ms) == ["beta", "gamma"]
    listed = models(fleet["base"])
    assert listed["gamma"]["state"] == "ready" and len(listed["gamma"]["workers"]) == 1
    assert listed["alpha"]["state"] == "available"
    logs = "".join(w.log(100_000) for w in fleet["workers"])
    assert "unloaded alpha (evicted for gamma)" in logs and "loaded gamma in" in logs
    shown = subprocess.run(
        [LLMQ, "inspect"],
        env={**os.environ, "LLMQ_REDIS_URL": fleet["url"]},
        text=True,
        capture_output=True,
        check=True,
    ).stdout
    assert re.search(r"gamma \(\d+ MB\): ready on w[12]", shown), shown
    assert re.search(r"alpha \(\d+ MB\): available", shown), shown


def test_ollama_ps_generate_load_and_unload(fleet):
    oc = ollama.Client(host=fleet["base"], timeout=120)
    loaded = oc.generate(model="alpha", prompt="")
    assert loaded.done_reason == "load"
    ps = {m.model: m for m in oc.ps().models}
    assert "alpha" in ps and ps["alpha"].expires_at.year < 2300  # the default 5 minutes
    assert oc.generate(model="alpha", prompt="", keep_alive=0).done_reason == "unload"
    wait_for(lambda: "alpha" not in {m.model for m in oc.ps().models}, 30, "alpha unloaded")


def test_keep_alive_zero_unloads_and_memory_returns(fleet):
    for name in ("beta", "gamma"):
        httpx.post(f"{fleet['base']}/models/unload", json={"model": name}).raise_for_status()
    wait_for(lambda: not any(held(fleet["r"]).values()), 30, "every model unloaded")
    oc = ollama.Client(host=fleet["base"], timeout=120)
    answer = oc.chat(
        model="beta",
        messages=[{"role": "user", "content": "hi"}],
        keep_alive=0,
        options={"num_predict": 4},
    )
    assert answer.done
    wait_for(lambda: not any(held(fleet["r"]).values()), 30, "beta unloaded at once")
    for pid, idle in fleet["idle"].items():
        assert rss(pid) <= idle * 1.10, (pid, rss(pid) / 2**20, idle / 2**20)
    # Each unload so far (asked for, keep_alive 0, evicted) let its model go before trimming:
    # a reference left behind kept SmolLM2's 100 MB resident where these tiny models hide it.
    logs = "".join(w.log(100_000) for w in fleet["workers"])
    assert "unloaded beta (" in logs, logs
    assert "still referenced" not in logs, logs


def test_corrupt_file_answers_a_clear_error(fleet):
    client = openai.OpenAI(base_url=f"{fleet['base']}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.InternalServerError) as caught:
        client.completions.create(model="broken", prompt="hi", max_tokens=2)
    assert caught.value.body["code"] == "model_load_failed"
    assert "could not be loaded" in caught.value.body["message"]
    with pytest.raises(ollama.ResponseError) as failed:  # at once: the failure is recent
        ollama.Client(host=fleet["base"]).chat(
            model="broken", messages=[{"role": "user", "content": "hi"}]
        )
    assert "could not be loaded" in failed.value.error


def test_worker_killed_while_loading_leaves_the_model_to_the_other(fleet, model_dir):
    r = fleet["r"]
    wait_for(lambda: not any(held(r).values()), 30, "nothing loaded")
    answers: list[str] = []
    asking = threading.Thread(target=lambda: answers.append(complete(fleet["base"], "gamma")))
    asking.start()
    claimer = wait_for(lambda: r.get(KEYS.load_claim("gamma")), 60, "a load claimed", 0.005)
    worker = next(w for w in fleet["workers"] if w.args[-1] == claimer.decode())
    assert not r.exists(KEYS.engine(f"{claimer.decode()}/gamma")), "loaded before the kill"
    os.killpg(worker.proc.pid, signal.SIGKILL)
    started = time.monotonic()
    asking.join(120)
    assert answers == [reference(model_dir, fleet["dirs"]["gamma"])]
    other = "w2" if claimer == b"w1" else "w1"
    assert held(r).get(other) == ["gamma"]
    assert time.monotonic() - started < 30  # the claim's 8 s (4 heartbeat TTLs), a load
    assert json.loads(r.hget(KEYS.resident, other))["models"]["gamma"]
