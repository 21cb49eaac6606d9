"""The Batch API under faults, against real processes (redis-server, `llmq worker`, `llmq api`,
the openai client): an upload past the limits refused as it streams in, a line whose record
fails, lines that meet no worker, a run that loses its lease. Every custom_id ends exactly once
across the output and error files."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import openai
import pytest

from llmq.common.transport import Keys
from tests.harness import kill_all, start_worker, wait_for
from tests.worker.batches.batch_stack import (
    LEASE,
    assert_output_lines,
    chat_lines,
    create_batch,
    jsonl,
    stack,
    wait_batch,
)

MAX_FILE_BYTES = 16 * 1024 * 1024
RETRY = {"batch_retry_initial": 0.2, "batch_retry_max": 1.0, **LEASE}


@pytest.fixture(scope="module")
def main(llama_dir, tmp_path_factory):
    """One worker (quick line retries) and one API with a 16 MiB file limit."""
    logs = tmp_path_factory.mktemp("batch-fault-logs")
    api = {"max_file_bytes": MAX_FILE_BYTES}
    with stack(llama_dir, logs, "wf-main", api, **RETRY) as s:
        yield s


def rss_bytes(pid: int) -> int:
    for row in Path(f"/proc/{pid}/status").read_text().splitlines():
        if row.startswith("VmRSS:"):
            return int(row.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def content_keys(s) -> list[bytes]:
    return sorted(s.redis().scan_iter(match="llmq:files:*:content"))


def finished_once(s, batch_id: str, ids: set[str]) -> openai.types.Batch:
    """The batch completed with every line answered 200, each custom_id exactly once, and
    its checkpoint deleted."""
    client = s.client()
    done = wait_batch(client, batch_id, 120)
    assert done.status == "completed", (done, s.logs_tail())
    assert done.request_counts.completed == len(ids) and done.request_counts.failed == 0, done
    assert jsonl(client, done.error_file_id) == []
    assert_output_lines(jsonl(client, done.output_file_id), ids, "chat.completion")
    r = s.redis()
    assert not r.exists(Keys().batch_results(batch_id), Keys().batch_attempts(batch_id))
    return done


# ---- (a) limits checked while the upload streams in -----------------------------------------
def test_uploads_past_the_line_or_byte_limit_are_refused_as_they_stream_in(main):
    client = main.client()
    client.files.create(file=("warm.jsonl", b"{}\n"), purpose="batch")  # the parser's imports
    before_keys = content_keys(main)
    line = json.dumps({"custom_id": "x" * 8, "body": {}}) + "\n"
    lines = (line * 200_000).encode()
    assert len(lines) < MAX_FILE_BYTES  # refused for its lines, not its bytes
    pid = main.api.proc.pid
    rss = rss_bytes(pid)
    t0 = time.monotonic()
    with pytest.raises(openai.BadRequestError) as exc:
        client.files.create(file=("big.jsonl", lines), purpose="batch")
    took = time.monotonic() - t0
    grew = rss_bytes(pid) - rss
    print(f"\n200,000 lines ({len(lines)} bytes) refused in {took:.2f}s; API RSS +{grew} bytes")
    assert exc.value.status_code == 400 and exc.value.code == "too_many_lines"
    assert exc.value.param == "file" and "50000" in exc.value.message
    assert took < 60
    assert grew < 2 * len(lines), grew
    # Over the byte limit: refused the same way, nothing of it left in Redis.
    with pytest.raises(openai.BadRequestError) as exc:
        client.files.create(file=("huge.bin", b"x" * (MAX_FILE_BYTES + 1)), purpose="user_data")
    assert exc.value.code == "file_too_large" and str(MAX_FILE_BYTES) in exc.value.message
    assert content_keys(main) == before_keys
    # At the limit, 50,000 lines are taken and read back whole.
    ok = (line * 50_000).encode()
    f = client.files.create(file=("ok.jsonl", ok), purpose="batch")
    assert f.bytes == len(ok) and client.files.content(f.id).content == ok
    assert main.redis().llen(Keys().file_content(f.id)) == -(-len(ok) // (1 << 20))


# ---- (b) a record that fails is written again ------------------------------------------------
def test_a_line_whose_record_fails_still_appears_exactly_once(main):
    client = main.client()
    n = 200
    batch = create_batch(client, chat_lines(main.model, n, 8, "rec"))
    r = main.redis()
    results = Keys().batch_results(batch.id)
    wait_batch(client, batch.id, 60, lambda b: b.request_counts.completed >= 5)
    # The results key of the wrong type for a while: every record fails (WRONGTYPE).
    with r.pipeline(transaction=True) as pipe:
        pipe.rename(results, results + ":aside").set(results, "not a hash").execute()
    failed = f"batch {batch.id}: recording line"
    wait_for(lambda: failed in main.worker.log(200_000), 30, "a record to fail")
    r.rename(results + ":aside", results)  # back, with every row recorded before
    finished_once(main, batch.id, {f"rec{i}" for i in range(n)})


# ---- (c) temporary errors are retried --------------------------------------------------------
def test_lines_that_meet_no_worker_are_retried_until_one_serves_them(main, qwen2_dir):
    r = main.redis()
    late = start_worker(main.redis_url, qwen2_dir, "wf-late", main.logs)
    late.terminate()  # its model is known, and no worker serves it now
    wait_for(lambda: not r.exists(Keys().engine("wf-late")), 30, "wf-late to leave")
    client = main.client()
    lines = chat_lines(str(qwen2_dir), 6, 4, "late")
    batch = create_batch(client, lines)
    retried = f"batch {batch.id}: line 1 answered 503 no_worker; retrying"
    wait_for(lambda: retried in main.worker.log(200_000), 60, "a line to meet 503")
    late = start_worker(main.redis_url, qwen2_dir, "wf-late", main.logs)
    try:
        done = finished_once(main, batch.id, {f"late{i}" for i in range(6)})
        rows = jsonl(client, done.output_file_id)
        assert all(row["response"]["body"]["model"] == str(qwen2_dir) for row in rows)
        assert any("." in row["response"]["request_id"] for row in rows)  # a retry's ids
    finally:
        kill_all([late])


# ---- (d) a run that loses its lease stops; the holder finishes -------------------------------
def test_a_run_that_loses_its_lease_stops_and_the_batch_completes_once(main):
    client = main.client()
    n = 300
    batch = create_batch(client, chat_lines(main.model, n, 16, "lease"))
    wait_batch(client, batch.id, 60, lambda b: b.request_counts.completed >= 5)
    r = main.redis()
    lease = Keys().batch_lease(batch.id)
    assert r.set(lease, "thief", xx=True, px=60_000)  # another run holds it now
    # It notices at its next renewal (stopping its lines) or, done by then, when it tries to
    # finalize (the lease-fenced move refuses it).
    lost = f"batch {batch.id}: this run lost its lease"
    wait_for(lambda: lost in main.worker.log(200_000), 30, "the run to notice")
    mid = client.batches.retrieve(batch.id)
    assert mid.status == "in_progress" and mid.output_file_id is None, mid
    main.wait_idle(30)  # its lines in flight were cancelled on the engine
    r.delete(lease)  # the thief is gone: the supervisor dispatches the batch again
    finished_once(main, batch.id, {f"lease{i}" for i in range(n)})
    outputs = [f for f in client.files.list(purpose="batch_output").data if batch.id in f.filename]
    assert len(outputs) == 1, outputs  # finalized once
    log = main.worker.log(400_000)
    assert log.count(f"batch {batch.id}: {n} lines,") == 2, log  # the first run and the holder


# ---- retention -------------------------------------------------------------------------------
def test_files_past_their_retention_are_swept_with_their_bytes_given_back(main):
    """In process on a key prefix no worker watches: a file whose retention ended is deleted
    as its owner's delete does (content gone, bytes back); a batch's input is kept for the
    batch's window; every key has a TTL."""
    import redis.asyncio as aioredis

    from llmq.common.storage.store import Store

    keys = Keys("llmqretain")

    async def run() -> None:
        client = aioredis.Redis.from_url(main.redis_url)
        store = Store(client, keys, retention=3600)
        try:
            old = await store.create_file("old.jsonl", "batch", b"x" * 3000, "t1")
            kept = await store.create_file("in.jsonl", "batch", b"{}\n", "t1")
            batch = await store.create_batch(kept["id"], "/v1/completions", "24h", None, "t1")
            for key in (
                keys.file(old["id"]),
                keys.file_content(old["id"]),
                keys.batch(batch["id"]),
            ):
                assert await client.ttl(key) > 0, key
            assert await client.ttl(keys.file(kept["id"])) > 24 * 3600  # kept for the window
            assert int(await client.get(keys.tenant_bytes("t1"))) == 3003
            assert await client.zscore(keys.files_expiry, kept["id"]) > time.time() + 24 * 3600
            await client.zadd(keys.files_expiry, {old["id"]: 1})  # its retention ended
            assert await store.sweep_expired() == [old["id"]]
            assert not await client.exists(keys.file(old["id"]), keys.file_content(old["id"]))
            assert int(await client.get(keys.tenant_bytes("t1"))) == 3
            assert await store.get_file(kept["id"]) is not None
        finally:
            await client.aclose()

    asyncio.run(run())
