"""Tenants on one `llmq api` (real redis-server, the openai client, no worker: a batch is created
and cancelled without one): each API key sees only its own files and batches, another's answer
exactly as a missing id does, and each key's stored bytes stay under a quota, batch output
files counted."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import openai
import pytest
import redis
import redis.asyncio as aioredis

from llmq.common.storage.batch_checkpoint import LineCheckpoint
from llmq.common.storage.store import Store
from llmq.common.transport import Keys
from llmq.common.transport.redis_server import RedisServer
from llmq.worker.batch.finalize import finalize
from tests.harness import start_api

KEY_A, KEY_B, KEY_C = "key-a-0123456789", "key-b-0123456789", "key-c-0123456789"
QUOTA = 1000
MISSING_FILE, MISSING_BATCH = "file-" + "0" * 32, "batch-" + "0" * 32
CHAT = "/v1/chat/completions"


@dataclass
class Api:
    redis_url: str
    base: str

    def client(self, key: str, **kw) -> openai.OpenAI:
        kw = {"max_retries": 0, "timeout": 30, **kw}
        return openai.OpenAI(base_url=f"{self.base}/v1", api_key=key, **kw)

    def get(self, path: str, key: str, method: str = "GET") -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"}
        return httpx.request(method, f"{self.base}{path}", headers=headers, timeout=30)

    def held(self, key: str) -> int:
        """The bytes Redis counts against ``key``'s quota."""
        owner = hashlib.sha256(key.encode()).hexdigest()[:16]
        raw = redis.Redis.from_url(self.redis_url).get(Keys().tenant_bytes(owner))
        return int(raw or 0)


@pytest.fixture(scope="module")
def api(llama_dir, tmp_path_factory):
    """Three keys in one setting (spaces and empty items in it), a quota of QUOTA bytes."""
    logs = tmp_path_factory.mktemp("tenant-logs")
    keys = f" {KEY_A} , ,{KEY_B},{KEY_C},"
    with RedisServer() as server:
        proc, base = start_api(
            server.url, llama_dir, logs, "api-tenants", api_key=keys, tenant_quota_bytes=QUOTA
        )
        try:
            yield Api(server.url, base)
        finally:
            proc.terminate()


def jsonl_line(custom_id: str, pad: int = 0) -> bytes:
    body = {"model": "m", "messages": [{"role": "user", "content": "x" * pad}]}
    line = {"custom_id": custom_id, "method": "POST", "url": CHAT, "body": body}
    return (json.dumps(line) + "\n").encode()


def sized(n: int) -> bytes:
    """A one-line batch input file of exactly ``n`` bytes."""
    content = jsonl_line("q", n - len(jsonl_line("q")))
    assert len(content) == n
    return content


def assert_404_as_missing(api: Api, key: str, path: str, real: str, missing: str, method="GET"):
    """The answer for another tenant's id is the one for an id that does not exist."""
    seen = api.get(path.format(real), key, method)
    absent = api.get(path.format(missing), key, method)
    assert seen.status_code == absent.status_code == 404, (path, seen.text)
    assert seen.text.replace(real, "ID") == absent.text.replace(missing, "ID"), path


