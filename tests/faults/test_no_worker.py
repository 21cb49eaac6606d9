"""The only worker of a model dies (SIGKILL) while requests are running and queued: each of them,
and a new one, gets 503 no_worker with Retry-After (a stream: its error event, then [DONE])
within the heartbeat TTL plus a few seconds, not at the inactivity timeout. They are cancelled
in Redis, so the worker that comes back later runs none of them, while a request of an API
that gives the model a long grace (LLMQ_NO_WORKER_GRACE) waits for that worker and is served."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import httpx
import openai
import pytest
import redis

from llmq.common.transport import GROUP, Keys
from llmq.common.transport.redis_server import RedisServer
from tests.harness import (
    heartbeat,
    kill_all,
    recorded_tokens,
    start_api,
    start_worker,
    wait_for,
    wait_worker,
)

TTL = 2.0  # the worker's heartbeat TTL: how long a dead worker still looks alive
BOUND = TTL + 3.0  # every request of the dead worker's model ends within this of the kill
LONG = 1500  # tokens: the running requests are far from done when the worker dies
PATIENT_TOKENS = 8


@dataclass
class Outcome:
    status: int
    headers: httpx.Headers
    body: object  # the JSON body, or a stream's data lines
    ended: float  # time.monotonic() when the answer was complete


@dataclass
class Setup:
    redis_url: str
    model: str
    logs: object
    fast: str  # an API with the default grace
    patient: str  # an API whose requests wait 60 s for a worker to come back

    @property
    def stream(self) -> str:
        return Keys().requests(self.model)


@pytest.fixture(scope="module")
def setup(llama_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("no-worker")
    with RedisServer() as server:
        worker = start_worker(
            server.url, llama_dir, "w-only", logs, wait=False, heartbeat_ttl=TTL, max_batch_size=2
        )
        apis = [  # started while the worker loads
            start_api(server.url, llama_dir, logs, "api-fast", inactivity_timeout=60),
            start_api(server.url, llama_dir, logs, "api-patient", no_worker_grace=60),
        ]
        try:
            wait_worker(server.url, "w-only", worker)
            yield Setup(server.url, str(llama_dir), logs, apis[0][1], apis[1][1]), worker
        finally:
            kill_all([*(proc for proc, _ in apis), worker])


def body(path: str, max_tokens: int, stream: bool = False) -> dict:
    extra = {"stream": stream, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    if path == "chat":
        return {"messages": [{"role": "user", "content": "Hello there"}], **extra}
    return {"prompt": "def fibonacci(n):", **extra}


async def call(http: httpx.AsyncClient, base: str, path: str, payload: dict) -> Outcome:
    url = f"{base}/v1/{'chat/completions' if path == 'chat' else 'completions'}"
    if not payload.get("stream"):
        resp = await http.post(url, json=payload)
        return Outcome(resp.status_code, resp.headers, resp.json(), time.monotonic())
    async with http.stream("POST", url, json=payload) as resp:
        lines = [line[6:] async for line in resp.aiter_lines() if line.startswith("data: ")]
    return Outcome(resp.status_code, resp.headers, lines, time.monotonic())


def assert_no_worker(outcome: Outcome, killed: float) -> float:
    """The request ended with no_worker within BOUND of the kill; returns when, after it."""
    if isinstance(outcome.body, list):  # a stream: it had started, so the error is an event
        assert outcome.status == 200 and outcome.body[-1] == "[DONE]", outcome.body[-3:]
        error = json.loads(outcome.body[-2])["error"]
    else:
        assert outcome.status == 503, outcome.body
        assert int(outcome.headers["retry-after"]) > 0
        error = outcome.body["error"]
    assert error["code"] == "no_worker" and error["type"] == "service_unavailable", error
    took = outcome.ended - killed
    assert took < BOUND, f"a request ended {took:.1f}s after the kill"
    return took


def live_ids(r: redis.Redis, stream: str) -> list[str]:
    """Ids of the requests in the model's stream, in the order they were enqueued."""
    return [fields[b"id"].decode() for _, fields in r.xrange(stream)]


