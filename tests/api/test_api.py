"""The OpenAI-compatible API against real processes only: redis-server, `llmq worker`, `llmq api`
(uvicorn) and `llmq up`, driven by the real openai client (sync and async), httpx and
schemathesis. Texts are checked against the in-process engine on the same model folder."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import psutil
import pytest
import redis

from llmq.common.model_loader import eos_token_ids, load_causal_lm, load_tokenizer
from llmq.common.redis_server import RedisServer, free_port
from llmq.common.sampling_params import SamplingParams
from llmq.common.transport import GROUP, Keys
from llmq.tools.up import plan_workers
from llmq.worker.llm_engine import EngineConfig, LLMEngine
from tests.harness import (
    LLMQ,
    Proc,
    heartbeat,
    start_api,
    start_worker,
    up_env,
    wait_for,
    wait_worker,
)

MESSAGES = [
    {"role": "system", "content": "You answer questions about Redis."},
    {"role": "user", "content": "What does XREADGROUP do?"},
]
PROMPT = "def fibonacci(n):"
PROMPT2 = "import asyncio\n\nasync def main():"
IGNORE_EOS = {"ignore_eos": True}
ERROR_KEYS = {"message", "type", "param", "code"}
API_KEY = "sk-llmq-test"


# ---- processes -----------------------------------------------------------------------------
@dataclass
class Stack:
    """One Redis, one worker, and the API processes started on that Redis (by name)."""

    redis_url: str
    worker: Proc
    worker_name: str
    model: str
    logs: Path
    apis: dict[str, tuple[Proc, str]] = field(default_factory=dict)

    @property
    def base(self) -> str:
        return self.apis["main"][1]

    def api(self, name: str, **settings) -> str:
        """Base URL of an API process on this Redis, started on first use."""
        if name not in self.apis:
            self.apis[name] = start_api(
                self.redis_url, self.model, self.logs, f"api-{self.worker_name}-{name}", **settings
            )
        return self.apis[name][1]

    def warm(self, base: str, key: str | None = None) -> None:
        """One request, so that the API has loaded the tokenizer (it does on first use)."""
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        body = {"prompt": "x", "max_tokens": 1}
        r = httpx.post(f"{base}/v1/completions", json=body, headers=headers, timeout=120)
        assert r.status_code == 200, r.text

    def waiting(self, r) -> int:
        """Requests in the model's stream that no engine has taken."""
        pending = r.xpending(self.stream, "engines")["pending"]
        return r.xlen(self.stream) - pending

    @property
    def stream(self) -> str:
        """The model's request stream (one per served model)."""
        return Keys().requests(self.model)

    def redis(self) -> redis.Redis:
        return redis.Redis.from_url(self.redis_url)

    def heartbeat(self) -> dict[str, str]:
        return heartbeat(self.redis_url, self.worker_name)

    def wait_idle(self, timeout: float = 10.0) -> None:
        def idle():
            hb = self.heartbeat()
            return hb.get("kv_blocks_used") == "0" and hb.get("running") == "0"

        wait_for(idle, timeout, "an idle worker", 0.05)


@contextmanager
def stack(model: Path, logs: Path, worker_name: str, worker_settings: dict, api_settings: dict):
    """Redis + `llmq worker` + `llmq api` (started side by side)."""
    with RedisServer() as server:
        worker = start_worker(server.url, model, worker_name, logs, wait=False, **worker_settings)
        s = Stack(server.url, worker, worker_name, str(model), logs)
        try:
            s.api("main", **api_settings)
            wait_worker(server.url, worker_name, worker)
            yield s
        finally:
            for proc, _ in s.apis.values():
                proc.terminate()
            worker.terminate()


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("api-logs")


@pytest.fixture(scope="module")
def main(llama_dir, logs):
    """The shared Redis, worker and API (queue limit 50)."""
    # A long heartbeat TTL: the 429 test stops this worker (SIGSTOP) for a moment.
    with stack(llama_dir, logs, "w-api", dict(heartbeat_ttl=15), dict(max_queue=50)) as s:
        yield s


@pytest.fixture(scope="module")
def small(llama_dir, logs):
    """A second Redis with a worker of a short context (64 tokens): schemathesis' generated
    requests are either refused with 400 or finish fast."""
    with stack(llama_dir, logs, "w-small", dict(max_model_len=64), dict(request_timeout=30)) as s:
        yield s


@dataclass
class Reference:
    tok: object
    engine: LLMEngine

    def chat_ids(self, messages) -> list[int]:
        ids = self.tok.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        return list(ids)

    def ids(self, text: str) -> list[int]:
        return self.tok.encode(text)

    def greedy(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens)
        return self.engine.generate(prompts, params)

    def text(self, tokens: list[int]) -> str:
        return self.tok.decode(tokens, skip_special_tokens=True)


@pytest.fixture(scope="module")
def ref(llama_dir) -> Reference:
    """The in-process engine in float32, as the worker runs in tests."""
    tok = load_tokenizer(str(llama_dir))
    model = load_causal_lm(str(llama_dir), "float32", "cpu")
    return Reference(tok, LLMEngine(model, EngineConfig(num_blocks=512), eos_token_ids(model, tok)))


def client(base: str, key: str = "none", timeout: float = 60) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=timeout)


def aclient(base: str, key: str = "none", timeout: float = 60) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=timeout)


def chat_stream(chunks) -> tuple[dict[int, str], dict[int, str], object]:
    """Texts and finish reasons by choice index, and the usage chunk's usage."""
    texts: dict[int, str] = defaultdict(str)
    finish: dict[int, str] = {}
    usage = None
    for ch in chunks:
        if ch.usage is not None:
            assert ch.choices == [], "usage comes in a chunk of its own"
            usage = ch.usage
        for c in ch.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason is not None:
                assert c.index not in finish, "one finish_reason per choice"
                finish[c.index] = c.finish_reason
    return dict(texts), finish, usage


def completion_stream(chunks) -> tuple[dict[int, str], dict[int, str], object]:
    texts: dict[int, str] = defaultdict(str)
    finish: dict[int, str] = {}
    usage = None
    for ch in chunks:
        if ch.usage is not None:
            assert ch.choices == []
            usage = ch.usage
        for c in ch.choices:
            texts[c.index] += c.text
            if c.finish_reason is not None:
                assert c.index not in finish
                finish[c.index] = c.finish_reason
    return dict(texts), finish, usage


async def alist(stream) -> list:
    return [ch async for ch in stream]


def assert_error(resp: httpx.Response, status: int, **expected) -> dict:
    """The status and OpenAI's error shape; ``expected`` pins type, param, code."""
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == ERROR_KEYS, err
    assert isinstance(err["message"], str) and err["message"], err
    for key, value in expected.items():
        assert err[key] == value, (key, err)
    return err


