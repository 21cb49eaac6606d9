"""Cache-aware placement against real processes: a redis-server, `llmq worker` processes (one
torch thread each, started side by side) and `llmq api`, shared by the module's tests, which
run in order (the last ones freeze and kill workers)."""

from __future__ import annotations

import asyncio
import random
import signal

import httpx
import openai
import pytest
import redis

from llmq.common.placement.block_hashes import prompt_hashes
from llmq.common.transport import GROUP, Keys
from llmq.common.transport.redis_server import RedisServer
from tests.harness import (
    Proc,
    heartbeat,
    kill_all,
    start_api,
    start_worker,
    wait_for,
    wait_worker,
)

WORDS = ["red", "green", "blue", "amber", "violet", "cyan", "ochre", "umber", "teal", "olive"]
SETTINGS = dict(heartbeat_ttl=2, torch_threads=1, inactivity_timeout=60, kv_blocks=512)


class Fleet:
    def __init__(self, server: RedisServer, model, logs):
        self.server, self.model, self.logs = server, str(model), logs
        self.workers: dict[str, Proc] = {}
        self.r = redis.Redis.from_url(server.url)
        self.keys = Keys()

    def start(self, *names: str) -> None:
        self.launch(*names)
        self.wait(*names)

    def launch(self, *names: str) -> None:
        for name in names:  # side by side: each loads while the others do
            self.workers[name] = start_worker(
                self.server.url, self.model, name, self.logs, wait=False, **SETTINGS
            )

    def wait(self, *names: str) -> None:
        for name in names:
            wait_worker(self.server.url, name, self.workers[name])

    def served(self, name: str) -> int:
        return int(heartbeat(self.server.url, name).get("requests_total", 0) or 0)

    def holders(self, hashes: list[int]) -> list[str]:
        """The live workers whose published cached set holds the first block."""
        return [w for w in self.workers if self.r.sismember(self.keys.cached(w), hashes[0])]

    def wait_published(self, msgs: list[dict]) -> None:
        """Until a worker's published set holds the first block of ``msgs``' prompt, as the
        API hashes it (a worker refreshes its set with its heartbeat)."""
        hashes = prompt_hashes(prompt_ids(self.base, msgs), 16)
        wait_for(lambda: self.holders(hashes), 10, "a worker publishing the prompt's blocks")

    def pending(self, name: str) -> int:
        rows = self.r.xpending_range(self.keys.requests(self.model), GROUP, "-", "+", 100, name)
        return len(rows)