async def load_then_kill(http: httpx.AsyncClient, s: Setup, worker, r: redis.Redis):
    """Two requests running (the worker's batch is 2), three queued on the fast API and one on
    the patient one; then SIGKILL. Returns the outcomes, the kill time and the stream's ids."""
    running = [
        asyncio.ensure_future(call(http, s.fast, "chat", body("chat", LONG, stream=True))),
        asyncio.ensure_future(call(http, s.fast, "comp", body("comp", LONG))),
    ]

    def generating() -> bool:
        ids = live_ids(r, s.stream)
        tokens = [len(recorded_tokens(r, i)) for i in ids]
        return len(ids) == 2 and min(tokens) >= 3

    await asyncio.to_thread(wait_for, generating, 30, "two requests generating", 0.02)
    queued = [
        asyncio.ensure_future(call(http, s.fast, "comp", body("comp", 4, stream=True))),
        asyncio.ensure_future(call(http, s.fast, "chat", body("chat", 4))),
        asyncio.ensure_future(call(http, s.fast, "chat", body("chat", 4))),
    ]
    await asyncio.to_thread(wait_for, lambda: r.xlen(s.stream) == 5, 10, "queued", 0.02)
    patient = asyncio.ensure_future(call(http, s.patient, "comp", body("comp", PATIENT_TOKENS)))
    await asyncio.to_thread(wait_for, lambda: r.xlen(s.stream) == 6, 10, "queued", 0.02)
    ids = live_ids(r, s.stream)
    worker.kill()
    killed = time.monotonic()
    late = await call(http, s.fast, "chat", body("chat", 4))  # sent right after the kill
    failed = await asyncio.gather(*running, *queued)
    return [*failed, late], patient, killed, ids


def test_requests_of_a_model_whose_worker_died_fail_fast_and_stay_cancelled(setup):
    s, worker = setup
    r = redis.Redis.from_url(s.redis_url)
    for base in (s.fast, s.patient):  # each API has loaded the tokenizer
        resp = httpx.post(f"{base}/v1/completions", json=body("comp", 1), timeout=60)
        assert resp.status_code == 200, resp.text

    async def run():
        async with httpx.AsyncClient(timeout=120) as http:
            return await observe(http)

    async def observe(http: httpx.AsyncClient):
        failed, patient, killed, ids = await load_then_kill(http, s, worker, r)
        took = [assert_no_worker(o, killed) for o in failed]
        print(f"no_worker answers {min(took):.2f}..{max(took):.2f}s after the kill (TTL {TTL}s)")
        # The fast API's requests are cancelled in Redis; the patient one still waits.
        states = [r.hget(Keys().req(i), "state") for i in ids]
        assert states == [b"cancelled"] * 5 + [b"queued"], states
        await asyncio.to_thread(after_the_model_is_gone, s)
        back = await asyncio.to_thread(
            start_worker, s.redis_url, s.model, "w-back", s.logs, heartbeat_ttl=TTL
        )
        try:
            return await patient, ids, back
        except BaseException:
            back.kill()
            raise

    patient, ids, back = asyncio.run(run())
    try:
        assert patient.status == 200, patient.body
        assert patient.body["usage"]["completion_tokens"] == PATIENT_TOKENS
        # The worker that came back dropped every cancelled entry and ran only the patient one.
        wait_for(lambda: r.xlen(s.stream) == 0, 30, "the cancelled entries dropped")
        assert r.xpending(s.stream, GROUP)["pending"] == 0
        assert [r.hget(Keys().req(i), "state") for i in ids] == [b"failed"] * 5 + [b"finished"]
        # Idle now: its count of generated tokens stops at the patient request's.
        tokens = lambda: int(heartbeat(s.redis_url, "w-back")["tokens_total"])  # noqa: E731
        wait_for(lambda: tokens() >= PATIENT_TOKENS, 10, "the heartbeat to count the tokens")
        assert tokens() == PATIENT_TOKENS
    finally:
        kill_all([back])


def after_the_model_is_gone(s: Setup) -> None:
    """Once the heartbeat expired: /ready says 503, a new request gets 503 at once, an unknown
    model is still a 404."""
    wait_for(lambda: httpx.get(f"{s.fast}/ready").status_code == 503, 10, "/ready to say 503")
    started = time.monotonic()
    resp = httpx.post(f"{s.fast}/v1/completions", json=body("comp", 4), timeout=30)
    assert time.monotonic() - started < 1.0
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "no_worker"
    assert int(resp.headers["retry-after"]) > 0
    client = openai.OpenAI(base_url=f"{s.fast}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.InternalServerError) as exc:
        client.completions.create(model=s.model, prompt="x", max_tokens=2)
    assert exc.value.status_code == 503 and exc.value.response.headers["retry-after"]
    unknown = httpx.post(f"{s.fast}/v1/completions", json={"prompt": "x", "model": "nope"})
    assert unknown.status_code == 404