# ---- 1. chat and completions --------------------------------------------------------------
def test_chat_greedy_equals_engine_sync_async_streaming(main, ref):
    ids = ref.chat_ids(MESSAGES)
    tokens = ref.greedy([ids], 32)[0]
    expected = ref.text(tokens)
    assert len(set(tokens)) > 8, "the reference output is not varied"
    kw = dict(
        model=main.model, messages=MESSAGES, max_tokens=32, temperature=0, extra_body=IGNORE_EOS
    )
    c = client(main.base)

    r = c.chat.completions.create(**kw)
    assert r.object == "chat.completion" and r.model == main.model
    assert len(r.choices) == 1 and r.choices[0].index == 0
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == expected
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(tokens))
    assert r.usage.total_tokens == len(ids) + len(tokens)

    texts, finish, usage = chat_stream(
        c.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    assert texts == {0: expected} and finish == {0: "length"}
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(ids), len(tokens))

    async def run():
        async with aclient(main.base) as ac:
            r = await ac.chat.completions.create(**kw)
            chunks = await alist(await ac.chat.completions.create(**kw, stream=True))
            return r, chunks

    r, chunks = asyncio.run(run())
    assert r.choices[0].message.content == expected
    assert r.usage.completion_tokens == len(tokens)
    texts, finish, usage = chat_stream(chunks)
    assert texts == {0: expected} and finish == {0: "length"} and usage is None


def test_live_engines_come_from_the_registry_not_a_scan(main):
    """The API finds live engines in the registry its workers' heartbeats keep (a sorted set),
    never by a SCAN of the keyspace, whose cost grows with every key Redis holds."""
    r = main.redis()
    r.config_resetstat()
    for path in ("/v1/models", "/ready", "/metrics"):
        assert httpx.get(f"{main.base}{path}", timeout=30).status_code == 200
    body = {"prompt": "x", "max_tokens": 2}
    assert httpx.post(f"{main.base}/v1/completions", json=body, timeout=60).status_code == 200
    time.sleep(1.2)  # the API's engine cache (1 s) expired: one more look
    assert httpx.get(f"{main.base}/ready", timeout=30).json()["engines"] == 1
    stats = r.info("commandstats")
    assert "cmdstat_zrange" in stats and "cmdstat_scan" not in stats, sorted(stats)
    assert r.zscore("llmq:engines", main.worker_name) is not None


def test_completions_greedy_equals_engine(main, ref):
    ids, ids2 = ref.ids(PROMPT), ref.ids(PROMPT2)
    tokens, tokens2 = ref.greedy([ids, ids2], 24)
    expected, expected2 = ref.text(tokens), ref.text(tokens2)
    assert expected != expected2
    kw = dict(model=main.model, max_tokens=24, temperature=0, extra_body=IGNORE_EOS)
    c = client(main.base)

    r = c.completions.create(prompt=PROMPT, **kw)
    assert r.object == "text_completion"
    assert [ch.text for ch in r.choices] == [expected]
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 24)

    # The prompt as token ids.
    r = c.completions.create(prompt=ids, **kw)
    assert [ch.text for ch in r.choices] == [expected]
    assert r.usage.prompt_tokens == len(ids)

    # A list of two prompts: two choices, in order.
    r = c.completions.create(prompt=[PROMPT, PROMPT2], **kw)
    assert [(ch.index, ch.text) for ch in r.choices] == [(0, expected), (1, expected2)]
    assert r.usage.prompt_tokens == len(ids) + len(ids2)
    assert r.usage.completion_tokens == 48

    # Two choices of one prompt: the prompt counted once.
    r = c.completions.create(prompt=ids, n=2, **kw)
    assert [ch.text for ch in r.choices] == [expected, expected]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 48)

    # Two prompts as token ids, streamed.
    texts, finish, usage = completion_stream(
        c.completions.create(
            prompt=[ids, ids2], stream=True, stream_options={"include_usage": True}, **kw
        )
    )
    assert texts == {0: expected, 1: expected2}
    assert finish == {0: "length", 1: "length"}
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(ids) + len(ids2), 48)

    async def run():
        async with aclient(main.base) as ac:
            r = await ac.completions.create(prompt=PROMPT, **kw)
            chunks = await alist(await ac.completions.create(prompt=PROMPT, stream=True, **kw))
            return r, chunks

    r, chunks = asyncio.run(run())
    assert r.choices[0].text == expected
    texts, finish, _ = completion_stream(chunks)
    assert texts == {0: expected} and finish == {0: "length"}


def test_seeded_sampling_streamed_equals_non_streamed(main):
    c = client(main.base)
    chat = dict(model=main.model, messages=MESSAGES, max_tokens=24, temperature=1.0)
    comp = dict(model=main.model, prompt=PROMPT, max_tokens=24, temperature=1.0)

    async def astreams(seed):
        async with aclient(main.base) as ac:
            a = await alist(await ac.chat.completions.create(**chat, seed=seed, stream=True))
            b = await alist(await ac.completions.create(**comp, seed=seed, stream=True))
            return chat_stream(a)[0][0], completion_stream(b)[0][0]

    seen_chat, seen_comp = set(), set()
    for seed in (11, 12, 13):
        text = c.chat.completions.create(**chat, seed=seed).choices[0].message.content
        streamed = chat_stream(c.chat.completions.create(**chat, seed=seed, stream=True))[0][0]
        ctext = c.completions.create(**comp, seed=seed).choices[0].text
        cstreamed = completion_stream(c.completions.create(**comp, seed=seed, stream=True))[0][0]
        assert streamed == text and cstreamed == ctext
        assert asyncio.run(astreams(seed)) == (text, ctext)
        seen_chat.add(text)
        seen_comp.add(ctext)
    # Sampling at temperature 1 does depend on the seed.
    assert len(seen_chat) > 1 and len(seen_comp) > 1


