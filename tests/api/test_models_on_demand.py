"""Models on demand against real processes: two workers of LLMQ_CATALOGUE (a folder of a tiny
random Llama, the real SmolLM2-135M-Instruct Q4_1 and Gemma 3 270M Q4_K_M GGUF files of
``tests/real_models.py``, and a corrupt GGUF file), each with memory for Gemma 3 alone or
SmolLM2 and the tiny model, and an API. Requests for all three are answered (each waits for a
load, Gemma's evicts the least recently used), the tiny model greedy as transformers' generate,
the real ones as transformers' float32 model up to near ties; keep_alive 0 unloads and the
workers' RSS falls back near its idle figure; the corrupt file answers with a clear error; a
worker SIGKILLed while loading leaves the model to the other; the ollama package's ps, list and
chat work on models not loaded."""

from __future__ import annotations

import json
import os
import re
import signal
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
from tests import real_models
from tests.api.test_real_models import Reference, parting
from tests.harness import kill_all, llmq_inspect, rss_bytes, start_api, start_worker, wait_for

KEYS = Keys("llmq")
NAMES = ("alpha", "beta", "gamma")
PROMPT = [5, 17, 42, 99, 7]
MAX_TOKENS = 6
TEXT_PROMPT = "The capital of France is"
REAL_TOKENS = 12


@pytest.fixture(scope="module")
def fleet(model_dir, tmp_path_factory):
    """Redis, two catalogue workers and an API. A worker's budget holds Gemma 3 alone, or
    SmolLM2 with the tiny model: Gemma's load on two busy workers evicts one model."""
    folder = tmp_path_factory.mktemp("catalogue")
    smollm2, gemma3 = real_models.smollm2_gguf(), real_models.gemma3_gguf()
    for gguf in (smollm2, gemma3):  # the float folders cache the tokenizers the API reads
        real_models.float_folder(gguf)
    sources = dict(zip(NAMES, (model_dir("llama"), smollm2, gemma3), strict=True))
    for name, path in sources.items():  # a GGUF file is named by its stem
        (folder / (name + path.suffix)).symlink_to(path)
    (folder / "broken.gguf").write_bytes(b"GGUF" + os.urandom(2048))
    tiny, gemma = model_size(sources["alpha"]), model_size(gemma3)
    assert model_size(smollm2) + tiny < gemma
    logs = tmp_path_factory.mktemp("on-demand-logs")
    budget = (gemma + tiny / 2) / 2**20
    settings = dict(catalogue=folder, model_memory_mb=budget, heartbeat_ttl=2)
    procs = []
    with RedisServer() as server:
        try:
            r = redis.Redis.from_url(server.url)
            for name in ("w1", "w2"):
                procs.append(start_worker(server.url, folder, name, logs, wait=False, **settings))
            wait_for(lambda: len(fresh_residents(r.hgetall(KEYS.resident))) == 2, 90, "workers")
            idle = {p.proc.pid: rss_bytes(p.proc.pid) for p in procs}
            api, base = start_api(server.url, folder / "alpha", logs, request_timeout=300)
            procs.append(api)
            yield dict(
                r=r,
                url=server.url,
                base=base,
                workers=procs[:2],
                idle=idle,
                dirs=sources,
                smallest=model_size(smollm2),
            )
        finally:
            kill_all(procs)


def records(r) -> dict[str, dict]:
    """Worker -> its resident record."""
    return fresh_residents(r.hgetall(KEYS.resident))


def held(r) -> dict[str, list[str]]:
    """Worker -> the models it holds."""
    return {w: sorted(rec["models"]) for w, rec in records(r).items()}


def reference(path: Path) -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    out = model.generate(
        torch.tensor([PROMPT]),
        max_new_tokens=MAX_TOKENS,
        min_new_tokens=MAX_TOKENS,
        do_sample=False,
    )
    tok = AutoTokenizer.from_pretrained(path)
    return tok.decode(out[0, len(PROMPT) :], skip_special_tokens=True)


def complete(
    base: str, model: str, prompt: list[int] = PROMPT, tokens: int = MAX_TOKENS, eos: bool = False
) -> str:
    """The greedy completion of ``prompt``: ``tokens`` of them, or up to the end of sequence
    with ``eos``."""
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", timeout=300, max_retries=0)
    answer = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=tokens,
        temperature=0,
        extra_body={"ignore_eos": not eos},
    )
    return answer.choices[0].text


