"""The processes and helpers of the API tests: a Redis, an `llmq worker` and `llmq api`
processes on it, the openai clients, and checks of streams and error bodies."""

from __future__ import annotations

import json
import os
import signal
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import redis

from llmq.common.sampling_params import SamplingParams
from llmq.common.transport import Keys
from llmq.common.transport.redis_server import RedisServer
from llmq.worker.llm_engine import LLMEngine
from tests.harness import (
    Proc,
    heartbeat,
    kill_all,
    start_api,
    start_worker,
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
            kill_all([worker, *(proc for proc, _ in s.apis.values())])


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


def client(base: str, key: str = "none", timeout: float = 60) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=timeout)


def aclient(base: str, key: str = "none", timeout: float = 60) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=timeout)


def chat_stream(chunks) -> tuple[dict[int, str], dict[int, str], object]:
    """Texts and finish reasons by choice index, and the usage chunk's usage."""
    return _choice_stream(chunks, lambda choice: choice.delta.content or "")


def completion_stream(chunks) -> tuple[dict[int, str], dict[int, str], object]:
    return _choice_stream(chunks, lambda choice: choice.text)


def _choice_stream(chunks, text_of) -> tuple[dict[int, str], dict[int, str], object]:
    texts: dict[int, str] = defaultdict(str)
    finish: dict[int, str] = {}
    usage = None
    for ch in chunks:
        if ch.usage is not None:
            assert ch.choices == [], "usage comes in a chunk of its own"
            usage = ch.usage
        for c in ch.choices:
            texts[c.index] += text_of(c)
            if c.finish_reason is not None:
                assert c.index not in finish, "one finish_reason per choice"
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


@contextmanager
def stopped(proc) -> Iterator[None]:
    """The worker frozen (SIGSTOP) but registered, so the test does not race its speed."""
    os.kill(proc.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(proc.proc.pid, signal.SIGCONT)


def batch_results(
    client: openai.OpenAI, endpoint: str, lines: list[tuple[str, dict]]
) -> dict[str, dict]:
    """Each line's response (status_code, body) by custom_id, from a batch of ``lines`` (custom
    id, body) on ``endpoint``, run to completion through the Batch API."""
    content = "".join(
        json.dumps({"custom_id": cid, "method": "POST", "url": endpoint, "body": body}) + "\n"
        for cid, body in lines
    )
    f = client.files.create(file=("lines.jsonl", content.encode()), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint=endpoint, completion_window="24h")

    def done():
        b = client.batches.retrieve(batch.id)
        return b if b.status in ("completed", "failed", "cancelled", "expired") else None

    batch = wait_for(done, 120, f"batch {batch.id}", 0.2)
    assert batch.status == "completed", batch
    rows = [client.files.content(batch.output_file_id).text]
    if batch.error_file_id:
        rows.append(client.files.content(batch.error_file_id).text)
    return {o["custom_id"]: o["response"] for t in rows for o in map(json.loads, t.splitlines())}