def _stop_from(text: str) -> str:
    """A 3-character printable ASCII substring near the middle of ``text``."""
    for start in range(len(text) // 2, len(text) - 3):
        cand = text[start : start + 3]
        if cand.isascii() and cand.isprintable() and cand.strip() == cand and cand.strip():
            return cand
    raise AssertionError(f"no usable stop string in {text!r}")


def test_stop_strings_are_trimmed(main, ref):
    ids = ref.chat_ids(MESSAGES)
    full = ref.text(ref.greedy([ids], 48)[0])
    stop = _stop_from(full)
    expected = full[: full.index(stop)]
    assert 0 < len(expected) < len(full) - 3
    kw = dict(
        model=main.model, messages=MESSAGES, max_tokens=48, temperature=0, extra_body=IGNORE_EOS
    )
    c = client(main.base)

    r = c.chat.completions.create(**kw, stop=[stop, "never-seen-xyz"])
    assert r.choices[0].message.content == expected
    assert r.choices[0].finish_reason == "stop"
    assert 0 < r.usage.completion_tokens < 48
    texts, finish, _ = chat_stream(c.chat.completions.create(**kw, stop=stop, stream=True))
    assert texts == {0: expected} and finish == {0: "stop"}

    cids = ref.ids(PROMPT)
    cfull = ref.text(ref.greedy([cids], 48)[0])
    cstop = _stop_from(cfull)
    ckw = dict(model=main.model, prompt=PROMPT, max_tokens=48, temperature=0, extra_body=IGNORE_EOS)
    r = c.completions.create(**ckw, stop=cstop)
    assert r.choices[0].text == cfull[: cfull.index(cstop)]
    assert r.choices[0].finish_reason == "stop"
    texts, finish, _ = completion_stream(c.completions.create(**ckw, stop=[cstop], stream=True))
    assert texts == {0: cfull[: cfull.index(cstop)]} and finish == {0: "stop"}


def test_stop_string_options_min_tokens_and_include(main, ref):
    """Stop strings count from min_tokens on (as EOS and stop_token_ids do), and
    include_stop_str_in_output ends the text with the stop string."""
    ids = ref.ids(PROMPT)
    tokens = ref.greedy([ids], 24)[0]
    full = ref.text(tokens)
    c = client(main.base)
    kw = dict(model=main.model, prompt=PROMPT, max_tokens=24, temperature=0)

    early = full[0]  # hit by the first token without min_tokens
    r = c.completions.create(**kw, stop=early, extra_body=IGNORE_EOS)
    assert r.choices[0].text == "" and r.choices[0].finish_reason == "stop"
    r = c.completions.create(**kw, stop=early, extra_body={**IGNORE_EOS, "min_tokens": 6})
    text = r.choices[0].text
    head = ref.text(tokens[:5])  # what the first 5 tokens make is never searched
    assert r.usage.completion_tokens >= 6 and full.startswith(text) and len(text) >= len(head)
    if r.choices[0].finish_reason == "stop":
        assert full[len(text)] == early
    else:
        assert text == full and early not in full[len(head) :]

    stop = _stop_from(full)
    with_stop = full[: full.index(stop) + len(stop)]
    include = {**IGNORE_EOS, "include_stop_str_in_output": True}
    r = c.completions.create(**kw, stop=[stop, "never-seen-xyz"], extra_body=include)
    assert r.choices[0].text == with_stop and r.choices[0].finish_reason == "stop"
    texts, finish, _ = completion_stream(
        c.completions.create(**kw, stop=stop, stream=True, extra_body=include)
    )
    assert texts == {0: with_stop} and finish == {0: "stop"}


def test_truncate_prompt_tokens_and_continue_final_message(main, ref):
    c = client(main.base)
    ids = ref.ids(PROMPT2)
    assert len(ids) > 6
    body = dict(model=main.model, prompt=ids, max_tokens=5, temperature=0)
    r = c.completions.create(**body, extra_body={**IGNORE_EOS, "truncate_prompt_tokens": 4})
    assert r.usage.prompt_tokens == 4
    assert r.choices[0].text == ref.text(ref.greedy([ids[-4:]], 5)[0])
    max_len = int(main.heartbeat()["max_model_len"])
    long = (ids * (max_len // len(ids) + 1))[: max_len + 10]
    r = c.completions.create(
        **{**body, "prompt": long}, extra_body={**IGNORE_EOS, "truncate_prompt_tokens": -1}
    )
    assert r.usage.prompt_tokens == max_len - 5 and r.usage.completion_tokens == 5

    # An assistant turn continued, not a new one started.
    messages = [*MESSAGES, {"role": "assistant", "content": "Redis streams are"}]
    cont = ref.tok.apply_chat_template(
        messages, continue_final_message=True, tokenize=True, return_dict=False
    )
    extra = {**IGNORE_EOS, "add_generation_prompt": False, "continue_final_message": True}
    r = c.chat.completions.create(
        model=main.model, messages=messages, max_tokens=5, temperature=0, extra_body=extra
    )
    assert r.usage.prompt_tokens == len(cont)
    assert r.choices[0].message.content == ref.text(ref.greedy([list(cont)], 5)[0])
    chat = f"{main.base}/v1/chat/completions"
    assert_error(
        httpx.post(chat, json={"messages": messages, "continue_final_message": True}),
        400,
        param="continue_final_message",
    )


def test_n_choices_count_once_in_the_metrics_and_seeds_span_64_bits(main):
    def counters() -> dict[str, float]:
        text = httpx.get(f"{main.base}/metrics", timeout=10).text
        out: dict[str, float] = defaultdict(float)
        for line in text.splitlines():
            name = line.split("{")[0]
            if name in ("llmq:prompt_tokens_total", "llmq:request_success_total"):
                out[name] += float(line.rsplit(" ", 1)[1])
        return out

    c = client(main.base)
    before = counters()
    r = c.chat.completions.create(model=main.model, messages=MESSAGES, max_tokens=3, n=4)
    after = counters()
    assert after["llmq:request_success_total"] - before["llmq:request_success_total"] == 1
    prompt_added = after["llmq:prompt_tokens_total"] - before["llmq:prompt_tokens_total"]
    assert prompt_added == r.usage.prompt_tokens

    def sample(seed: int, n: int = 1) -> list[str]:
        body = dict(model=main.model, prompt=PROMPT, max_tokens=12, seed=seed, n=n)
        r = c.completions.create(**body, extra_body=IGNORE_EOS)
        return [ch.text for ch in r.choices]

    assert sample(-1) == sample(-1)
    assert sample(-1) != sample(2**63 - 1)
    assert sample(-(2**63)) not in sample(2**63 - 1, n=2)


def test_logprobs_have_the_asked_shape(main, ref):
    c = client(main.base)
    greedy = dict(model=main.model, max_tokens=8, temperature=0, extra_body=IGNORE_EOS)

    r = c.chat.completions.create(messages=MESSAGES, logprobs=True, top_logprobs=3, **greedy)
    content = r.choices[0].logprobs.content
    assert len(content) == 8 == r.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 3
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        # Greedy: the chosen token is the most likely one.
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-5)
    assert r.choices[0].message.content == ref.text(ref.greedy([ref.chat_ids(MESSAGES)], 8)[0])

    chunks = list(
        c.chat.completions.create(
            messages=MESSAGES, logprobs=True, top_logprobs=3, stream=True, **greedy
        )
    )
    streamed = [
        e for ch in chunks for ch_c in ch.choices if ch_c.logprobs for e in ch_c.logprobs.content
    ]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [
        (e.token, round(e.logprob, 4)) for e in content
    ]
    assert all(len(e.top_logprobs) == 3 for e in streamed)

    # Without logprobs there are none.
    assert c.chat.completions.create(messages=MESSAGES, **greedy).choices[0].logprobs is None

    r = c.completions.create(prompt=PROMPT, logprobs=2, **greedy)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    assert len(lp.text_offset) == 8 and lp.text_offset[0] == 0
    assert lp.text_offset == sorted(lp.text_offset)
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob <= 0
        assert 1 <= len(top) <= 2  # two ids that decode alike share one key
        assert max(top.values()) == pytest.approx(logprob, abs=1e-5) and token in top


def test_n_choices(main, ref):
    c = client(main.base)
    ids = ref.chat_ids(MESSAGES)
    kw = dict(model=main.model, messages=MESSAGES, max_tokens=12, temperature=1.0, seed=5, n=3)
    r = c.chat.completions.create(**kw, extra_body=IGNORE_EOS)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    texts = [ch.message.content for ch in r.choices]
    assert len(set(texts)) > 1, "n choices with one seed must differ"
    assert all(ch.finish_reason == "length" for ch in r.choices)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 36)

    # Streamed, the same seed gives the same three texts, each choice finishing once.
    got, finish, usage = chat_stream(
        c.chat.completions.create(
            **kw, stream=True, stream_options={"include_usage": True}, extra_body=IGNORE_EOS
        )
    )
    assert got == dict(enumerate(texts))
    assert finish == {0: "length", 1: "length", 2: "length"}
    assert usage.completion_tokens == 36

    # Completions: n per prompt, prompts in order.
    r = c.completions.create(
        model=main.model,
        prompt=[PROMPT, PROMPT2],
        n=2,
        max_tokens=6,
        temperature=0,
        extra_body=IGNORE_EOS,
    )
    greedy = [ref.text(t) for t in ref.greedy([ref.ids(PROMPT), ref.ids(PROMPT2)], 6)]
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
    assert [ch.text for ch in r.choices] == [greedy[0], greedy[0], greedy[1], greedy[1]]
    assert r.usage.completion_tokens == 24


def _sse_events(raw: str) -> list[str]:
    """The data of each event; every event is one `data:` line, events end with a blank line."""
    assert raw.endswith("\r\n\r\n") or raw.endswith("\n\n"), raw[-50:]
    events = [e for e in raw.replace("\r\n", "\n").split("\n\n") if e]
    data = []
    for e in events:
        lines = e.split("\n")
        assert len(lines) == 1 and lines[0].startswith("data: "), e
        data.append(lines[0][len("data: ") :])
    return data


def test_sse_framing(main, ref):
    expected = ref.text(ref.greedy([ref.chat_ids(MESSAGES)], 6)[0])
    body = dict(
        model=main.model,
        messages=MESSAGES,
        max_tokens=6,
        temperature=0,
        ignore_eos=True,
        stream=True,
    )
    with httpx.stream("POST", f"{main.base}/v1/chat/completions", json=body, timeout=30) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        raw = resp.read().decode()
    data = _sse_events(raw)
    assert data[-1] == "[DONE]"
    frames = [json.loads(d) for d in data[:-1]]
    assert all(f["object"] == "chat.completion.chunk" for f in frames)
    assert len({f["id"] for f in frames}) == 1
    first, last = frames[0], frames[-1]
    assert first["choices"][0]["delta"]["role"] == "assistant"
    assert last["choices"][0]["finish_reason"] == "length"
    assert all(f["choices"][0]["finish_reason"] is None for f in frames[:-1])
    assert "".join(f["choices"][0]["delta"].get("content") or "" for f in frames) == expected

    body = dict(model=main.model, prompt=PROMPT, max_tokens=5, temperature=0, stream=True)
    body["stream_options"] = {"include_usage": True}
    with httpx.stream("POST", f"{main.base}/v1/completions", json=body, timeout=30) as resp:
        assert resp.status_code == 200
        data = _sse_events(resp.read().decode())
    assert data[-1] == "[DONE]"
    frames = [json.loads(d) for d in data[:-1]]
    *chunks, usage = frames
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] <= 5
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")
    assert all(f["choices"][0]["finish_reason"] is None for f in chunks[:-1])