def agrees(base: str, name: str, gguf: Path) -> str | None:
    """None where the served greedy answer is transformers' float32 one (on the GGUF's float
    folder), or parts from it only at a near tie (as the real-model tests hold); else what is
    wrong."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = real_models.float_folder(gguf)
    tok = AutoTokenizer.from_pretrained(folder)
    prompt = tok.encode(TEXT_PROMPT)
    served: list[str] = []  # asked first: the reference runs while a worker loads the model
    asking = threading.Thread(
        target=lambda: served.append(complete(base, name, prompt, REAL_TOKENS, eos=True))
    )
    asking.start()
    lm = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = lm.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=REAL_TOKENS,
            do_sample=False,
        )
    expected = out[0, len(prompt) :].tolist()
    eos = lm.generation_config.eos_token_id
    if expected and expected[-1] in (eos if isinstance(eos, list) else [eos]):
        expected = expected[:-1]
    asking.join(300)
    assert served, f"no answer from {name}"
    return parting(Reference(lm, tok, [], 0.0), prompt, expected, served[0])


def models(base: str) -> dict[str, dict]:
    return {m["id"]: m for m in httpx.get(f"{base}/v1/models").json()["data"]}


def test_catalogue_listed_with_states(fleet):
    listed = models(fleet["base"])
    assert {listed[n]["state"] for n in (*NAMES, "broken")} == {"available"}
    tags = {m.model for m in ollama.Client(host=fleet["base"]).list().models}
    assert {*NAMES, "broken"} <= tags


def test_three_models_on_two_workers(fleet):
    """SmolLM2 and the tiny model each wait for a load, the tiny one on the other worker (asked
    while SmolLM2 loads: a worker loads one model at a time); Gemma 3's request then evicts the
    least recently used of the two, as the workers' records show it."""
    base, dirs, r = fleet["base"], fleet["dirs"], fleet["r"]
    wrong: list[str | None] = []
    smollm2 = threading.Thread(target=lambda: wrong.append(agrees(base, "beta", dirs["beta"])))
    smollm2.start()
    wait_for(lambda: r.get(KEYS.load_claim("beta")), 60, "SmolLM2's load claimed", 0.005)
    assert complete(base, "alpha") == reference(dirs["alpha"])
    smollm2.join(300)
    assert wrong == [None], wrong
    assert sorted(map(len, held(r).values())) == [1, 1], held(r)
    answered = time.time()
    wait_for(lambda: min(rec["updated"] for rec in records(r).values()) > answered, 30, "records")
    used = {m: v["last_used"] for rec in records(r).values() for m, v in rec["models"].items()}
    lru, kept = sorted(used, key=used.get)
    assert agrees(base, "gamma", dirs["gamma"]) is None
    assert sorted(m for ms in held(r).values() for m in ms) == sorted([kept, "gamma"])
    listed = models(fleet["base"])
    assert listed["gamma"]["state"] == "ready" and len(listed["gamma"]["workers"]) == 1
    assert listed[lru]["state"] == "available"
    logs = "".join(w.log(100_000) for w in fleet["workers"])
    assert f"unloaded {lru} (evicted for gamma)" in logs and "loaded gamma in" in logs
    shown = llmq_inspect(fleet["url"])
    assert re.search(r"gamma \(\d+ MB\): ready on w[12]", shown), shown
    assert re.search(rf"{lru} \(\d+ MB\): available", shown), shown


def test_ollama_ps_generate_load_and_unload(fleet):
    oc = ollama.Client(host=fleet["base"], timeout=120)
    loaded = oc.generate(model="alpha", prompt="")
    assert loaded.done_reason == "load"
    ps = {m.model: m for m in oc.ps().models}
    assert "alpha" in ps and ps["alpha"].expires_at.year < 2300  # the default 5 minutes
    assert oc.generate(model="alpha", prompt="", keep_alive=0).done_reason == "unload"
    wait_for(lambda: "alpha" not in {m.model for m in oc.ps().models}, 30, "alpha unloaded")


def test_keep_alive_zero_unloads_and_memory_returns(fleet):
    for name in NAMES:
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
    # What a first load of the real models leaves stays (the libraries' code paged in, their
    # threads: 23-34 MiB after SmolLM2, more after Gemma 3); a model left loaded or referenced
    # keeps at least SmolLM2's 94 MB.
    grown = {pid: (rss_bytes(pid) - idle) / 2**20 for pid, idle in fleet["idle"].items()}
    assert max(grown.values()) < 0.75 * fleet["smallest"] / 2**20, grown
    # Each unload so far (asked for, keep_alive 0, evicted) let its model go before trimming.
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


def test_worker_killed_while_loading_leaves_the_model_to_the_other(fleet):
    r = fleet["r"]
    wait_for(lambda: not any(held(r).values()), 30, "nothing loaded")
    answers: list[str] = []
    asking = threading.Thread(target=lambda: answers.append(complete(fleet["base"], "alpha")))
    asking.start()
    claimer = wait_for(lambda: r.get(KEYS.load_claim("alpha")), 60, "a load claimed", 0.005)
    worker = next(w for w in fleet["workers"] if w.args[-1] == claimer.decode())
    assert not r.exists(KEYS.engine(f"{claimer.decode()}/alpha")), "loaded before the kill"
    os.killpg(worker.proc.pid, signal.SIGKILL)
    started = time.monotonic()
    asking.join(120)
    assert answers == [reference(fleet["dirs"]["alpha"])]
    other = "w2" if claimer == b"w1" else "w1"
    assert held(r).get(other) == ["alpha"]
    assert time.monotonic() - started < 30  # the claim's 8 s (4 heartbeat TTLs), a load
    assert json.loads(r.hget(KEYS.resident, other))["models"]["alpha"]