@pytest.fixture(scope="module")
def fleet(llama_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("placement")
    with RedisServer() as server:
        f = Fleet(server, llama_dir, logs)
        try:
            f.launch("w1", "w2")
            f.api, f.base = start_api(server.url, llama_dir, logs, **SETTINGS)  # as they load
            f.wait("w1", "w2")
            # Until the API's view of the live engines holds both, it places nothing (one
            # worker), and whichever reads first takes up to a turn's worth of requests.
            wait_for(lambda: _engines_seen(f.base) == 2, 30, "the API seeing both workers")
            yield f
        finally:
            kill_all([*f.workers.values(), getattr(f, "api", None)])


def _engines_seen(base: str) -> int:
    answer = httpx.get(f"{base}/ready")
    return answer.json().get("engines", 0) if answer.status_code == 200 else 0


def system_prompt(i: int, words: int = 60) -> str:
    """A system prompt of its own for each ``i`` (its words drawn from a generator seeded by it)."""
    rng = random.Random(i)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def messages(system: str, question: str) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


async def chat(base: str, msgs: list[dict], max_tokens: int = 4) -> tuple[str, dict]:
    """Streamed greedy chat; its text and usage."""
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    text, usage = [], None
    stream = await client.chat.completions.create(
        model=client_model(base),
        messages=msgs,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        text += [c.delta.content or "" for c in chunk.choices]
        usage = chunk.usage or usage
    await client.close()
    return "".join(text), usage.model_dump()


def client_model(base: str) -> str:
    return httpx.get(f"{base}/v1/models").json()["data"][0]["id"]


def gather(*coros):
    async def run():
        return await asyncio.gather(*coros)

    return asyncio.run(run())


def prompt_ids(base: str, msgs: list[dict]) -> list[int]:
    body = {"messages": msgs, "add_generation_prompt": True}
    return httpx.post(f"{base}/tokenize", json=body).json()["tokens"]


def full_hit(usage: dict) -> bool:
    prompt = usage["prompt_tokens"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return cached == min(prompt // 16 * 16, prompt - 1)


def test_repeated_prompts_reach_the_worker_that_holds_them(fleet):
    convs = [messages(system_prompt(i), f"question {i}") for i in range(6)]
    first = gather(*(chat(fleet.base, m) for m in convs))
    # The workers' caches and the API hash the same: their published sets, which placement
    # reads, come to hold every prompt (refreshed with the heartbeat).
    for m in convs:
        fleet.wait_published(m)
    again = gather(*(chat(fleet.base, m) for m in convs + convs))
    assert [t for t, _ in again] == [t for t, _ in first] * 2
    misses = [u for _, u in again if not full_hit(u)]
    assert not misses, misses  # unplaced, about half would land on the other worker
    # And the prompts spread (the counts are the heartbeats', refreshed each interval).
    served = len(first) + len(again)
    wait_for(lambda: fleet.served("w1") + fleet.served("w2") >= served, 10, "the heartbeats")
    assert fleet.served("w1") > 0 and fleet.served("w2") > 0


def _first_entry(fleet, base: str) -> tuple[dict, str]:
    """The stream entry of a request sent through ``base`` (seen while it runs), and its
    answer."""
    stream, seen = fleet.keys.requests(fleet.model), []

    async def watch():
        while not seen:
            seen.extend(f for _, f in fleet.r.xrange(stream) if f)
            await asyncio.sleep(0.005)

    async def run():
        watcher = asyncio.ensure_future(watch())
        text, _ = await chat(base, messages(system_prompt(9), "q"), max_tokens=48)
        await asyncio.wait_for(watcher, 5)
        return text

    text = asyncio.run(run())
    return seen[0], text


def test_placement_off_sends_requests_unplaced(fleet):
    proc, off = start_api(fleet.server.url, fleet.model, fleet.logs, "api-off", placement=False)
    try:
        unplaced, text_off = _first_entry(fleet, off)
        placed, text_on = _first_entry(fleet, fleet.base)
    finally:
        proc.terminate()
    assert b"target" not in unplaced and placed[b"target"] in (b"w1", b"w2")
    assert text_off == text_on


def test_a_late_worker_gets_work_once_it_heartbeats(fleet):
    fleet.start("w3")
    rounds = iter(range(100))

    def w3_served() -> bool:  # the API reads the live engines once a second
        i = next(rounds)
        gather(
            *(chat(fleet.base, messages(system_prompt(20 + i * 4 + j), "late")) for j in range(4))
        )
        return fleet.served("w3") > 0

    # Rounds until its heartbeat counts one (within a round or two here); the bound is for a
    # slow host's.
    wait_for(w3_served, 60, "the late worker to take work")


def _placed_burst_survives(fleet, sig: signal.Signals) -> str:
    """Requests sharing a cached prefix are placed; right after a worker has them in its
    pending list it gets ``sig``: every answer still equals the undisturbed one.

    Which worker takes the burst is the placer's choice (that repeated prompts reach their
    holder is the test above): it counts as holders the workers this API placed the prefix on
    in the last seconds besides those whose published set shows it, and weighs their loads."""
    system = system_prompt(40 + sig.value, words=80)
    convs = [messages(system, f"part {i}") for i in range(3)]
    expected = [t for t, _ in gather(*(chat(fleet.base, m, max_tokens=120) for m in convs))]
    fleet.wait_published(convs[0])

    async def burst():
        runs = [asyncio.ensure_future(chat(fleet.base, m, max_tokens=120)) for m in convs]
        while not (taken := [w for w in fleet.workers if fleet.pending(w)]):
            if all(r.done() for r in runs):
                raise AssertionError("the burst finished before any worker was seen holding it")
            await asyncio.sleep(0.002)
        holder = taken[0]
        fleet.workers[holder].proc.send_signal(sig)
        return holder, await asyncio.gather(*runs)

    holder, got = asyncio.run(burst())
    assert [t for t, _ in got] == expected
    return holder


def test_a_frozen_worker_has_its_placed_requests_taken_over(fleet):
    holder = _placed_burst_survives(fleet, signal.SIGSTOP)
    fleet.workers[holder].proc.send_signal(signal.SIGCONT)
    wait_worker(fleet.server.url, holder, fleet.workers[holder])


def test_a_worker_killed_with_placed_requests_loses_none(fleet):
    holder = _placed_burst_survives(fleet, signal.SIGKILL)
    fleet.workers.pop(holder).terminate()
