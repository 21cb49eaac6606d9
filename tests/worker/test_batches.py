"""The OpenAI Files and Batch APIs against real processes only: redis-server, `llmq worker`
(Celery, threads pool), `llmq api` (uvicorn), `llmq flower`, `llmq batch submit`, driven by the
real openai client. Batch outputs are checked against the same requests sent alone."""

from __future__ import annotations

import asyncio
import json
import re
import statistics
import subprocess
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import psutil
import pytest
import redis

from llmq.common.redis_server import RedisServer, free_port
from llmq.common.transport import Keys
from tests.harness import (
    LLMQ,
    Proc,
    base_env,
    heartbeat,
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
            if api is not None:
                api.terminate()
            (s.worker if s is not None else worker).terminate()


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("batch-logs")


@pytest.fixture(scope="module")
def main(llama_dir, logs):
    """The Redis, worker and API shared by the tests of this module."""
    with stack(llama_dir, logs, "wb-main") as s:
        WORKERS.append(s.worker)
        yield s


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


# ---- 1. outputs equal the same requests sent alone -----------------------------------------
def test_batches_equal_requests_sent_alone(main):
    client = main.client()
    model = main.model
    chat = {f"chat-{i}": chat_body(model, p) for i, p in enumerate(PROMPTS)}
    comp = {
        f"comp-{i}": {"model": model, "prompt": p, "max_tokens": 16, **GREEDY}
        for i, p in enumerate(PROMPTS[:4])
    }
    chat_batch = create_batch(
        client, [line(cid, "/v1/chat/completions", b) for cid, b in chat.items()]
    )
    comp_batch = create_batch(
        client, [line(cid, "/v1/completions", b) for cid, b in comp.items()], "/v1/completions"
    )
    assert chat_batch.status == "validating" and chat_batch.endpoint == "/v1/chat/completions"
    assert comp_batch.endpoint == "/v1/completions"

    # The same requests, one at a time, while the batches run.
    extra = {"ignore_eos": True}
    alone_chat = {}
    for cid, b in chat.items():
        r = client.chat.completions.create(
            model=model, messages=b["messages"], max_tokens=16, temperature=0, extra_body=extra
        )
        alone_chat[cid] = r.choices[0].message.content
    alone_comp = {}
    for cid, b in comp.items():
        r = client.completions.create(
            model=model, prompt=b["prompt"], max_tokens=16, temperature=0, extra_body=extra
        )
        alone_comp[cid] = r.choices[0].text
    assert len(set(alone_chat.values())) == len(chat), "reference texts are not varied"
    assert len(set(alone_comp.values())) == len(comp), "reference texts are not varied"

    for batch, alone, obj in (
        (chat_batch, alone_chat, "chat.completion"),
        (comp_batch, alone_comp, "text_completion"),
    ):
        done = wait_batch(client, batch.id, 60)
        n = len(alone)
        assert done.status == "completed", (done, main.logs_tail())
        assert done.request_counts.total == n
        assert done.request_counts.completed == n
        assert done.request_counts.failed == 0
        assert done.error_file_id is None
        assert done.in_progress_at and done.finalizing_at and done.completed_at
        assert done.created_at <= done.in_progress_at <= done.completed_at
        out = client.files.retrieve(done.output_file_id)
        assert out.purpose == "batch_output"
        bodies = assert_output_lines(jsonl(client, done.output_file_id), set(alone), obj)
        for cid, body in bodies.items():
            choice = body["choices"][0]
            text = choice["message"]["content"] if obj == "chat.completion" else choice["text"]
            assert text == alone[cid], (cid, text, alone[cid])
            assert choice["finish_reason"] == "length"
            assert body["usage"]["completion_tokens"] == 16
    listed = [b.id for b in client.batches.list(limit=100).data]
    assert chat_batch.id in listed and comp_batch.id in listed
    with pytest.raises(openai.BadRequestError):  # a completed batch cannot be cancelled
        client.batches.cancel(chat_batch.id)
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch-nope")
    with pytest.raises(openai.NotFoundError):
        client.batches.create(
            input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h"
        )
    # OpenAI's bounds on the window and the metadata; nothing is created.
    before = len(client.batches.list(limit=100).data)
    f = client.files.create(file=("x.jsonl", b"{}\n"), purpose="batch")
    for bad in (
        {"completion_window": "0h"},
        {"completion_window": "169h"},
        {"completion_window": "24 hours"},
        {"metadata": {f"k{i}": "v" for i in range(17)}},
        {"metadata": {"k" * 65: "v"}},
        {"metadata": {"k": "v" * 513}},
    ):
        args = {"completion_window": "24h", **bad}
        with pytest.raises(openai.BadRequestError) as exc:
            client.batches.create(input_file_id=f.id, endpoint="/v1/completions", **args)
        assert exc.value.param.split(".")[0] in bad, (bad, exc.value.param)
    assert len(client.batches.list(limit=100).data) == before


# ---- 5. malformed lines fail alone; a file that is not JSONL fails validation ---------------
def test_malformed_lines_fail_alone_and_non_jsonl_fails_validation(main):
    client = main.client()
    model = main.model
    good = [
        line(f"ok-{i}", "/v1/chat/completions", chat_body(model, p, 4))
        for i, p in enumerate(PROMPTS[:2])
    ]
    bad = {
        "{this is not json": None,
        "[1, 2, 3]": None,
        line(
            "wrong-url", "/v1/completions", {"model": model, "prompt": "x", "max_tokens": 2}
        ): "wrong-url",
        json.dumps(
            {"custom_id": "no-body", "method": "POST", "url": "/v1/chat/completions"}
        ): "no-body",
        # Well-formed, but the API refuses it (no messages): a 400 for this line only.
        line("refused", "/v1/chat/completions", {"model": model, "max_tokens": 2}): "refused",
    }
    lines = [good[0], *bad, good[1]]
    batch = create_batch(client, lines)
    done = wait_batch(client, batch.id, 60)
    assert done.status == "completed", (done, main.logs_tail())
    assert done.errors is None
    counts = done.request_counts
    assert (counts.total, counts.completed, counts.failed) == (len(lines), 2, len(bad)), counts
    assert_output_lines(jsonl(client, done.output_file_id), {"ok-0", "ok-1"}, "chat.completion")
    errors = jsonl(client, done.error_file_id)
    assert len(errors) == len(bad)
    assert sorted(str(e["custom_id"]) for e in errors) == sorted(str(c) for c in bad.values())
    for e in errors:
        assert e["id"].startswith("batch_req_")
        status = e["response"]["status_code"]
        assert 400 <= status < 500, e
        err = e["response"]["body"]["error"]
        assert err["message"] and err["type"] == "invalid_request_error", e

    # Not JSONL at all: the whole batch fails validation.
    f = client.files.create(
        file=("notes.jsonl", b"hello world\nthis is not json\n"), purpose="batch"
    )
    failed = client.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    failed = wait_batch(client, failed.id, 30)
    assert failed.status == "failed", failed
    assert failed.failed_at is not None and failed.output_file_id is None
    assert failed.errors.data[0].message, failed.errors
    assert failed.errors.data[0].code == "invalid_json_line"

    # Two lines with one custom_id: also a validation failure.
    dup = [good[0], good[0]]
    failed = wait_batch(client, create_batch(client, dup).id, 30)
    assert failed.status == "failed" and failed.errors.data[0].code == "duplicate_custom_id"
    assert "ok-0" in failed.errors.data[0].message


# ---- 3. cancel -----------------------------------------------------------------------------
def test_cancel_running_batch_keeps_finished_lines(main):
    client = main.client()
    n = 400
    batch = create_batch(client, chat_lines(main.model, n, 32, "c"))
    wait_batch(client, batch.id, 60, lambda b: b.request_counts.completed >= 1 or b.status in FINAL)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled"), cancelling
    done = wait_batch(client, batch.id, 30)
    assert done.status == "cancelled", (done, main.logs_tail())
    assert done.cancelling_at and done.cancelled_at
    rows = jsonl(client, done.output_file_id)
    assert 1 <= len(rows) < n, len(rows)
    assert done.request_counts.completed == len(rows)
    ids = {r["custom_id"] for r in rows}
    assert ids <= {f"c{i}" for i in range(n)}
    assert_output_lines(rows, ids, "chat.completion")
    for r in rows:
        assert r["response"]["body"]["usage"]["completion_tokens"] == 32
    # As OpenAI: the lines that never ran are in the error file, every custom_id exactly once.
    unrun = jsonl(client, done.error_file_id)
    assert all(r["response"] is None and r["error"]["code"] == "batch_cancelled" for r in unrun), (
        unrun[:3]
    )
    assert sorted(r["custom_id"] for r in rows + unrun) == sorted(f"c{i}" for i in range(n))
    # Its lines in flight were cancelled on the engine too.
    main.wait_idle(20)
    # Cancelling it again changes nothing.
    again = client.batches.cancel(batch.id)
    assert again.status == "cancelled"


def test_cancel_landing_after_the_last_line_ends_cancelled(main):
    """The race between a task that ran its last line and a cancel: the task must end the
    batch cancelled (with all its lines), not leave it in "cancelling". Driven in-process on
    a key prefix no worker watches, so nothing else touches the batch."""
    import redis.asyncio as aioredis

    from llmq.common.store import Store
    from llmq.worker.batch.run import BatchRun

    async def run() -> tuple[dict, list[str]]:
        client = aioredis.Redis.from_url(main.redis_url)
        store = Store(client, Keys("llmqrace"))
        try:
            f = await store.create_file("in.jsonl", "batch", b"{}\n")
            batch = await store.create_batch(f["id"], "/v1/chat/completions", "24h", None)
            bid = batch["id"]
            await store.update_batch(bid, total=1)
            assert await store.transition(bid, "in_progress", ("validating",))
            out = {"id": "batch_req_x", "custom_id": "a", "error": None}
            out["response"] = {"status_code": 200, "request_id": "r", "body": {}}
            task = BatchRun(bid)
            task.use(store)
            assert await task.checkpoint.record(1, out, ok=True)
            # The task saw "in_progress" after its last line; the cancel lands now.
            assert await store.transition(bid, "cancelling", ("validating", "in_progress"))
            assert await store.acquire_lease(bid, task.owner, 30)
            await task._finalize(batch, "completed", ("in_progress", "finalizing"))
            done = await store.get_batch(bid)
            content = await store.file_content(done["output_file_id"])
            return done, content.decode().splitlines()
        finally:
            await client.aclose()

    done, rows = asyncio.run(run())
    assert done["status"] == "cancelled", done
    assert done["cancelled_at"] and done["request_counts"]["completed"] == 1
    assert [json.loads(r)["custom_id"] for r in rows] == ["a"]


def test_a_batch_past_its_window_expires_with_its_unrun_lines_in_the_error_file(main):
    """Driven in-process on a key prefix no worker watches: a batch whose window has passed
    ends expired, and every line it did not run is in the error file as batch_expired."""
    import redis.asyncio as aioredis

    from llmq.common.store import Store
    from llmq.worker.batch.run import BatchRun

    async def run() -> tuple[dict, list[dict]]:
        client = aioredis.Redis.from_url(main.redis_url)
        store = Store(client, Keys("llmqexpiry"))
        try:
            content = "\n".join(chat_lines(main.model, 3, 4, "x")).encode()
            f = await store.create_file("in.jsonl", "batch", content)
            batch = await store.create_batch(f["id"], "/v1/chat/completions", "24h", None)
            bid = batch["id"]
            await store.update_batch(bid, expires_at=int(time.time()) - 1)
            task = BatchRun(bid)
            task.use(store)
            assert await store.acquire_lease(bid, task.owner, 30)
            await task._run()
            done = await store.get_batch(bid)
            errors = await store.file_content(done["error_file_id"])
            return done, [json.loads(x) for x in errors.decode().splitlines()]
        finally:
            await client.aclose()

    done, rows = asyncio.run(run())
    assert done["status"] == "expired" and done["expired_at"], done
    assert [r["custom_id"] for r in rows] == ["x0", "x1", "x2"]
    assert all(r["response"] is None and r["error"]["code"] == "batch_expired" for r in rows)


def test_background_loops_end_when_their_cancel_is_lost():
    """On Python 3.11 redis-py can swallow a cancel() that lands while it opens a connection
    (asyncio.wait_for, gh-86296). The batch task's lease renewal and cancel watcher must still
    end, or a finished run hangs with its lease renewed forever (seen: a batch with every line
    recorded stuck "in_progress"). The store here swallows the cancel as redis-py does."""
    from llmq.worker.batch.run import BatchRun

    class SwallowingStore:
        def __init__(self):
            self.entered = asyncio.Event()
            self.lost = 0

        async def _call(self):
            self.entered.set()
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                if self.lost:  # only the first cancel is lost, as in redis-py's handshake
                    raise
                self.lost += 1
            return "in_progress"

        async def status(self, batch_id):
            return await self._call()

        async def renew_lease(self, batch_id, owner, ttl):
            return await self._call()

        async def get_batch(self, batch_id):
            return None

    async def scenario(loop_of) -> None:
        run = BatchRun("batch-x")
        run.store = SwallowingStore()
        stop = asyncio.Event()
        task = asyncio.create_task(loop_of(run, stop))
        await asyncio.wait_for(run.store.entered.wait(), 10)
        stop.set()
        task.cancel()
        done, _ = await asyncio.wait([task], timeout=8)
        task.cancel()  # a loop that missed its stop: end it here, and fail below
        await asyncio.gather(task, return_exceptions=True)
        assert run.store.lost == 1 and done, "the loop kept running after its cancel was lost"

    asyncio.run(scenario(lambda run, stop: run._watch_cancel(stop)))
    asyncio.run(scenario(lambda run, stop: run._renew_lease(stop)))


# ---- 2. interactive requests go first ------------------------------------------------------
def test_interactive_ttft_while_batch_runs(main):
    """Median TTFT of sequential streaming chat requests during a 500-line batch stays within
    2x of its idle value (queued behind the batch's lines, it would be seconds). On the tiny
    model an engine turn costs about the same for 1 or 16 sequences, so the difference is the
    turn an arrival waits for plus the batch's own work (its lines' I/O in the worker process,
    one Redis call per turn carrying every token)."""
    client = main.client()
    model = main.model
    main.wait_idle(30)

    def ttft() -> float:
        t0 = time.perf_counter()
        stream = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Say something about Redis streams."}],
            max_tokens=4,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        first = None
        for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.role is None:
                first = time.perf_counter() - t0  # the first token's chunk (after the role's)
        assert first is not None
        return first

    def measure(n: int = 500) -> tuple[float, str]:
        idle = [ttft() for _ in range(20)]  # 20 before the batch and 20 after it
        batch = create_batch(client, chat_lines(model, n, 32, "t"))
        # Measure once the batch is in its stride.
        wait_batch(
            client, batch.id, 60, lambda b: b.request_counts.completed >= 16 or b.status in FINAL
        )
        before = client.batches.retrieve(batch.id)
        busy = [ttft() for _ in range(40)]
        after = client.batches.retrieve(batch.id)
        client.batches.cancel(batch.id)
        done = wait_batch(client, batch.id, 30)
        main.wait_idle(20)
        # Idle again: the baseline brackets the busy figures (the machine's own load drifts).
        idle += [ttft() for _ in range(20)]

        idle_ms, busy_ms = statistics.median(idle) * 1000, statistics.median(busy) * 1000
        report = (
            f"TTFT median idle {idle_ms:.1f} ms, during a {n}-line batch {busy_ms:.1f} ms "
            f"(ratio {busy_ms / idle_ms:.2f}); batch lines done {before.request_counts.completed}"
            f" -> {after.request_counts.completed} while measuring;"
            f" idle {[round(x * 1000) for x in idle]} busy {[round(x * 1000) for x in busy]}"
        )
        print("\n" + report)
        # The batch really ran while we measured, and the cancel ended it.
        assert before.status == "in_progress" and after.status == "in_progress", (before, after)
        assert after.request_counts.completed > before.request_counts.completed, report
        assert after.request_counts.completed < n, report
        assert done.status == "cancelled", done
        return busy_ms / idle_ms, report

    ttft()  # warm up
    # Two cores carry the client, the API, Redis and the worker here; how the OS places them
    # shifts a whole round's busy figures by a millisecond or two (ratios 0.9-1.53 over runs of
    # the same code, the worst with other work on the machine), so a round that misses is
    # measured once more.
    ratio, report = measure()
    if ratio > 2.0:
        ratio, report = measure()
    assert ratio <= 2.0, report


# ---- 6. Flower -----------------------------------------------------------------------------
def test_flower_lists_worker_and_batch_task(main):
    port = free_port()
    password = "flower-secret"
    env = base_env(main.redis_url, main.model, flower_password=password, flower_port=port)
    flower = Proc([LLMQ, "flower"], env, main.logs / "flower.log")
    base = f"http://127.0.0.1:{port}"
    auth = ("admin", password)
    try:

        def workers():
            if not flower.alive():
                raise RuntimeError(f"flower exited:\n{flower.log()}")
            try:
                r = httpx.get(f"{base}/api/workers", params={"refresh": "1"}, auth=auth, timeout=10)
            except httpx.HTTPError:
                return None
            return r.json() if r.status_code == 200 and hostname in r.json() else None

        hostname = f"celery@{main.worker_name}"  # Celery's node name for --hostname=NAME
        listed = wait_for(workers, 60, "Flower to list the worker", 0.5)
        assert listed[hostname]["active_queues"][0]["name"] == "llmq.batch", listed[hostname]

        client = main.client()
        batch = create_batch(client, chat_lines(main.model, 2, 4, "f"))
        assert wait_batch(client, batch.id, 60).status == "completed"

        def task():
            r = httpx.get(f"{base}/api/tasks", auth=auth, timeout=10)
            assert r.status_code == 200, r.text
            for task_id, t in r.json().items():
                ours = t.get("name") == "llmq.batch.run" and batch.id in str(t.get("args"))
                if ours and t.get("state") == "SUCCESS":
                    return task_id, t
            return None

        task_id, t = wait_for(task, 30, "Flower to show the batch task", 0.5)
        assert t["worker"] == hostname, t
        one = httpx.get(f"{base}/api/task/info/{task_id}", auth=auth, timeout=10)
        assert one.status_code == 200 and one.json()["name"] == "llmq.batch.run"

        cmdline = " ".join(psutil.Process(flower.proc.pid).cmdline())
        assert "flower" in cmdline and password not in cmdline  # `ps` shows no password
        for path in ("/api/workers", "/api/tasks"):
            assert httpx.get(f"{base}{path}", timeout=10).status_code == 401
            assert (
                httpx.get(f"{base}{path}", auth=("admin", "wrong"), timeout=10).status_code == 401
            )
    finally:
        flower.terminate(10)


def test_files_list_pages_filters_and_orders(main):
    """Pages by limit and after over every file, filtered by purpose before paging, newest or
    oldest first."""
    client = main.client()
    mine = [client.files.create(file=(f"u{i}.txt", b"x"), purpose="user_data").id for i in range(5)]
    client.files.create(file=("b.jsonl", b"{}\n"), purpose="batch")  # newer, other purpose
    pages, after = [], None
    while True:
        kw = {"after": after} if after else {}
        page = client.files.list(purpose="user_data", limit=2, **kw)
        pages.append([f.id for f in page.data])
        if not page.has_more:
            break
        after = page.data[-1].id
    assert [i for p in pages for i in p][:5] == mine[::-1] and len(pages[0]) == 2
    r = httpx.get(f"{main.base}/v1/files", params={"purpose": "user_data", "order": "asc"})
    assert [f["id"] for f in r.json()["data"]][-5:] == mine
    r = httpx.get(f"{main.base}/v1/files", params={"order": "sideways"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "order"
    r = httpx.post(
        f"{main.base}/v1/files", files={"file": ("x", b"x")}, data={"purpose": "batch_output"}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "purpose"


def test_ids_from_paths_are_checked_before_any_key_is_built(main):
    """An id that is not of the form the store gives (``file-<32 hex>``, ``batch-<32 hex>``)
    is a 404, whatever key it would name: ``<id>:content`` is another object's key."""
    client = main.client()
    f = client.files.create(file=("u.txt", b"x"), purpose="user_data")
    for path in (
        f"/v1/files/{f.id}:content",
        f"/v1/files/{f.id}:content/content",
        "/v1/files/results",
        f"/v1/batches/{f.id}",
        "/v1/batches/active",
        "/v1/batches/batch-1",
    ):
        r = httpx.get(f"{main.base}{path}")
        assert r.status_code == 404, (path, r.status_code, r.text)
    r = httpx.post(f"{main.base}/v1/batches/active/cancel")
    assert r.status_code == 404, r.text
    r = httpx.delete(f"{main.base}/v1/files/{f.id}:content")
    assert r.status_code == 404 and client.files.content(f.id).content == b"x"
    body = {"input_file_id": f"{f.id}:content", "endpoint": "/v1/completions"}
    assert httpx.post(f"{main.base}/v1/batches", json=body).status_code == 404


# ---- 7. `llmq batch submit --wait` ---------------------------------------------------------
def test_batch_submit_cli_waits_and_writes_output(main, tmp_path):
    n = 8
    path = tmp_path / "jobs.jsonl"
    lines = chat_lines(main.model, n, 8, "cli")
    lines.insert(3, "{broken")
    path.write_text("\n".join(lines) + "\n")
    proc = subprocess.run(
        [LLMQ, "batch", "submit", str(path), "--wait", "--base-url", main.base],
        capture_output=True,
        text=True,
        timeout=120,
        env=base_env(main.redis_url, main.model),
    )
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    assert "created from" in proc.stdout, proc.stdout
    assert f"completed: {n} completed, 1 failed" in proc.stdout, proc.stdout
    assert f"{n + 1}/{n + 1} (1 failed) completed" in proc.stderr, proc.stderr
    assert "HTTP Request" not in proc.stderr, proc.stderr  # nothing breaks the progress bar
    out = tmp_path / "jobs.output.jsonl"
    assert f"output: {out}" in proc.stdout, proc.stdout
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert_output_lines(rows, {f"cli{i}" for i in range(n)}, "chat.completion")
    errors = tmp_path / "jobs.errors.jsonl"
    assert f"errors: {errors}" in proc.stdout, proc.stdout
    bad = [json.loads(x) for x in errors.read_text().splitlines()]
    assert len(bad) == 1 and bad[0]["response"]["status_code"] == 400


def test_batch_submit_cli_takes_the_endpoint_from_the_file_and_fails_when_every_line_does(
    main, tmp_path
):
    env = base_env(main.redis_url, main.model)
    comp = tmp_path / "comp.jsonl"
    body = {"model": main.model, "prompt": "hi", "max_tokens": 2, **GREEDY}
    comp.write_text(line("c0", "/v1/completions", body) + "\n")
    argv = [LLMQ, "batch", "submit", "--wait", "--base-url", main.base]
    proc = subprocess.run([*argv, str(comp)], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    assert "completed: 1 completed, 0 failed" in proc.stdout, proc.stdout
    rows = [json.loads(x) for x in (tmp_path / "comp.output.jsonl").read_text().splitlines()]
    assert rows[0]["response"]["body"]["object"] == "text_completion"
    # Every line failed: no success to a script.
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{broken\n" + line("c1", "/v1/completions", {"prompt": ""}) + "\n")
    proc = subprocess.run([*argv, str(bad)], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert "0 completed, 2 failed" in proc.stdout, proc.stdout
    # No API there: one line, no traceback.
    proc = subprocess.run(
        [LLMQ, "batch", "submit", str(comp), "--base-url", "http://127.0.0.1:9"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("llmq batch: cannot reach http://127.0.0.1:9/"), proc.stderr


# ---- 4. a worker killed mid-batch (last: it replaces the shared worker) --------------------
def test_batch_survives_killed_worker(main):
    client = main.client()
    n = 200
    # A few distinct prompts, each on many lines: a resumed line must give the same text.
    lines = [
        line(f"k{i}", "/v1/chat/completions", chat_body(main.model, PROMPTS[i % 4], 24))
        for i in range(n)
    ]
    batch = create_batch(client, lines)
    mid = wait_batch(
        client, batch.id, 90, lambda b: b.request_counts.completed >= 20 or b.status in FINAL
    )
    assert mid.status == "in_progress", mid
    victim = main.worker
    holder = main.redis().get(Keys().batch_lease(batch.id))
    assert holder, "the running task holds the batch's lease"
    victim.kill()  # SIGKILL, whole process group: no warm shutdown, no lease release
    killed_at = time.monotonic()
    at_kill = client.batches.retrieve(batch.id).request_counts.completed
    assert at_kill < n
    main.worker = start_worker(main.redis_url, main.model, "wb-2", main.logs, wait=False)
    WORKERS.append(main.worker)
    main.worker_name = "wb-2"
    done = wait_batch(client, batch.id, 120)
    took = time.monotonic() - killed_at
    log = main.worker.log(50000)
    how = (
        "re-dispatched by the supervisor" if "dispatching it again" in log else "broker redelivery"
    )
    print(f"\nkilled at {at_kill}/{n} lines; completed {took:.1f} s after the kill ({how})")
    assert done.status == "completed", (done, log)
    assert done.request_counts.completed == n and done.request_counts.failed == 0, done
    bodies = assert_output_lines(
        jsonl(client, done.output_file_id), {f"k{i}" for i in range(n)}, "chat.completion"
    )
    texts: dict[int, set[str]] = {}
    for cid, body in bodies.items():
        assert body["usage"]["completion_tokens"] == 24, body
        texts.setdefault(int(cid[1:]) % 4, set()).add(body["choices"][0]["message"]["content"])
    assert all(len(v) == 1 for v in texts.values()), texts
    assert len({next(iter(v)) for v in texts.values()}) == 4
    # The new worker's task ran only the lines not yet recorded.
    rerun = re.search(rf"batch {batch.id}: {n} lines, (\d+) to run", log)
    assert rerun and 0 < int(rerun.group(1)) <= n - at_kill, log
