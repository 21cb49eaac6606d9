"""LoRA adapters through the real API: configured at start and loaded at run time, named as
models on every generation route, owned by the key that loaded them, and each request's
greedy output equal to PEFT's model generating in float32."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
from pathlib import Path

import httpx
import pytest
import torch

from tests.api.api_stack import aclient, assert_error, batch_results, client, stack
from tests.harness import start_worker, wait_for
from tests.lora_model import make_adapter

KEY, OTHER = "sk-lora-one", "sk-lora-two"
NEW_TOKENS = 8
LONG_TOKENS = 120  # the killed worker's streams: long enough to be cut mid-way
WORKER = dict(max_loras=2, max_lora_rank=16, heartbeat_ttl=2, inactivity_timeout=120)
PROMPTS = [[5, 17, 33, 2, 90, 41, 7], list(range(40, 76)), [11, 12, 13, 14]]


@pytest.fixture(scope="module")
def adapters(llama_dir, tmp_path_factory) -> dict[str, Path]:
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("loras")
    base = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    return {
        "sql": make_adapter(base, root / "sql", rank=8, seed=1),
        "chat": make_adapter(base, root / "chat", rank=16, seed=2, use_rslora=True),
        "mine": make_adapter(base, root / "mine", rank=8, seed=3, targets=["q_proj"]),
        "wide": make_adapter(base, root / "wide", rank=32, seed=4),
        "dora": make_adapter(base, root / "dora", rank=8, seed=5, use_dora=True),
    }


@pytest.fixture(scope="module")
def references(llama_dir, adapters) -> dict[str | None, list[str]]:
    """Greedy text of each prompt from transformers' generate: the base model, and the base
    with each adapter through PEFT (float32)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(llama_dir)

    def run(model, new_tokens: int = NEW_TOKENS) -> list[str]:
        outs = []
        with torch.inference_mode():
            for p in PROMPTS:
                out = model.generate(
                    torch.tensor([p]),
                    attention_mask=torch.ones(1, len(p), dtype=torch.long),
                    max_new_tokens=new_tokens,
                    do_sample=False,
                    eos_token_id=None,
                    pad_token_id=0,
                )
                outs.append(tok.decode(out[0, len(p) :], skip_special_tokens=True))
        return outs

    base = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    refs: dict[str | None, list[str]] = {None: run(base)}
    peft = PeftModel.from_pretrained(base, adapters["sql"], adapter_name="sql")
    for name in ("sql", "chat", "mine"):
        if name != "sql":
            peft.load_adapter(adapters[name], adapter_name=name)
        peft.set_adapter(name)
        refs[name] = run(peft)
        if name != "mine":
            refs[f"{name}-long"] = run(peft, LONG_TOKENS)
    for name in ("sql", "chat", "mine"):
        assert refs[name] != refs[None], f"adapter {name} changes nothing: the test is blind"
    return refs


@pytest.fixture(scope="module")
def lora_stack(llama_dir, adapters, tmp_path_factory):
    worker = _settings(adapters)
    # The last test kills the only worker: requests wait for its successor.
    api = dict(api_key=f"{KEY},{OTHER}", max_lora_rank=16, no_worker_grace=120)
    logs = tmp_path_factory.mktemp("lora-logs")
    with stack(llama_dir, logs, "w-lora", worker, api) as s:
        yield s


def _post(s, path: str, body: dict, key: str = KEY) -> httpx.Response:
    return httpx.post(
        f"{s.base}{path}", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60
    )


async def _greedy(base: str, model: str, prompt: list[int], key: str = KEY) -> str:
    async with aclient(base, key) as c:
        r = await c.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=NEW_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
    assert r.model == model
    return r.choices[0].text


def test_configured_adapters_are_listed_as_models_of_their_base(lora_stack):
    for key in (KEY, OTHER):
        cards = {m.id: m for m in client(lora_stack.base, key).models.list().data}
        assert cards["sql"].parent == lora_stack.model
        assert cards["chat"].parent == lora_stack.model
        assert getattr(cards[lora_stack.model], "parent", None) is None