def test_another_key_sees_none_of_a_tenants_files_and_batches(api):
    a, b = api.client(KEY_A), api.client(KEY_B)
    content = jsonl_line("a0")
    fa = a.files.create(file=("a.jsonl", content), purpose="batch")
    ba = a.batches.create(input_file_id=fa.id, endpoint=CHAT, completion_window="24h")
    fb = b.files.create(file=("b.jsonl", content), purpose="batch")
    b_files = [f.id for f in b.files.list().data]
    assert fb.id in b_files and fa.id not in b_files
    assert ba.id not in [x.id for x in b.batches.list().data]
    assert b.files.list(after=fa.id).data == [] and b.batches.list(after=ba.id).data == []
    for call in (
        lambda: b.files.retrieve(fa.id),
        lambda: b.files.content(fa.id),
        lambda: b.files.delete(fa.id),
        lambda: b.batches.retrieve(ba.id),
        lambda: b.batches.cancel(ba.id),
        lambda: b.batches.create(input_file_id=fa.id, endpoint=CHAT, completion_window="24h"),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    for path, real, missing, method in (
        ("/v1/files/{}", fa.id, MISSING_FILE, "GET"),
        ("/v1/files/{}/content", fa.id, MISSING_FILE, "GET"),
        ("/v1/files/{}", fa.id, MISSING_FILE, "DELETE"),
        ("/v1/batches/{}", ba.id, MISSING_BATCH, "GET"),
        ("/v1/batches/{}/cancel", ba.id, MISSING_BATCH, "POST"),
    ):
        assert_404_as_missing(api, KEY_B, path, real, missing, method)
    # A still has all of it, untouched by B's attempts.
    assert a.files.retrieve(fa.id).bytes == len(content)
    assert a.files.content(fa.id).content == content
    assert fa.id in [f.id for f in a.files.list().data]
    assert a.batches.list(limit=1).data[0].id == ba.id
    assert a.batches.retrieve(ba.id).status == "validating"
    assert a.batches.cancel(ba.id).status == "cancelling"
    # Without a key, or with one not configured: 401.
    r = httpx.get(f"{api.base}/v1/files", timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        api.client(f"{KEY_A},{KEY_B}").files.list()


def walk(page: Callable[..., object]) -> list[str]:
    """Every id of a list, one per page, following ``after``."""
    ids, after = [], None
    while True:
        got = page(limit=1, **({"after": after} if after else {}))
        ids += [x.id for x in got.data]
        if not got.has_more:
            return ids
        after = got.data[-1].id


def test_lists_page_through_one_tenants_objects_only(api):
    a, b = api.client(KEY_A), api.client(KEY_B)
    made: dict[str, tuple[list[str], list[str]]] = {KEY_A: ([], []), KEY_B: ([], [])}
    for key, c in ((KEY_A, a), (KEY_B, b), (KEY_A, a), (KEY_B, b), (KEY_A, a)):  # interleaved
        f = c.files.create(file=("u.jsonl", jsonl_line("u")), purpose="batch")
        made[key][0].append(f.id)
        batch = c.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")
        made[key][1].append(batch.id)
    for key, c, other in ((KEY_A, a, KEY_B), (KEY_B, b, KEY_A)):
        files = walk(lambda **kw: c.files.list(purpose="batch", **kw))  # noqa: B023
        batches = walk(c.batches.list)
        assert len(files) == len(set(files)) and len(batches) == len(set(batches))
        mine = [i for i in files if i in made[key][0]]
        assert mine == made[key][0][::-1]  # all of them, newest first
        assert [i for i in batches if i in made[key][1]] == made[key][1][::-1]
        assert not set(files) & set(made[other][0]) and not set(batches) & set(made[other][1])


def test_redis_holds_owner_ids_never_the_keys(api):
    a = api.client(KEY_A)
    f = a.files.create(file=("a.jsonl", jsonl_line("r")), purpose="batch")
    client = redis.Redis.from_url(api.redis_url)
    owner = hashlib.sha256(KEY_A.encode()).hexdigest()[:16]
    assert client.hget(Keys().file(f.id), "owner").decode() == owner
    assert "owner" not in a.files.retrieve(f.id).model_dump()
    for name in client.scan_iter():
        assert b"key-" not in name, name
        kind = client.type(name)
        values = {b"hash": client.hvals, b"string": lambda n: [client.get(n)]}.get(kind)
        assert not any(b"key-" in v for v in (values(name) if values else [])), name


def finish_in_process(redis_url: str, batch_id: str, body: dict) -> None:
    """Run the end of a batch as its task does (one line answered with ``body``), in this
    process: its output file is written by the worker's own code."""

    async def run() -> None:
        client = aioredis.Redis.from_url(redis_url)
        store = Store(client, Keys())
        try:
            await store.update_batch(batch_id, total=1)
            assert await store.transition(batch_id, "in_progress", ("validating",))
            response = {"status_code": 200, "request_id": "r", "body": body}
            row = {"id": "batch_req_t", "custom_id": "q", "response": response, "error": None}
            checkpoint = LineCheckpoint(client, Keys(), batch_id, 3600)
            assert await checkpoint.record(1, row, ok=True)
            assert await store.acquire_lease(batch_id, "test", 30)
            batch = await store.get_batch(batch_id)
            allowed = ("in_progress", "finalizing")
            assert await finalize(store, checkpoint, batch, "completed", allowed, "test")
        finally:
            await client.aclose()

    asyncio.run(run())


def assert_refused(api: Api, key: str, content: bytes) -> None:
    """Over the quota: 429 insufficient_quota, which the openai client does not retry."""
    sent = []
    http = httpx.Client(event_hooks={"request": [sent.append]})
    with pytest.raises(openai.RateLimitError) as exc:
        api.client(key, max_retries=2, http_client=http).files.create(
            file=("x.jsonl", content), purpose="batch"
        )
    assert exc.value.status_code == 429 and exc.value.code == "insufficient_quota"
    assert exc.value.body["type"] == "insufficient_quota"
    assert exc.value.response.headers["x-should-retry"] == "false"
    assert len(sent) == 1  # no retry


def test_quota_refuses_uploads_past_it_and_a_delete_gives_room_back(api):
    c, b = api.client(KEY_C), api.client(KEY_B)
    f1 = c.files.create(file=("f1.jsonl", sized(600)), purpose="batch")
    assert api.held(KEY_C) == 600
    assert_refused(api, KEY_C, sized(401))
    assert api.held(KEY_C) == 600  # a refused upload holds nothing
    before = api.held(KEY_B)  # another key's bytes are its own
    b.files.create(file=("b.jsonl", sized(200)), purpose="batch")
    assert api.held(KEY_B) == before + 200 and api.held(KEY_C) == 600
    f2 = c.files.create(file=("f2.jsonl", sized(400)), purpose="batch")  # exactly the quota
    assert api.held(KEY_C) == QUOTA
    assert_refused(api, KEY_C, b"\n")
    c.files.delete(f2.id)
    assert api.held(KEY_C) == 600
    f3 = c.files.create(file=("f3.jsonl", sized(400)), purpose="batch")
    # A batch's output file is its owner's: never refused, but counted.
    batch = c.batches.create(input_file_id=f1.id, endpoint=CHAT, completion_window="24h")
    finish_in_process(api.redis_url, batch.id, {"object": "chat.completion", "pad": "y" * 100})
    out = c.batches.retrieve(batch.id).output_file_id
    size = len(c.files.content(out).content)
    assert size > 100 and c.files.retrieve(out).bytes == size
    assert out in [f.id for f in c.files.list(purpose="batch_output").data]
    with pytest.raises(openai.NotFoundError):
        b.files.retrieve(out)
    assert api.held(KEY_C) == QUOTA + size
    assert_refused(api, KEY_C, b"\n")
    for file_id in (f1.id, f3.id, out):
        assert c.files.delete(file_id).deleted
    owner = hashlib.sha256(KEY_C.encode()).hexdigest()[:16]
    assert redis.Redis.from_url(api.redis_url).exists(Keys().tenant_bytes(owner)) == 0
