"""Background responses (/v1/responses with background: true) and webhooks against real
processes: one Redis, one `llmq worker` and two `llmq api` replicas, driven by the openai SDK,
and a webhook receiver on loopback. A streamed response resumes from the other replica after
its first replica is killed (and after the worker is killed too), every event once; polling
reaches its end; a cancel stops the generation. Texts are held to the same request answered
in the foreground, greedily. Every webhook delivery is verified with the SDK's unwrap."""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import time

import anthropic
import httpx
import openai
import pytest

from llmq.common.transport import Keys
from llmq.tools.inspect_snapshot import render, snapshot
from tests.api.api_stack import client, stack, stopped
from tests.api.webhook_receiver import Receiver
from tests.harness import kill_all, start_worker, wait_for

QUESTION = "Write a long story about a lighthouse keeper and the sea."
# A short lease: a run whose worker died is queued again within seconds. Torch's ops: what
# is tested here is the path around the engine, and its workers then start without a compile.
WORKER = {"batch_lease_ttl": 3, "cpu_kernels": "false"}
SECRET = "whsec_" + base64.b64encode(b"llmq webhook test secret").decode()
# Quick retries, and a short timeout for the endpoint that never answers.
HOOKS = {"webhook_retry_initial": 0.2, "webhook_max_attempts": 3, "webhook_timeout": 1}


@pytest.fixture(scope="module")
def receiver():
    r = Receiver()
    yield r
    r.close()


@pytest.fixture(scope="module")
def black_hole():
    """A port that takes connections (the kernel's backlog) and never answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}/hook"
    sock.close()


@pytest.fixture(scope="module")
def bg(llama_dir, tmp_path_factory, receiver, black_hole):
    logs = tmp_path_factory.mktemp("background-logs")
    replacements = []
    hooks = [
        {"url": receiver.url, "secret": SECRET},
        {
            "url": black_hole,
            "secret": SECRET,
            "events": ["response.completed", "response.incomplete"],
        },
    ]
    worker = {**WORKER, **HOOKS, "webhooks": json.dumps(hooks)}
    with stack(llama_dir, logs, "w-bg", worker, {}) as s:
        s.worker_settings = worker
        s.replacements = replacements
        try:
            yield s
        finally:
            kill_all(replacements)


def replace_worker(bg) -> None:
    """A new worker in place of the killed one (started, not waited for)."""
    name = f"w-bg-{len(bg.replacements) + 2}"
    bg.worker = start_worker(
        bg.redis_url, bg.model, name, bg.logs, wait=False, **bg.worker_settings
    )
    bg.replacements.append(bg.worker)
    bg.worker_name = name


def body(model: str, max_tokens: int) -> dict:
    return {"model": model, "input": QUESTION, "max_output_tokens": max_tokens, "temperature": 0}


def joined(events) -> str:
    return "".join(e.delta for e in events if e.type == "response.output_text.delta")


def read_until_deltas(stream, n: int) -> list:
    """The stream's events up to its n-th text delta; the connection is then closed."""
    events = []
    for event in stream:
        events.append(event)
        if sum(e.type == "response.output_text.delta" for e in events) >= n:
            break
    stream.close()
    return events


def assert_one_stream(events, text: str) -> None:
    """Every sequence number once, in order, to one final event; the text as ``text``."""
    assert [e.sequence_number for e in events] == list(range(len(events))), [
        (e.sequence_number, e.type) for e in events
    ]
    assert [e.type for e in events].count("response.completed") + [e.type for e in events].count(
        "response.incomplete"
    ) == 1
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert joined(events) == text
    assert events[-1].response.output_text == text


def test_streamed_background_response_resumes_on_another_replica(bg):
    first, second = client(bg.api("first")), client(bg.api("second"))
    request = body(bg.model, 64)
    foreground = client(bg.base).responses.create(**request)
    events = read_until_deltas(first.responses.create(**request, background=True, stream=True), 2)
    response_id = events[0].response.id
    assert events[0].type == "response.created" and events[0].response.background is True
    bg.apis.pop("first")[0].kill()  # the replica that took it is gone
    rest = second.responses.retrieve(
        response_id, stream=True, starting_after=events[-1].sequence_number
    )
    events += list(rest)
    assert_one_stream(events, foreground.output_text)
    # Replayed whole from the start, the same events.
    again = list(second.responses.retrieve(response_id, stream=True))
    assert [e.model_dump() for e in again] == [e.model_dump() for e in events]
    polled = second.responses.retrieve(response_id)
    assert polled.status == events[-1].response.status and polled.background is True
    assert polled.output_text == foreground.output_text