def test_adapters_and_the_base_in_one_batch_each_equal_their_reference(lora_stack, references):
    base = lora_stack.model
    jobs = [(m, i) for m in (base, "sql", "chat") for i in range(len(PROMPTS))] * 2

    async def all_of():
        return await asyncio.gather(*(_greedy(lora_stack.base, m, PROMPTS[i]) for m, i in jobs))

    outs = asyncio.run(all_of())
    for (model, i), out in zip(jobs, outs, strict=True):
        assert out == references[None if model == base else model][i], (model, i)

    # The heartbeat shows both once it is written after their loads (once a second).
    def loaded() -> set[str]:
        return set(lora_stack.heartbeat()["loras"].split(","))

    wait_for(lambda: loaded() == {"sql", "chat"}, 10, "both adapters in the heartbeat")


def test_an_adapter_never_shares_the_base_models_cached_prefix(lora_stack):
    text = " ".join(f"word{i}" for i in range(40))  # several full blocks
    c = client(lora_stack.base, KEY)

    def cached(model: str) -> int:
        messages = [{"role": "user", "content": text}]
        r = c.chat.completions.create(model=model, messages=messages, max_tokens=1)
        assert r.usage.prompt_tokens > 32
        details = r.usage.prompt_tokens_details  # absent: none cached
        return details.cached_tokens if details else 0

    cached(lora_stack.model)
    assert cached(lora_stack.model) > 0  # the base's own blocks are found
    assert cached("sql") == 0  # not the adapter's: same tokens, another adapter's cache
    assert cached("sql") > 0
    assert cached("chat") == 0


def test_chat_responses_and_batch_lines_take_an_adapter(lora_stack):
    c = client(lora_stack.base, KEY)
    messages = [{"role": "user", "content": "name a table"}]
    greedy = {"temperature": 0, "max_tokens": NEW_TOKENS}
    chat = c.chat.completions.create(model="sql", messages=messages, **greedy)
    assert chat.model == "sql"
    bare = c.chat.completions.create(model=lora_stack.model, messages=messages, **greedy)
    assert chat.choices[0].message.content != bare.choices[0].message.content
    resp = c.responses.create(
        model="sql", input=messages, temperature=0, max_output_tokens=NEW_TOKENS
    )
    assert resp.model == "sql" and resp.output_text == chat.choices[0].message.content
    body = {"model": "sql", "messages": messages, **greedy}
    results = batch_results(c, "/v1/chat/completions", [("q1", body)])
    line = results["q1"]
    assert line["status_code"] == 200, line
    assert line["body"]["choices"][0]["message"]["content"] == chat.choices[0].message.content


def test_an_adapter_loaded_at_run_time_is_its_keys_alone(lora_stack, adapters, references):
    s = lora_stack
    r = _post(s, "/v1/load_lora_adapter", {"lora_name": "mine", "lora_path": str(adapters["mine"])})
    assert r.status_code == 200 and "mine" in r.text
    assert "mine" in {m.id for m in client(s.base, KEY).models.list().data}
    assert "mine" not in {m.id for m in client(s.base, OTHER).models.list().data}
    assert asyncio.run(_greedy(s.base, "mine", PROMPTS[0])) == references["mine"][0]
    body = {"model": "mine", "prompt": "x", "max_tokens": 1}
    assert_error(_post(s, "/v1/completions", body, OTHER), 404, code="model_not_found")
    again = _post(s, "/v1/load_lora_adapter", {"lora_name": "mine", "lora_path": "/x"})
    assert_error(again, 400, code="lora_exists")
    assert_error(_post(s, "/v1/unload_lora_adapter", {"lora_name": "mine"}, OTHER), 404)
    assert _post(s, "/v1/unload_lora_adapter", {"lora_name": "mine"}).status_code == 200
    assert_error(_post(s, "/v1/completions", body), 404, code="model_not_found")
    configured = _post(s, "/v1/unload_lora_adapter", {"lora_name": "sql"})
    assert_error(configured, 403, code="permission_denied")