# ---- 2. errors ------------------------------------------------------------------------------
def test_400_validation(main):
    url = f"{main.base}/v1/chat/completions"
    err = assert_error(
        httpx.post(url, json={"messages": MESSAGES, "temperature": 5}),
        400,
        type="invalid_request_error",
        param="temperature",
    )
    assert "temperature" in err["message"]
    assert_error(httpx.post(url, json={"model": main.model}), 400, param="messages")
    assert_error(httpx.post(url, json={"messages": []}), 400, param="messages")
    assert_error(
        httpx.post(url, content=b"{not json", headers={"content-type": "application/json"}),
        400,
        type="invalid_request_error",
    )
    assert_error(
        httpx.post(f"{main.base}/v1/completions", json={"max_tokens": 3}), 400, param="prompt"
    )
    with pytest.raises(openai.BadRequestError) as exc:
        client(main.base).chat.completions.create(
            model=main.model, messages=MESSAGES, temperature=5
        )
    assert exc.value.status_code == 400 and exc.value.param == "temperature"


def test_400_context_length(main, ref):
    ids = ref.chat_ids(MESSAGES)
    max_len = int(main.heartbeat()["max_model_len"])
    err = assert_error(
        httpx.post(
            f"{main.base}/v1/chat/completions",
            json={"messages": MESSAGES, "max_tokens": max_len - len(ids) + 1},
        ),
        400,
        type="invalid_request_error",
        param="max_tokens",
        code="context_length_exceeded",
    )
    assert str(max_len) in err["message"]
    body = {"messages": MESSAGES, "max_completion_tokens": max_len - len(ids) + 1}
    assert_error(
        httpx.post(f"{main.base}/v1/chat/completions", json=body),
        400,
        param="max_completion_tokens",
        code="context_length_exceeded",
    )
    # Exactly at the limit is fine (one token to generate).
    r = httpx.post(
        f"{main.base}/v1/completions",
        json={"prompt": [7] * (max_len - 1), "max_tokens": 1},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert_error(
        httpx.post(f"{main.base}/v1/completions", json={"prompt": [7] * max_len, "max_tokens": 1}),
        400,
        param="prompt",
        code="context_length_exceeded",
    )
    with pytest.raises(openai.BadRequestError) as exc:
        client(main.base).completions.create(model=main.model, prompt=PROMPT, max_tokens=max_len)
    assert exc.value.code == "context_length_exceeded"


def test_logit_bias_steers_greedy_tokens_as_the_engine_does(main, ref):
    ids = ref.ids(PROMPT)
    plain = ref.greedy([ids], 6)[0]
    forced = next(t for t in range(10, 100) if t not in plain)
    cases = [{forced: 100.0}, {plain[0]: -100.0, plain[1]: -100.0}]
    c = client(main.base)
    for bias in cases:
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=6, logit_bias=bias)
        want = ref.engine.generate([ids], params)[0]
        r = c.completions.create(
            model=main.model,
            prompt=PROMPT,
            max_tokens=6,
            temperature=0,
            extra_body={"ignore_eos": True},
            logit_bias={str(t): b for t, b in bias.items()},
        )
        assert r.choices[0].text == ref.text(want)
        if 100.0 in bias.values():
            assert want == [forced] * 6
        else:
            assert plain[0] not in want and plain[1] not in want