def test_a_worker_killed_mid_work_is_hidden_from_a_resumed_stream_and_a_message_batch(bg):
    """One kill for both (each worker start is seconds): a streamed background response
    resumed in the gap, and a message batch in progress, each request answered once."""
    api = client(bg.api("second"))
    sdk = anthropic.Anthropic(base_url=bg.api("second"), api_key="none", max_retries=0)
    request = body(bg.model, 400)
    foreground = client(bg.base).responses.create(**request)
    assert len(foreground.output_text) > 40, "a long answer, cut in the middle"
    lines = [
        {
            "custom_id": f"k{i}",
            "params": {**message_params(bg.model, f"p {i % 3}"), "max_tokens": 24},
        }
        for i in range(80)
    ]
    batch = sdk.messages.batches.create(requests=lines)
    wait_for(
        lambda: sdk.messages.batches.retrieve(batch.id).request_counts.succeeded >= 3,
        90,
        "a few answers",
        0.05,
    )
    stream = api.responses.create(**request, background=True, stream=True)
    events = read_until_deltas(stream, 1)
    response_id = events[0].response.id
    os.kill(bg.worker.proc.pid, signal.SIGSTOP)  # frozen mid-generation, then killed
    assert api.responses.retrieve(response_id).status == "in_progress"
    assert bg.redis().exists(Keys().response(response_id) + ":lease")
    at_kill = sdk.messages.batches.retrieve(batch.id)
    assert at_kill.processing_status == "in_progress", at_kill
    bg.worker.kill()  # SIGKILL: no lease released, no line finished
    killed = time.monotonic()
    replace_worker(bg)
    rest = api.responses.retrieve(
        response_id, stream=True, starting_after=events[-1].sequence_number, timeout=180
    )
    events += list(rest)
    print(f"\nresumed stream ended {time.monotonic() - killed:.1f} s after the worker's kill")
    assert_one_stream(events, foreground.output_text)
    wait_for(
        lambda: sdk.messages.batches.retrieve(batch.id).processing_status == "ended",
        120,
        "the batch's end",
        0.1,
    )
    results = list(sdk.messages.batches.results(batch.id))
    assert sorted(r.custom_id for r in results) == sorted(r["custom_id"] for r in lines)
    assert all(r.result.type == "succeeded" for r in results), results
    texts: dict[int, set[str]] = {}
    for r in results:
        texts.setdefault(int(r.custom_id[1:]) % 3, set()).add(r.result.message.content[0].text)
    assert all(len(v) == 1 for v in texts.values()), texts  # a resumed line, the same text


def test_polled_to_its_end_and_cancelled_mid_generation(bg):
    api = client(bg.api("second"))
    done = api.responses.create(**body(bg.model, 32), background=True)
    assert done.status == "queued" and done.background is True and done.output == []
    foreground = api.responses.create(**body(bg.model, 32))
    final = ("completed", "incomplete")  # incomplete: cut at max_output_tokens, as foreground
    wait_for(lambda: api.responses.retrieve(done.id).status in final, 60, "the end", 0.05)
    polled = api.responses.retrieve(done.id)
    assert (polled.status, polled.output_text) == (foreground.status, foreground.output_text)
    assert polled.usage.output_tokens == foreground.usage.output_tokens
    with pytest.raises(openai.BadRequestError):
        api.responses.cancel(done.id)  # finished: nothing to cancel

    running = api.responses.create(**body(bg.model, 400), background=True)
    wait_for(
        lambda: api.responses.retrieve(running.id).status == "in_progress", 60, "started", 0.02
    )
    with stopped(bg.worker):
        cancelled = api.responses.cancel(running.id)
        assert cancelled.status == "cancelled"
        started = time.monotonic()
    bg.wait_idle(10)  # the worker's slot freed
    print(f"\nidle {time.monotonic() - started:.2f} s after the worker went on")
    assert api.responses.retrieve(running.id).status == "cancelled"
    assert api.responses.cancel(running.id).status == "cancelled"  # as it is
    events = list(api.responses.retrieve(running.id, stream=True, timeout=30))
    assert all(e.type != "response.completed" for e in events)

    deleted = api.responses.create(**body(bg.model, 400), background=True)
    wait_for(
        lambda: api.responses.retrieve(deleted.id).status == "in_progress", 60, "started", 0.02
    )
    with stopped(bg.worker):
        api.responses.delete(deleted.id)
    bg.wait_idle(10)  # deleting a running response stopped it
    with pytest.raises(openai.NotFoundError):
        api.responses.retrieve(deleted.id)


