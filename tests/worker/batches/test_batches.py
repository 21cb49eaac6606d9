"""The OpenAI Batch API against real processes only: redis-server, `llmq worker` (Celery, threads
pool), `llmq api` (uvicorn), driven by the real openai client. Batch outputs are checked against
the same requests sent alone; malformed lines, cancels, expiry, and interactive requests first."""

from __future__ import annotations

import asyncio
import json
import statistics
import time

import openai
import pytest

from llmq.common.transport import Keys
from tests.worker.batches.batch_stack import (
    FINAL,
    GREEDY,
    PROMPTS,
    assert_output_lines,
    chat_body,
    chat_lines,
    create_batch,
    jsonl,
    line,
    wait_batch,
)


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

    from llmq.common.storage.store import Store
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

    from llmq.common.storage.store import Store
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