@pytest.mark.parametrize(
    "name, why",
    [("wide", "exceeds LLMQ_MAX_LORA_RANK=16"), ("dora", "DoRA"), ("nowhere", "adapter_config")],
)
def test_an_adapter_that_cannot_be_applied_is_refused_at_load(lora_stack, adapters, name, why):
    path = str(adapters.get(name, Path("/nonexistent")))
    r = _post(lora_stack, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
    err = assert_error(r, 400, code="invalid_lora_adapter")
    assert why in err["message"]
    assert name not in {m.id for m in client(lora_stack.base, KEY).models.list().data}


def test_a_corrupt_adapter_fails_its_requests_alone(lora_stack, adapters, tmp_path, references):
    s = lora_stack
    broken = tmp_path / "broken"
    shutil.copytree(adapters["mine"], broken)
    r = _post(s, "/v1/load_lora_adapter", {"lora_name": "broken", "lora_path": str(broken)})
    assert r.status_code == 200
    # Corrupted after it was offered: the worker finds out when it reads the weights.
    data = (broken / "adapter_model.safetensors").read_bytes()
    header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    assert header
    (broken / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])

    async def both():
        bad = _greedy(s.base, "broken", PROMPTS[0])
        good = _greedy(s.base, "sql", PROMPTS[0])
        return await asyncio.gather(bad, good, return_exceptions=True)

    bad, good = asyncio.run(both())
    assert good == references["sql"][0]
    assert isinstance(bad, Exception) and "broken" in str(bad), bad
    _post(s, "/v1/unload_lora_adapter", {"lora_name": "broken"})


def test_the_least_recently_used_adapter_is_dropped_and_read_again(
    lora_stack, adapters, references
):
    s = lora_stack  # max_loras=2: a third adapter drops one, asked again it is read again
    r = _post(s, "/v1/load_lora_adapter", {"lora_name": "mine", "lora_path": str(adapters["mine"])})
    assert r.status_code == 200
    for model in ("sql", "chat", "mine", "sql", "chat"):
        assert asyncio.run(_greedy(s.base, model, PROMPTS[2])) == references[model][2], model
    wait_for(lambda: len(s.heartbeat()["loras"].split(",")) == 2, 10, "two loaded adapters")
    _post(s, "/v1/unload_lora_adapter", {"lora_name": "mine"})


def test_adapter_streams_resume_exactly_when_their_worker_is_killed(
    lora_stack, llama_dir, adapters, references
):
    """The only worker frozen mid-stream, killed, and a new one started: every adapter stream
    ends with the text its adapter gives, no token lost or repeated."""
    s = lora_stack
    jobs = [("sql", i) for i in range(len(PROMPTS))] + [("chat", i) for i in range(len(PROMPTS))]
    received: list[list[str]] = [[] for _ in jobs]

    async def stream(k: int) -> str:
        model, i = jobs[k]
        async with aclient(s.base, KEY, timeout=180) as c:
            chunks = await c.completions.create(
                model=model,
                prompt=PROMPTS[i],
                max_tokens=LONG_TOKENS,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            async for chunk in chunks:
                received[k].append(chunk.choices[0].text if chunk.choices else "")
        return "".join(received[k])

    async def run():
        tasks = [asyncio.create_task(stream(k)) for k in range(len(jobs))]
        while not all(len(r) >= 2 for r in received):
            await asyncio.sleep(0.01)
        os.kill(s.worker.proc.pid, signal.SIGSTOP)  # mid-stream, for certain
        cut = ["".join(r) for r in received]
        s.worker.kill()
        successor = await asyncio.to_thread(
            start_worker, s.redis_url, llama_dir, "w-lora-2", s.logs, **_settings(adapters)
        )
        try:
            return await asyncio.gather(*tasks), cut
        finally:
            await asyncio.to_thread(successor.terminate)

    texts, cut = asyncio.run(run())
    expected = [references[f"{model}-long"][i] for model, i in jobs]
    assert any(c != e for c, e in zip(cut, expected, strict=True)), "nothing was cut"
    assert texts == expected


def _settings(adapters) -> dict:
    return dict(WORKER, lora_modules=f"sql={adapters['sql']},chat={adapters['chat']}")