def test_background_needs_store_and_streams_only_background(bg):
    base = bg.api("second")
    r = httpx.post(
        f"{base}/v1/responses",
        json={**body(bg.model, 16), "background": True, "store": False},
        timeout=30,
    )
    assert r.status_code == 400, r.text
    api = client(base)
    plain = api.responses.create(**body(bg.model, 16))
    r = httpx.get(f"{base}/v1/responses/{plain.id}", params={"stream": "true"}, timeout=30)
    assert r.status_code == 400, r.text
    queued = api.responses.create(**body(bg.model, 16), background=True)
    after = {"stream": "true", "starting_after": "-2"}
    r = httpx.get(f"{base}/v1/responses/{queued.id}", params=after, timeout=30)
    assert r.status_code == 400, r.text


def unwrapped(receiver: Receiver, object_id: str) -> list:
    """The deliveries of events about ``object_id``, each verified and parsed by the SDK."""
    sdk = openai.OpenAI(api_key="none", webhook_secret=SECRET)
    found = []
    for body, headers in list(receiver.deliveries):
        event = sdk.webhooks.unwrap(body, headers)  # raises on a bad signature
        if event.data.id == object_id:
            found.append((headers["webhook-id"], event))
    return found


def test_webhooks_signed_retried_with_one_id_and_a_dead_receiver_holds_nothing(
    bg, receiver, black_hole
):
    api = client(bg.api("second"))
    receiver.fail_first = 2  # 503 twice, then 200
    started = time.monotonic()
    first = api.responses.create(**body(bg.model, 16), background=True)
    wait_for(lambda: len(unwrapped(receiver, first.id)) >= 3, 60, "a third delivery", 0.05)
    receiver.fail_first = 0
    deliveries = unwrapped(receiver, first.id)
    final = api.responses.retrieve(first.id).status
    assert [e.type for _, e in deliveries] == [f"response.{final}"] * 3
    assert len({webhook_id for webhook_id, _ in deliveries}) == 1, deliveries
    webhook_id = deliveries[0][0]

    def inspected() -> str:  # what `llmq inspect` shows
        return render(snapshot(bg.redis(), Keys()))

    wait_for(
        lambda: (
            f"{webhook_id} response.{final} to {receiver.url}, attempt 3: delivered" in inspected()
        ),
        30,
        "the outcome in llmq inspect",
        0.05,
    )
    # The endpoint that never answers (LLMQ_WEBHOOK_TIMEOUT 1 s an attempt) holds up no
    # generation: responses after it end as soon as they would.
    later = [api.responses.create(**body(bg.model, 16), background=True) for _ in range(3)]
    for r in later:
        wait_for(lambda r=r: unwrapped(receiver, r.id), 60, "its event", 0.05)
    print(f"\n4 background responses and their events in {time.monotonic() - started:.1f} s")
    outcomes = [json.loads(x) for x in bg.redis().lrange("llmq:webhooks:deliveries", 0, -1)]
    mine = [o for o in outcomes if o["url"] == receiver.url and o["webhook_id"] == deliveries[0][0]]
    assert sorted(o["outcome"] for o in mine) == ["HTTP 503", "HTTP 503", "delivered"]
    wait_for(
        lambda: any(
            o["url"] == black_hole and "Timeout" in o["outcome"]
            for o in (json.loads(x) for x in bg.redis().lrange("llmq:webhooks:deliveries", 0, -1))
        ),
        30,
        "a timed-out attempt on the dead endpoint",
        0.1,
    )