def test_400_bad_values(main):
    chat = f"{main.base}/v1/chat/completions"
    assert_error(httpx.post(chat, json={"messages": MESSAGES, "n": 9}), 400, param="n")
    assert_error(
        httpx.post(chat, json={"messages": MESSAGES, "top_logprobs": 2}), 400, param="top_logprobs"
    )
    assert_error(
        httpx.post(chat, json={"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}),
        400,
        param="top_logprobs",
    )
    comp = f"{main.base}/v1/completions"
    assert_error(httpx.post(comp, json={"prompt": "x", "logprobs": 21}), 400, param="logprobs")
    vocab = int(main.heartbeat()["vocab_size"])
    for bad in ({"x": 1}, {"-1": 1}, {str(vocab): 1}, {str(i): 1 for i in range(301)}):
        body = {"messages": MESSAGES, "logit_bias": bad}
        assert_error(httpx.post(chat, json=body), 400, param="logit_bias")
    body = {"messages": MESSAGES, "logit_bias": {"5": 101}}
    assert_error(httpx.post(chat, json=body), 400, param="logit_bias.5")
    # What this server does not do is refused, not ignored.
    assert_error(httpx.post(comp, json={"prompt": "x", "best_of": 3}), 400, param="best_of")
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    for name, value in (("functions", [tool["function"]]),):
        body = {"messages": MESSAGES, name: value}
        msg = assert_error(httpx.post(chat, json=body), 400, param=name)["message"]
        assert "not supported" in msg and f"{name}: {name}" not in msg, msg  # named once
    # ... but what asks for plain text is served.
    for extra in (
        {"response_format": {"type": "text"}},
        {"tools": [tool], "tool_choice": "none"},
        {"tools": [tool]},  # auto: the model may answer in text
    ):
        r = httpx.post(chat, json={"messages": MESSAGES, "max_tokens": 2, **extra}, timeout=60)
        assert r.status_code == 200, r.text
    assert_error(httpx.post(comp, json={"prompt": "x", "suffix": "end"}), 400, param="suffix")
    for url, extra in ((chat, {"messages": MESSAGES}), (comp, {"prompt": "x"})):
        for name, value in (
            ("allowed_token_ids", [1, 2]),
            ("bad_words", ["x"]),
            ("prompt_logprobs", -1),
            ("truncate_prompt_tokens", 0),
        ):
            assert_error(httpx.post(url, json={**extra, name: value}), 400, param=name)
        # Structured output is served; a constraint that cannot be built is refused, naming it.
        schema_format = {"type": "json_schema", "json_schema": {"name": "x"}}
        for name, value, param in (
            ("response_format", schema_format, "response_format.json_schema.schema"),
            ("response_format", {"type": "xml"}, "response_format.type"),
            ("guided_json", {"type": "object", "not": {}}, "guided_json"),
            ("guided_choice", [], "guided_choice"),
            ("structured_outputs", {"regex": "a("}, "structured_outputs.regex"),
        ):
            assert_error(httpx.post(url, json={**extra, name: value}), 400, param=param)
    for name, value in (
        ("tool_choice", "required"),
        ("tool_choice", {"type": "function", "function": {"name": "f"}}),
        ("modalities", ["text", "audio"]),
        ("audio", {"voice": "x", "format": "mp3"}),
        ("best_of", 2),
        ("echo", True),
    ):
        assert_error(httpx.post(chat, json={"messages": MESSAGES, name: value}), 400, param=name)
    for role in ("user", "system"):
        body = {"messages": [{"role": role, "content": None}]}
        assert_error(httpx.post(chat, json=body), 400, param="messages.0.content")
    body = {"messages": [{"role": "user"}]}
    assert_error(httpx.post(chat, json=body), 400, param="messages.0.content")
    # JSON may carry a lone surrogate; it is no text to tokenize.
    headers = {"content-type": "application/json"}
    body = b'{"prompt": "hi \\ud800 x", "max_tokens": 2}'
    assert_error(httpx.post(comp, content=body, headers=headers), 400, param="prompt")
    body = b'{"messages": [{"role": "user", "content": "hi \\ud800"}], "max_tokens": 2}'
    assert_error(httpx.post(chat, content=body, headers=headers), 400, param="messages")
    assert_error(httpx.post(comp, json={"prompt": [1, vocab]}), 400, param="prompt")
    # A field of several shapes names them, not pydantic's union members.
    shapes = "an array of token ids or an array of arrays of token ids"
    for prompt in (5, [1.5], {"a": 1}, ["a", 3]):
        err = assert_error(httpx.post(comp, json={"prompt": prompt}), 400, param="prompt")
        assert err["message"].startswith("prompt must be a string,") and shapes in err["message"]
    err = assert_error(httpx.post(comp, json={"prompt": []}), 400, param="prompt")
    assert err["message"] == "prompt must not be empty"
    bad = {"messages": [{"role": "user", "content": 5}]}
    err = assert_error(httpx.post(chat, json=bad), 400, param="messages.0.content")
    assert err["message"] == "messages.0.content must be a string or an array of text parts"
    err = assert_error(httpx.post(chat, json={**bad, "messages": MESSAGES, "stop": 5}), 400)
    assert (
        err["param"] == "stop" and err["message"] == "stop must be a string or an array of strings"
    )
    # A stop token past the vocabulary is refused here; it would fail in the worker's sampler.
    for url, extra in ((chat, {"messages": MESSAGES}), (comp, {"prompt": "x"})):
        assert_error(
            httpx.post(url, json={**extra, "stop_token_ids": [vocab], "min_tokens": 2}),
            400,
            param="stop_token_ids",
        )
    # A top_k past the vocabulary (even past int64) keeps every token.
    r = httpx.post(comp, json={"prompt": "x", "top_k": 2**70, "max_tokens": 2}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1
    c = client(main.base)
    with pytest.raises(openai.BadRequestError) as exc:
        c.chat.completions.create(model=main.model, messages=MESSAGES, n=9)
    assert exc.value.param == "n"
    with pytest.raises(openai.BadRequestError) as exc:
        c.chat.completions.create(model=main.model, messages=MESSAGES, top_logprobs=2)
    assert exc.value.param == "top_logprobs"


def test_401_without_the_api_key(main):
    base = main.api("secured", api_key=API_KEY, max_body_bytes=20000)
    chat = f"{base}/v1/chat/completions"
    body = {"messages": MESSAGES, "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        resp = httpx.post(chat, json=body, headers=headers)
        assert_error(resp, 401, type="authentication_error", code="invalid_api_key")
        assert resp.headers["www-authenticate"] == "Bearer"
    assert_error(httpx.get(f"{base}/v1/models"), 401)
    with pytest.raises(openai.AuthenticationError) as exc:
        client(base, key="wrong").chat.completions.create(model=main.model, messages=MESSAGES)
    assert exc.value.status_code == 401
    # The right key works, and /health stays public.
    r = client(base, key=API_KEY).chat.completions.create(
        model=main.model, messages=MESSAGES, max_tokens=2
    )
    assert r.usage.completion_tokens <= 2
    assert (
        httpx.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}).json()[
            "data"
        ][0]["id"]
        == main.model
    )
    assert httpx.get(f"{base}/health").status_code == 200
    assert httpx.head(f"{base}/health").status_code == 200  # load balancers' probes


def test_404_unknown_model(main):
    for path, body in (
        ("/v1/chat/completions", {"messages": MESSAGES, "model": "no-such-model"}),
        ("/v1/completions", {"prompt": "x", "model": "no-such-model"}),
    ):
        assert_error(
            httpx.post(f"{main.base}{path}", json=body),
            404,
            param="model",
            code="model_not_found",
        )
    assert_error(httpx.get(f"{main.base}/v1/models/no-such-model"), 404, code="model_not_found")
    assert_error(httpx.get(f"{main.base}/v1/no-such-route"), 404, type="not_found_error")
    with pytest.raises(openai.NotFoundError) as exc:
        client(main.base).chat.completions.create(model="no-such-model", messages=MESSAGES)
    assert exc.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client(main.base).models.retrieve("no-such-model")
    assert client(main.base).models.retrieve(main.model).id == main.model


def test_413_body_over_the_limit(main):
    base = main.api("secured", api_key=API_KEY, max_body_bytes=20000)
    auth = {"Authorization": f"Bearer {API_KEY}", "content-type": "application/json"}
    url = f"{base}/v1/chat/completions"
    # Not JSON at all: a parser would answer 400, so 413 means it was refused before parsing.
    assert_error(httpx.post(url, content=b"{" * 30000, headers=auth), 413, code="request_too_large")
    big = [{"role": "user", "content": "x" * 25000}]
    assert_error(
        httpx.post(url, json={"messages": big, "max_tokens": 1}, headers=auth),
        413,
        code="request_too_large",
    )
    with pytest.raises(openai.APIStatusError) as exc:
        client(base, key=API_KEY).chat.completions.create(model=main.model, messages=big)
    assert exc.value.status_code == 413 and exc.value.code == "request_too_large"
    # Under the limit it is served.
    small_body = {"messages": [{"role": "user", "content": "x" * 1000}], "max_tokens": 1}
    assert httpx.post(url, json=small_body, headers=auth, timeout=30).status_code == 200


def test_413_chunked_body_over_the_limit(main):
    base = main.api("secured", api_key=API_KEY, max_body_bytes=20000)
    auth = {"Authorization": f"Bearer {API_KEY}", "content-type": "application/json"}

    def chunks():  # no Content-Length: the limit must count the bytes as they arrive
        for _ in range(6):
            yield b" " * 5000

    assert_error(
        httpx.post(f"{base}/v1/chat/completions", content=chunks(), headers=auth),
        413,
        code="request_too_large",
    )


def test_429_when_the_queue_is_full(main):
    """A stopped (SIGSTOP) but still registered worker takes nothing new: requests fill a
    queue of two, the next gets 429 with Retry-After; once the worker runs again the queued
    requests are answered. (A read the worker had blocked in Redis when it stopped may still
    take the first one: that one is in service, not waiting, and does not count.)"""
    base = main.api("limited", max_queue=2)
    main.warm(base)
    r = main.redis()
    main.wait_idle()
    body = {"messages": MESSAGES, "max_tokens": 3, "temperature": 0, "ignore_eos": True}

    async def run():
        async with httpx.AsyncClient(base_url=base, timeout=60) as http:
            os.kill(main.worker.proc.pid, signal.SIGSTOP)
            try:
                queued = []
                for n in range(1, 4):
                    queued.append(
                        asyncio.ensure_future(http.post("/v1/chat/completions", json=body))
                    )
                    await asyncio.to_thread(
                        wait_for, lambda n=n: r.xlen(main.stream) == n, 10, "queued", 0.02
                    )
                    if main.waiting(r) == 2:
                        break
                assert main.waiting(r) == 2
                resp = await http.post("/v1/chat/completions", json=body)
                async with aclient(base, timeout=10) as ac:
                    try:
                        await ac.chat.completions.create(
                            model=main.model, messages=MESSAGES, max_tokens=3
                        )
                        refused = None
                    except openai.RateLimitError as exc:
                        refused = exc
            finally:
                os.kill(main.worker.proc.pid, signal.SIGCONT)
            return resp, refused, await asyncio.gather(*queued)

    resp, refused, answered = asyncio.run(run())
    assert_error(resp, 429, type="rate_limit_error", code="queue_full")
    assert resp.headers["retry-after"] == "1"
    assert refused is not None, "the openai client got no RateLimitError"
    assert refused.status_code == 429 and refused.response.headers["retry-after"] == "1"
    for a in answered:
        assert a.status_code == 200, a.text
        assert a.json()["usage"]["completion_tokens"] == 3
    wait_for(lambda: r.xlen(main.stream) == 0, 5, "an empty queue")


@contextmanager
def stopped(proc) -> Iterator[None]:
    """The worker frozen (SIGSTOP) but registered, so the test does not race its speed."""
    os.kill(proc.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(proc.proc.pid, signal.SIGCONT)


def test_deadline_ends_a_request_with_an_error(main):
    base = main.api("deadline", request_timeout=2)
    main.warm(base)
    main.wait_idle()
    time.sleep(1.2)  # one more heartbeat: its token count includes the warm-up's
    r = main.redis()
    body = {"messages": MESSAGES, "max_tokens": 1900, "temperature": 0, "ignore_eos": True}

    # Queued past its deadline (no engine takes it): 504, and the engine drops it unrun.
    with stopped(main.worker):
        started = time.monotonic()
        resp = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=30)
        took = time.monotonic() - started
        err = assert_error(resp, 504, type="timeout", code="deadline_exceeded")
        assert "2s" in err["message"]
        assert 1.8 < took < 4, took

        with pytest.raises(openai.InternalServerError) as exc:
            client(base).completions.create(
                model=main.model, prompt=PROMPT, max_tokens=1900, extra_body=IGNORE_EOS
            )
        assert exc.value.status_code == 504 and exc.value.code == "deadline_exceeded"
        before = int(main.heartbeat()["tokens_total"])
    wait_for(
        lambda: main.waiting(r) == 0 and r.xpending(main.stream, GROUP)["pending"] == 0,
        5,
        "expired dropped",
    )
    main.wait_idle(timeout=3)
    assert int(main.heartbeat()["tokens_total"]) == before, "an expired request was run"

    # Streaming, the deadline passing mid-generation: some text, then the error event; the
    # openai client raises it.
    started = time.monotonic()
    chunks = []
    with pytest.raises(openai.APIError) as exc:
        stream = client(base).chat.completions.create(
            model=main.model, messages=MESSAGES, max_tokens=1900, stream=True,
            extra_body=IGNORE_EOS,
        )  # fmt: skip
        for ch in stream:
            chunks.append(ch)
            if len(chunks) == 4:
                os.kill(main.worker.proc.pid, signal.SIGSTOP)
    os.kill(main.worker.proc.pid, signal.SIGCONT)
    assert len(chunks) >= 4
    assert 1.8 < time.monotonic() - started < 4
    assert "did not finish" in exc.value.message
    # The worker dropped it: nothing left running, its blocks free.
    main.wait_idle(timeout=3)


def test_a_stream_cut_by_server_shutdown_ends_with_an_error_event(main):
    """SIGTERM to an API process mid-stream: the stream gets a short drain, then an error event
    and [DONE] instead of a silent cut (which the openai client takes for a whole answer), the
    process exits cleanly and the request is cancelled on the worker."""
    base = main.api("going-away")
    main.warm(base)
    proc, _ = main.apis.pop("going-away")
    main.wait_idle()
    body = {"prompt": PROMPT, "max_tokens": 1900, "stream": True, **IGNORE_EOS}
    frames: list[str] = []
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=30) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            frames.append(line.removeprefix("data: "))
            if len(frames) == 4:
                # The worker frozen: no token can finish the answer during the drain.
                os.kill(main.worker.proc.pid, signal.SIGSTOP)
                proc.proc.send_signal(signal.SIGTERM)
                signalled = time.monotonic()
    ended = time.monotonic() - signalled
    os.kill(main.worker.proc.pid, signal.SIGCONT)
    assert frames[-1] == "[DONE]"
    error = json.loads(frames[-2])["error"]
    assert error["code"] == "server_shutting_down" and error["type"] == "service_unavailable"
    assert all("choices" in json.loads(f) for f in frames[:-2])
    assert 2.0 < ended < 4.5, ended
    # A clean exit (uvicorn re-raises the signal once shut down).
    assert proc.proc.wait(10) in (0, -signal.SIGTERM), proc.log()
    assert "Application shutdown complete" in proc.log()
    main.wait_idle(timeout=5)  # the request was cancelled on the worker


def test_a_request_cut_by_server_shutdown_gets_a_503(main):
    """SIGTERM to an API process while a non-streamed request runs: after the drain it gets a
    503 server_shutting_down (not a closed connection), and the worker drops the request."""
    base = main.api("going-away-plain")
    main.warm(base)
    proc, _ = main.apis.pop("going-away-plain")
    main.wait_idle()
    body = {"prompt": PROMPT, "max_tokens": 1900, **IGNORE_EOS}

    def stop_when_running() -> None:
        wait_for(lambda: main.heartbeat().get("running") == "1", 10, "the request running")
        os.kill(main.worker.proc.pid, signal.SIGSTOP)  # no token can finish it during the drain
        proc.proc.send_signal(signal.SIGTERM)
        signalled.append(time.monotonic())

    signalled: list[float] = []
    stopper = threading.Thread(target=stop_when_running)
    stopper.start()
    try:
        resp = httpx.post(f"{base}/v1/completions", json=body, timeout=30)
    finally:
        stopper.join()
        os.kill(main.worker.proc.pid, signal.SIGCONT)
    ended = time.monotonic() - signalled[0]
    assert resp.status_code == 503, resp.text
    error = resp.json()["error"]
    assert error["code"] == "server_shutting_down" and error["type"] == "service_unavailable"
    assert 2.0 < ended < 4.5, ended
    assert proc.proc.wait(10) in (0, -signal.SIGTERM), proc.log()
    main.wait_idle(timeout=5)  # the request was cancelled on the worker


# ---- 3. a closed stream frees its KV blocks --------------------------------------------------
def test_closing_a_stream_frees_kv_blocks_within_a_second(main):
    main.wait_idle()
    before = int(main.heartbeat()["tokens_total"])
    stream = client(main.base).chat.completions.create(
        model=main.model, messages=MESSAGES, max_tokens=1900, stream=True, extra_body=IGNORE_EOS
    )
    it = iter(stream)
    for _ in range(4):
        next(it)
    wait_for(lambda: int(main.heartbeat()["kv_blocks_used"]) > 0, 3, "blocks in use", 0.02)
    stream.close()
    closed = time.monotonic()
    wait_for(lambda: main.heartbeat()["kv_blocks_used"] == "0", 1.0, "blocks freed", 0.01)
    freed_after = time.monotonic() - closed
    assert freed_after < 1.0
    hb = main.heartbeat()
    assert hb["running"] == "0"
    # The worker stopped generating for it: no new tokens, and fewer than asked (the tiny
    # model makes hundreds a second, so the count before the close is not small).
    total = int(hb["tokens_total"])
    time.sleep(0.5)
    assert int(main.heartbeat()["tokens_total"]) == total
    assert total - before < 1900


def test_disconnected_streams_leave_no_subscription_behind(main):
    """Clients that drop their streams (curl killed, a browser tab closed) leave the API no
    output channel to listen to: its subscriptions go back to none."""
    r = main.redis()
    out_channels = lambda: r.pubsub_channels(f"{Keys().prefix}:out:*")  # noqa: E731
    main.wait_idle()
    assert out_channels() == []
    body = {"messages": MESSAGES, "max_tokens": 1900, "stream": True, **IGNORE_EOS}
    for _ in range(5):
        with httpx.stream("POST", f"{main.base}/v1/chat/completions", json=body) as resp:
            lines = resp.iter_lines()
            while not next(lines).startswith("data: {"):
                pass
            next(lines)
        # the connection is closed here, mid-answer
    wait_for(lambda: out_channels() == [], 3, "no output channel subscribed", 0.05)
    main.wait_idle()


def test_a_client_that_gives_up_on_a_non_streamed_answer_frees_its_blocks(main):
    main.wait_idle()
    time.sleep(1.2)  # one more heartbeat: its token count is current
    before = int(main.heartbeat()["tokens_total"])
    log_before = main.apis["main"][0].log(tail=10**7)
    body = {"messages": MESSAGES, "max_tokens": 1900, "n": 2, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{main.base}/v1/chat/completions", json=body, timeout=1.0)
    try:  # the two choices would take minutes: freed well before is freed by the cancel
        wait_for(lambda: main.heartbeat()["kv_blocks_used"] == "0", 30, "blocks freed", 0.01)
    except TimeoutError:
        raise AssertionError(f"{main.heartbeat()}\n{main.worker.log(tail=3000)}") from None
    assert main.heartbeat()["running"] == "0"
    time.sleep(1.2)
    # Cancelled, not run to the end: fewer tokens than the two choices asked for.
    generated = int(main.heartbeat()["tokens_total"]) - before
    assert generated < 2 * 1900, main.apis["main"][0].log(tail=4000) + main.worker.log(tail=4000)
    # Both choices were cancelled, quietly: no traceback in the API's log.
    time.sleep(0.3)
    new_log = main.apis["main"][0].log(tail=10**7)[len(log_before) :]
    assert "Traceback" not in new_log and "never retrieved" not in new_log, new_log[-3000:]


# ---- 4. a burst against a bounded queue ------------------------------------------------------
BURST_TOKENS = 32


def test_burst_of_300_gets_answers_or_429(main):
    """The worker is frozen while the burst arrives, so the queue fills however fast it runs:
    every request is either queued or refused at once, and the queued ones run once it wakes."""
    main.wait_idle()
    rc = main.redis()

    async def one(ac, i):
        try:
            return await ac.chat.completions.create(
                model=main.model,
                messages=[{"role": "user", "content": f"request number {i}"}],
                max_tokens=BURST_TOKENS,
                temperature=0,
                extra_body=IGNORE_EOS,
            )
        except openai.RateLimitError as exc:
            return exc

    async def run():
        async with aclient(main.base, timeout=60) as ac:
            tasks = [asyncio.ensure_future(one(ac, i)) for i in range(300)]
            with stopped(main.worker):
                deadline = time.monotonic() + 60
                # Until each request is refused or in the stream (a worker blocked in
                # XREADGROUP when frozen may still be handed a few entries by Redis).
                while sum(t.done() for t in tasks) + rc.xlen(main.stream) < 300:
                    assert time.monotonic() < deadline, "the burst neither queued nor refused"
                    await asyncio.sleep(0.05)
            return await asyncio.wait_for(asyncio.gather(*tasks), timeout=120)

    started = time.monotonic()
    results = asyncio.run(run())
    took = time.monotonic() - started
    ok = [r for r in results if not isinstance(r, openai.RateLimitError)]
    limited = [r for r in results if isinstance(r, openai.RateLimitError)]
    assert len(ok) + len(limited) == 300
    # 50 waiting, plus the few a frozen worker's blocked read was handed (at most one pull).
    assert 50 <= len(ok) <= 50 + 8, (len(ok), len(limited))
    for r in ok:
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == BURST_TOKENS
    for exc in limited:
        assert exc.status_code == 429 and exc.response.headers["retry-after"] == "1"
        assert exc.code == "queue_full"
    assert rc.xpending(main.stream, GROUP)["pending"] == 0
    assert rc.xlen(main.stream) == 0
    print(f"burst: {len(ok)} answered, {len(limited)} refused in {took:.1f}s")


def test_without_max_tokens_the_rest_of_the_context(small, ref):
    """No max_tokens: generation may fill the context (64 tokens on this worker)."""
    ids = ref.chat_ids(MESSAGES)
    r = client(small.base).chat.completions.create(
        model=small.model, messages=MESSAGES, temperature=0, extra_body=IGNORE_EOS
    )
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 64 - len(ids)
    assert r.choices[0].message.content == ref.text(ref.greedy([ids], 64 - len(ids))[0])


# ---- 5. schemathesis -------------------------------------------------------------------------
EXAMPLES_POST = 60  # per POST operation, half of them invalid on purpose
EXAMPLES_OTHER = 15  # per GET / DELETE operation (most have little to vary)


def test_schemathesis_finds_no_5xx_with_the_api_key(small):
    """Generated requests, valid and not, to an API that requires a key (LLMQ_API_KEY), each
    sent with the key as a client would: none gets a 5xx, and none a 401."""
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st
    from schemathesis import GenerationMode

    base = small.api("keyed", api_key=API_KEY)
    assert_error(httpx.post(f"{base}/v1/completions", json={"prompt": "x"}), 401)
    auth = {"Authorization": f"Bearer {API_KEY}"}
    schema = schemathesis.openapi.from_url(f"{base}/openapi.json", headers=auth)
    calls: Counter = Counter()
    statuses: Counter = Counter()
    failures: list[str] = []

    def run(op) -> None:
        post = op.method.upper() == "POST"
        strategy = op.as_strategy(GenerationMode.POSITIVE)
        if post:
            strategy = st.one_of(strategy, op.as_strategy(GenerationMode.NEGATIVE))

        @settings(
            max_examples=EXAMPLES_POST if post else EXAMPLES_OTHER,
            deadline=None,
            database=None,
            derandomize=True,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(case=strategy)
        def check(case):
            resp = case.call(base_url=base, headers=auth, timeout=60)
            calls[op.label] += 1
            statuses[(op.label, resp.status_code)] += 1
            if resp.status_code >= 500 and len(failures) < 10:
                failures.append(
                    f"{op.label} -> {resp.status_code} {resp.text[:300]}\n"
                    f"    body: {str(case.body)[:500]}"
                )

        check()

    for result in schema.get_all_operations():
        run(result.ok())
    print(f"schemathesis: {sum(calls.values())} calls {dict(calls)}, statuses {dict(statuses)}")
    assert not failures, "\n".join(failures)
    assert sum(calls.values()) >= 200
    codes = Counter()
    for (_, code), n in statuses.items():
        codes[code] += n
    assert codes[200] >= 20 and codes[400] >= 20 and codes[401] == 0
    # Generation itself was exercised, not only refusals.
    generated = [statuses[(f"POST /v1/{op}", 200)] for op in ("chat/completions", "completions")]
    assert min(generated) >= 1 and sum(generated) >= 10, dict(statuses)


# ---- 6. llmq up ------------------------------------------------------------------------------
def test_llmq_up_plans_workers_per_gpu_or_two_on_a_cpu():
    def cpu(threads: int, cores: int) -> dict[str, str]:
        return {"LLMQ_TORCH_THREADS": str(threads), "LLMQ_SMALL_STEP_THREADS": str(cores)}

    assert plan_workers(None, "auto", 2, 0, None) == [cpu(1, 2)] * 2
    assert plan_workers(None, "cpu", 16, 4, None) == [cpu(8, 16)] * 2
    assert plan_workers(None, "auto", 1, 0, None) == [cpu(1, 1)]
    assert plan_workers(3, "cpu", 8, 0, 4) == [cpu(4, 8)] * 3
    assert plan_workers(None, "auto", 16, 2, None) == [
        {"CUDA_VISIBLE_DEVICES": "0"},
        {"CUDA_VISIBLE_DEVICES": "1"},
    ]


def assert_embedded_redis_is_locked(state_dir: Path, cmdlines: str, log: str) -> None:
    """`llmq up`'s Redis password is in its state file and in no command line (`ps`) or log.
    (How that Redis refuses clients without it: tests/faults/test_unauthenticated_redis.py.)"""
    state_file = state_dir / f"llmq-up-{os.getuid()}.json"
    assert state_file.stat().st_mode & 0o777 == 0o600
    url = json.loads(state_file.read_text())["redis_url"]
    password = redis.connection.parse_url(url)["password"]
    assert len(password) >= 24 and password not in cmdlines and password not in log
    assert redis.Redis.from_url(url).ping()


@pytest.mark.parametrize("stop", ["ctrl-c", "sigterm"])
def test_llmq_up_answers_within_a_minute_and_stops_cleanly(llama_dir, tmp_path, stop):
    """Ctrl-C (SIGINT to the terminal's process group) or SIGTERM to the process alone (docker
    stop, systemd, kill) stop the API, both workers and the embedded Redis."""
    port = free_port()
    env = up_env(llama_dir, port, tmp_path, workers=2)  # its state file in tmp_path
    assert "LLMQ_REDIS_URL" not in env
    log = tmp_path / "up.log"
    c = client(f"http://127.0.0.1:{port}", timeout=10)
    with open(log, "w") as out:
        # Its own session, as a shell job: SIGINT to the group is what Ctrl-C sends.
        up = subprocess.Popen(
            [LLMQ, "up"], env=env, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    started = time.monotonic()

    def answered():
        if up.poll() is not None:
            raise RuntimeError(f"llmq up exited:\n{log.read_text()[-4000:]}")
        try:
            return c.chat.completions.create(
                model=str(llama_dir), messages=MESSAGES, max_tokens=8, temperature=0
            )
        except (openai.APIConnectionError, openai.APIStatusError):
            return None

    children: list[psutil.Process] = []
    try:
        resp = wait_for(answered, 60, "a chat answer from llmq up", 0.5)
        assert time.monotonic() - started < 60
        assert resp.choices[0].message.content is not None
        assert resp.usage.completion_tokens >= 1
        children = psutil.Process(up.pid).children(recursive=True)
        names = " ".join(" ".join(p.cmdline()) for p in children)
        assert "redis-server" in names, names
        workers = [p for p in children if "worker" in p.cmdline()]
        assert len(workers) == 2, names
        assert_embedded_redis_is_locked(tmp_path, names, log.read_text())
        # The API process needs no torch (about 0.2 GiB resident had it imported it).
        api_maps = {m.path for m in psutil.Process(up.pid).memory_maps()}
        assert not [m for m in api_maps if "libtorch" in m], "the API process imported torch"
        # Both serve: /ready counts their live heartbeats.
        ready = wait_for(
            lambda: (
                (r := httpx.get(f"http://127.0.0.1:{port}/ready")).json().get("engines") == 2 and r
            ),
            60,
            "two engines ready",
        )
        assert ready.status_code == 200

        if stop == "ctrl-c":
            os.killpg(up.pid, signal.SIGINT)
        else:
            up.send_signal(signal.SIGTERM)
        stopping = time.monotonic()
        rc = up.wait(30)
        stopped_in = time.monotonic() - stopping
    finally:
        if up.poll() is None:  # the test failed: leave nothing behind (the worker has its own
            with suppress(psutil.Error):  # session, so the group kill misses it)
                children = children or psutil.Process(up.pid).children(recursive=True)
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()
            for child in children:
                with suppress(psutil.Error):
                    child.kill()
    assert rc == (0 if stop == "ctrl-c" else 128 + signal.SIGTERM), log.read_text()[-4000:]
    assert "llmq: stopped" in log.read_text()
    _, alive = psutil.wait_procs(children, timeout=5)
    left = [p.cmdline() for p in alive]
    for p in alive:
        p.kill()
    assert not alive, f"left running: {left}"
    print(f"llmq up: answered after {stopping - started:.1f}s, stopped in {stopped_in:.1f}s")
