"""Prompts far past the context cost the sender, not the server: 16 concurrent 2 MB prompts
to a model of a 1,024-token context are refused within a second each, the API's peak memory
hardly moves, and a stream running beside them keeps its pace."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

from tests.api.api_stack import stack

CONTEXT = 1024
# The worker sends a stream's tokens at most every STEP_MS: a steady pace for the stream, so
# that its gaps measure the API relaying them, not how fast the tiny model runs.
STEP_MS = 60
PROMPT_BYTES = 2_000_000


@pytest.fixture(scope="module")
def oversized(llama_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("oversized-logs")
    worker = dict(max_model_len=CONTEXT, stream_interval_ms=STEP_MS)
    with stack(llama_dir, logs, "w-oversized", worker, {}) as s:
        s.warm(s.base)
        yield s


def _peak_rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise AssertionError("no VmHWM")


def _huge_bodies(model: str) -> list[tuple[str, bytes]]:
    words = "the quick brown fox jumps over a lazy dog; tokens cost the sender 0123 "
    text = (words * (PROMPT_BYTES // len(words) + 1))[:PROMPT_BYTES]
    completion = {"model": model, "prompt": text, "max_tokens": 4}
    chat = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 4}
    return [
        ("/v1/completions", json.dumps(completion).encode()),
        ("/v1/chat/completions", json.dumps(chat).encode()),
    ]


async def _token_gaps(base: str, model: str, started: asyncio.Event | None = None) -> list:
    """Seconds between consecutive tokens of one streamed completion (the tokens that come in
    one chunk, 0 apart), counted from each chunk's logprobs."""
    body = {
        "model": model,
        "prompt": "def fibonacci(n):",
        "max_tokens": CONTEXT - 32,
        "ignore_eos": True,
        "stream": True,
        "logprobs": 0,
    }
    gaps: list[float] = []
    last = None
    async with (
        httpx.AsyncClient(timeout=60) as client,
        client.stream("POST", f"{base}/v1/completions", json=body) as r,
    ):
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.perf_counter()
            tokens = len(json.loads(line[6:])["choices"][0]["logprobs"]["tokens"])
            if last is not None and tokens:
                gaps += [now - last] + [0.0] * (tokens - 1)
            last = now
            if started is not None and len(gaps) >= 3 * tokens:
                started.set()
    return gaps


def _post_raw(base: str, path: str, body: bytes) -> tuple[int, dict, float]:
    """POST over a plain socket (``sendall`` lets go of the GIL while 2 MB go out, so this
    process's stream reader keeps its pace): the status, the JSON answer, the seconds taken."""
    host, port = base.removeprefix("http://").split(":")
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    started = time.perf_counter()
    with socket.create_connection((host, int(port)), timeout=60) as conn:
        conn.sendall(head + body)
        answer = b"".join(iter(lambda: conn.recv(65536), b""))
    seconds = time.perf_counter() - started
    status_line, _, rest = answer.partition(b"\r\n")
    return int(status_line.split()[1]), json.loads(rest.partition(b"\r\n\r\n")[2]), seconds


async def _burst_beside_a_stream(base: str, model: str) -> tuple[list, list]:
    bodies = _huge_bodies(model)
    started = asyncio.Event()
    stream = asyncio.ensure_future(_token_gaps(base, model, started))
    await started.wait()
    with ThreadPoolExecutor(16) as pool:
        loop = asyncio.get_running_loop()
        answers = await asyncio.gather(
            *(loop.run_in_executor(pool, _post_raw, base, *bodies[i % 2]) for i in range(16))
        )
    return answers, await stream


def test_huge_prompts_are_refused_fast_without_the_apis_memory(oversized):
    base, model = oversized.base, oversized.model
    api_pid = oversized.apis["main"][0].proc.pid
    quiet = asyncio.run(_token_gaps(base, model))
    before = _peak_rss_kib(api_pid)
    answers, loaded = asyncio.run(_burst_beside_a_stream(base, model))
    rise_mib = (_peak_rss_kib(api_pid) - before) / 1024

    for status, answer, seconds in answers:
        assert status == 400, answer
        assert answer["error"]["code"] == "context_length_exceeded", answer
        assert f"maximum context length is {CONTEXT} tokens" in answer["error"]["message"]
        assert seconds < 1.0, seconds
    # A fast host puts a hundred tokens in a chunk: the quiet p99 then falls among the zeros
    # (5 ms in one run, against 34 loaded); the worker's pacing, STEP_MS, is the floor.
    quiet_p99 = max(np.percentile(quiet, 99), STEP_MS / 1000)
    loaded_p99 = np.percentile(loaded, 99)
    assert rise_mib < 100, rise_mib
    assert loaded_p99 < 2 * quiet_p99, (quiet_p99, loaded_p99)


def test_a_huge_prompt_truncated_keeps_its_tail(oversized):
    """truncate_prompt_tokens on 2 MB: the kept tail alone is tokenized and served."""
    base, model = oversized.base, oversized.model
    for path, body in _huge_bodies(model):
        answer = json.loads(body)
        answer.update(truncate_prompt_tokens=16, max_tokens=1)
        status, reply, seconds = _post_raw(base, path, json.dumps(answer).encode())
        assert status == 200, reply
        assert reply["usage"]["prompt_tokens"] == 16 and seconds < 1.0, (reply, seconds)


def test_too_many_messages_is_a_400(oversized):
    messages = [{"role": "user", "content": "hi"}] * 2049
    body = json.dumps({"model": oversized.model, "messages": messages}).encode()
    status, reply, _ = _post_raw(oversized.base, "/v1/chat/completions", body)
    assert status == 400 and reply["error"]["param"] == "messages", reply