def test_a_finished_batch_is_announced(bg, receiver):
    api = client(bg.api("second"))
    line = {
        "custom_id": "a",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": bg.model,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
        },
    }
    f = api.files.create(file=("in.jsonl", (json.dumps(line) + "\n").encode()), purpose="batch")
    batch = api.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    wait_for(lambda: unwrapped(receiver, batch.id), 60, "the batch's event", 0.1)
    [(_, event)] = unwrapped(receiver, batch.id)
    assert event.type == "batch.completed"
    assert api.batches.retrieve(batch.id).status == "completed"


def message_params(model: str, text: str) -> dict:
    return {
        "model": model,
        "max_tokens": 12,
        "temperature": 0,
        "messages": [{"role": "user", "content": text}],
    }


def test_message_batches_through_the_anthropic_sdk(bg):
    base = bg.api("second")
    sdk = anthropic.Anthropic(base_url=base, api_key="none", max_retries=0, timeout=60)
    good = [(f"q{i}", message_params(bg.model, f"question {i}")) for i in range(3)]
    bad = ("bad", {**message_params(bg.model, "x"), "messages": []})
    batch = sdk.messages.batches.create(
        requests=[{"custom_id": c, "params": p} for c, p in [*good, bad]]
    )
    assert batch.id.startswith("msgbatch_") and batch.type == "message_batch"
    assert batch.processing_status == "in_progress" and batch.results_url is None
    wait_for(
        lambda: sdk.messages.batches.retrieve(batch.id).processing_status == "ended",
        90,
        "the batch's end",
        0.1,
    )
    ended = sdk.messages.batches.retrieve(batch.id)
    counts = ended.request_counts
    assert (counts.succeeded, counts.errored, counts.processing) == (3, 1, 0), counts
    results = {r.custom_id: r.result for r in sdk.messages.batches.results(batch.id)}
    assert sorted(results) == ["bad", "q0", "q1", "q2"]
    assert results["bad"].type == "errored"
    assert results["bad"].error.error.type == "invalid_request_error"
    for custom_id, params in good:
        fields = {k: v for k, v in params.items() if k != "temperature"}
        answer = sdk.messages.create(**fields, extra_body={"temperature": 0})
        assert results[custom_id].type == "succeeded"
        assert results[custom_id].message.content == answer.content
    assert batch.id in [b.id for b in sdk.messages.batches.list()]
    with pytest.raises(anthropic.NotFoundError):
        sdk.messages.batches.retrieve("msgbatch_" + "0" * 32)
    assert sdk.messages.batches.delete(batch.id).type == "message_batch_deleted"
    with pytest.raises(anthropic.NotFoundError):
        sdk.messages.batches.retrieve(batch.id)


def test_a_cancelled_message_batch_ends_with_every_request_once(bg):
    sdk = anthropic.Anthropic(base_url=bg.api("second"), api_key="none", max_retries=0)
    requests = [
        {"custom_id": f"c{i}", "params": {**message_params(bg.model, f"c {i}"), "max_tokens": 64}}
        for i in range(40)
    ]
    with stopped(bg.worker):  # nothing runs before the cancel lands
        batch = sdk.messages.batches.create(requests=requests)
        cancelling = sdk.messages.batches.cancel(batch.id)
        assert cancelling.processing_status == "canceling"
        assert cancelling.cancel_initiated_at is not None
    wait_for(
        lambda: sdk.messages.batches.retrieve(batch.id).processing_status == "ended",
        90,
        "the batch's end",
        0.1,
    )
    results = list(sdk.messages.batches.results(batch.id))
    assert sorted(r.custom_id for r in results) == sorted(r["custom_id"] for r in requests)
    kinds = {r.result.type for r in results}
    assert kinds <= {"succeeded", "canceled"} and "canceled" in kinds, kinds
    counts = sdk.messages.batches.retrieve(batch.id).request_counts
    assert counts.canceled == sum(r.result.type == "canceled" for r in results)
