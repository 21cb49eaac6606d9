"""What the fault scenarios share: one Redis, one `llmq worker` and one `llmq api` (real
processes), a completion call that reads streamed and whole answers alike, and the in-process
engine's greedy text to hold the answers to."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import redis

from llmq.common.model_files import load_tokenizer
from llmq.common.sampling_params import SamplingParams
from llmq.common.transport import Keys
from llmq.common.transport.redis_server import RedisServer
from llmq.worker.llm_engine import EngineConfig, LLMEngine
from llmq.worker.loading.model_loader import eos_token_ids, load_causal_lm
from tests.harness import Proc, heartbeat, kill_all, start_api, start_worker, wait_worker


@dataclass
class Served:
    server: RedisServer
    worker: Proc
    worker_name: str
    api: Proc
    base: str
    model: str

    def redis(self, **kwargs) -> redis.Redis:
        return redis.Redis.from_url(self.server.url, **kwargs)

    @property
    def stream(self) -> str:
        return Keys().requests(self.model)

    def heartbeat(self) -> dict[str, str]:
        return heartbeat(self.server.url, self.worker_name)


@contextmanager
def served(
    model: Path,
    logs: Path,
    name: str,
    worker: dict | None = None,
    api: dict | None = None,
    redis_args: list[str] | None = None,
) -> Iterator[Served]:
    """Redis (no persistence: `--save "" --appendonly no`), a worker and an API on it."""
    with RedisServer(extra_args=redis_args) as server:
        settings = worker or {}
        w = start_worker(server.url, model, name, logs, wait=False, **settings)
        try:  # the API starts while the worker loads
            proc, base = start_api(server.url, model, logs, f"api-{name}", **(api or {}))
        except BaseException:
            w.terminate()
            raise
        try:
            wait_worker(server.url, name, w, settings.get("key_prefix", "llmq"))
        except BaseException:
            proc.terminate()
            w.terminate()
            raise
        try:
            yield Served(server, w, name, proc, base, str(model))
        finally:
            kill_all([proc, w])


@dataclass
class Answer:
    status: int
    headers: httpx.Headers
    text: str  # the completion's text (a stream: its deltas joined)
    error: dict | None  # the OpenAI error body's "error" (a stream: its error event's)
    ended: float  # time.monotonic() when the answer was complete


def completion(prompt: list[int], max_tokens: int, stream: bool = False, **extra) -> dict:
    """A greedy completion of token ids that runs to max_tokens."""
    return {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
        **extra,
    }


async def complete(http: httpx.AsyncClient, base: str, body: dict) -> Answer:
    url = f"{base}/v1/completions"
    if not body.get("stream"):
        resp = await http.post(url, json=body)
        data = resp.json()
        text = data["choices"][0]["text"] if resp.status_code == 200 else ""
        return Answer(resp.status_code, resp.headers, text, data.get("error"), time.monotonic())
    text, error = [], None
    async with http.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:  # refused before the stream began: a JSON error body
            error = json.loads(await resp.aread())["error"]
            return Answer(resp.status_code, resp.headers, "", error, time.monotonic())
        lines = [line[6:] async for line in resp.aiter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]", lines[-3:]
    for line in lines[:-1]:
        event = json.loads(line)
        error = event.get("error", error)
        text += [c["text"] for c in event.get("choices", [])]
    return Answer(resp.status_code, resp.headers, "".join(text), error, time.monotonic())


def greedy_texts(model_dir: Path, prompts: list[list[int]], max_tokens: int) -> list[str]:
    """What the in-process engine answers to each prompt of token ids (greedy, float32)."""
    tok = load_tokenizer(str(model_dir))
    model = load_causal_lm(str(model_dir), "float32", "cpu")
    engine = LLMEngine(model, EngineConfig(num_blocks=1024), eos_token_ids(model, tok))
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [tok.decode(out, skip_special_tokens=True) for out in engine.generate(prompts, params)]
