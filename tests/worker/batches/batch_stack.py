"""The processes and helpers of the Files and Batch API tests: a Redis, an `llmq worker` and an
`llmq api` on it, and batch files built, sent and read back with the openai client."""

from __future__ import annotations

import json
import subprocess
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import openai
import redis

from llmq.common.transport.redis_server import RedisServer
from tests.harness import (
    LLMQ,
    Proc,
    heartbeat,
    kill_all,
    start_api,
    start_worker,
    wait_for,
    wait_worker,
)

FINAL = {"completed", "failed", "cancelled", "expired"}
GREEDY = {"temperature": 0.0, "ignore_eos": True}
PROMPTS = [
    "What does XREADGROUP do?",
    "Write a haiku about queues.",
    "def fibonacci(n):",
    "Explain continuous batching in one sentence.",
    "import asyncio\n\nasync def main():",
    "Name three Redis data types.",
]


# ---- processes -----------------------------------------------------------------------------
@dataclass
class Stack:
    redis_url: str
    worker: Proc
    worker_name: str
    api: Proc
    base: str
    model: str
    logs: Path

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base}/v1", api_key="none", max_retries=0, timeout=60)

    def redis(self) -> redis.Redis:
        return redis.Redis.from_url(self.redis_url)

    def wait_idle(self, timeout: float = 20.0) -> None:
        def idle():
            hb = heartbeat(self.redis_url, self.worker_name)
            return hb.get("kv_blocks_used") == "0" and hb.get("running") == "0"

        wait_for(idle, timeout, f"{self.worker_name} idle", 0.1)

    def logs_tail(self) -> str:
        return f"--- worker log ---\n{self.worker.log()}\n--- api log ---\n{self.api.log()}"


# A short lease: a job whose worker was killed resumes within 4 s and the supervisor's round
# (2 s), where the default's 10 s and 5 s took most of such a test's time.
LEASE = {"batch_lease_ttl": 4}


@contextmanager
def stack(
    model: Path, logs: Path, worker_name: str, api_settings: dict | None = None, **worker_settings
):
    """Redis + one `llmq worker` + `llmq api`, started side by side. A test may replace
    ``worker``; whichever is there at the end is stopped."""
    with RedisServer() as server:
        worker = start_worker(server.url, model, worker_name, logs, wait=False, **worker_settings)
        api = None
        s = None
        try:
            name = f"api-{worker_name}"
            api, base = start_api(server.url, model, logs, name, **(api_settings or {}))
            wait_worker(server.url, worker_name, worker)
            s = Stack(server.url, worker, worker_name, api, base, str(model), logs)
            yield s
        finally:
            kill_all([api, s.worker if s is not None else worker])


# ---- batch helpers -------------------------------------------------------------------------
def chat_body(model: str, content: str, max_tokens: int = 16) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        **GREEDY,
    }


def line(custom_id: str, url: str, body: dict) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def chat_lines(model: str, n: int, max_tokens: int, prefix: str = "r") -> list[str]:
    return [
        line(f"{prefix}{i}", "/v1/chat/completions", chat_body(model, f"line {i}", max_tokens))
        for i in range(n)
    ]


def create_batch(client: openai.OpenAI, lines: list[str], endpoint="/v1/chat/completions"):
    content = ("\n".join(lines) + "\n").encode()
    f = client.files.create(file=("input.jsonl", content), purpose="batch")
    assert f.purpose == "batch" and f.bytes == len(content)
    assert len(client.files.list(limit=1).data) == 1  # a page, newest first
    return client.batches.create(input_file_id=f.id, endpoint=endpoint, completion_window="24h")


def wait_batch(
    client: openai.OpenAI, batch_id: str, timeout: float, until=lambda b: b.status in FINAL
):
    seen = {}

    def check():
        b = client.batches.retrieve(batch_id)
        seen["last"] = b
        return b if until(b) else None

    try:
        return wait_for(check, timeout, f"batch {batch_id}", 0.2)
    except TimeoutError as exc:
        raise AssertionError(f"{exc}; last seen: {seen.get('last')}\n{worker_stacks()}") from None


WORKERS: list[Proc] = []  # the workers whose Python stacks a stuck batch shows


def worker_stacks() -> str:
    """py-spy's dump of every live worker (what a stuck batch task is waiting on)."""
    spy = Path(LLMQ).parent / "py-spy"
    out = []
    for w in WORKERS:
        if w.alive() and spy.exists():
            dump = subprocess.run(
                [str(spy), "dump", "-p", str(w.proc.pid)], capture_output=True, text=True
            )
            out.append(f"--- {w.args[-1]} ---\n{dump.stdout}{dump.stderr}")
    return "\n".join(out)


def jsonl(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    text = client.files.content(file_id).text
    return [json.loads(x) for x in text.splitlines() if x.strip()]


def assert_output_lines(rows: list[dict], custom_ids: set[str], obj: str) -> dict[str, dict]:
    """OpenAI's output-line shape; each custom_id exactly once. Returns bodies by custom_id."""
    counts = Counter(r["custom_id"] for r in rows)
    dup = {k: v for k, v in counts.items() if v > 1}
    assert not dup, f"custom_ids more than once: {dup}"
    assert set(counts) == custom_ids, (sorted(set(counts) ^ custom_ids))[:10]
    bodies = {}
    for r in rows:
        assert r["id"].startswith("batch_req_"), r["id"]
        assert r["error"] is None
        assert r["response"]["status_code"] == 200, r
        assert r["response"]["request_id"]
        body = r["response"]["body"]
        assert body["object"] == obj, body
        bodies[r["custom_id"]] = body
    assert len({r["id"] for r in rows}) == len(rows)
    return bodies
