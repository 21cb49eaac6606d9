"""Batches seen from outside: Flower, the Files API's listing and ids, `llmq batch submit`, and a
worker killed mid-batch (last: it replaces the shared worker)."""

from __future__ import annotations

import json
import re
import subprocess
import time

import httpx
import psutil

from llmq.common.transport import Keys
from llmq.common.transport.redis_server import free_port
from tests.harness import (
    LLMQ,
    Proc,
    base_env,
    start_worker,
    wait_for,
)
from tests.worker.batches.batch_stack import (
    FINAL,
    GREEDY,
    LEASE,
    PROMPTS,
    WORKERS,
    assert_output_lines,
    chat_body,
    chat_lines,
    create_batch,
    jsonl,
    line,
    wait_batch,
)


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
    main.worker = start_worker(main.redis_url, main.model, "wb-2", main.logs, wait=False, **LEASE)
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
