"""A request's life in the API against real processes: deadlines, server shutdown, closed
streams freeing their KV blocks, bursts against a bounded queue, and schemathesis."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from collections import Counter

import httpx
import openai
import pytest

from llmq.common.transport import GROUP, Keys
from tests.api.api_stack import (
    API_KEY,
    IGNORE_EOS,
    MESSAGES,
    PROMPT,
    aclient,
    assert_error,
    client,
    stopped,
)
from tests.harness import (
    wait_for,
)


def test_deadline_ends_a_request_with_an_error(main):
    base = main.api("deadline", request_timeout=2)
    main.warm(base)
    main.wait_idle()
    time.sleep(1.2)  # one more heartbeat: its token count includes the warm-up's
    r = main.redis()
    body = {"messages": MESSAGES, "max_tokens": 1900, "temperature": 0, "ignore_eos": True}

    # Queued past its deadline (no engine takes it): 504, and the engine drops it unrun.
    with stopped(main.worker):
        started = time.monotonic()
        resp = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=30)
        took = time.monotonic() - started
        err = assert_error(resp, 504, type="timeout", code="deadline_exceeded")
        assert "2s" in err["message"]
        assert 1.8 < took < 4, took

        with pytest.raises(openai.InternalServerError) as exc:
            client(base).completions.create(
                model=main.model, prompt=PROMPT, max_tokens=1900, extra_body=IGNORE_EOS
            )
        assert exc.value.status_code == 504 and exc.value.code == "deadline_exceeded"
        before = int(main.heartbeat()["tokens_total"])
    wait_for(
        lambda: main.waiting(r) == 0 and r.xpending(main.stream, GROUP)["pending"] == 0,
        5,
        "expired dropped",
    )
    main.wait_idle(timeout=3)
    assert int(main.heartbeat()["tokens_total"]) == before, "an expired request was run"

    # Streaming, the deadline passing mid-generation: some text, then the error event; the
    # openai client raises it.
    started = time.monotonic()
    chunks = []
    with pytest.raises(openai.APIError) as exc:
        stream = client(base).chat.completions.create(
            model=main.model, messages=MESSAGES, max_tokens=1900, stream=True,
            extra_body=IGNORE_EOS,
        )  # fmt: skip
        for ch in stream:
            chunks.append(ch)
            if len(chunks) == 4:
                os.kill(main.worker.proc.pid, signal.SIGSTOP)
    os.kill(main.worker.proc.pid, signal.SIGCONT)
    assert len(chunks) >= 4
    assert 1.8 < time.monotonic() - started < 4
    assert "did not finish" in exc.value.message
    # The worker dropped it: nothing left running, its blocks free.
    main.wait_idle(timeout=3)


def test_requests_cut_by_server_shutdown_end_with_an_error(main):
    """SIGTERM to an API process while a stream and a non-streamed request run: after a short
    drain the stream gets an error event and [DONE] instead of a silent cut (which the openai
    client takes for a whole answer), the other a 503 server_shutting_down (not a closed
    connection); the process exits cleanly and both requests are cancelled on the worker."""
    base = main.api("going-away")
    main.warm(base)
    proc, _ = main.apis.pop("going-away")
    main.wait_idle()
    plain: list[tuple[httpx.Response, float]] = []

    def post() -> None:
        body = {"prompt": PROMPT, "max_tokens": 1900, **IGNORE_EOS}
        resp = httpx.post(f"{base}/v1/completions", json=body, timeout=30)
        plain.append((resp, time.monotonic()))

    poster = threading.Thread(target=post)
    poster.start()
    body = {"prompt": PROMPT, "max_tokens": 1900, "stream": True, **IGNORE_EOS}
    frames: list[str] = []
    try:
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=30) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                frames.append(line.removeprefix("data: "))
                if len(frames) == 4:
                    running = lambda: main.heartbeat().get("running") == "2"  # noqa: E731
                    wait_for(running, 10, "both requests running")
                    # The worker frozen: no token can finish an answer during the drain.
                    os.kill(main.worker.proc.pid, signal.SIGSTOP)
                    proc.proc.send_signal(signal.SIGTERM)
                    signalled = time.monotonic()
        ended = time.monotonic() - signalled
    finally:
        poster.join()
        os.kill(main.worker.proc.pid, signal.SIGCONT)
    assert frames[-1] == "[DONE]"
    error = json.loads(frames[-2])["error"]
    assert error["code"] == "server_shutting_down" and error["type"] == "service_unavailable"
    assert all("choices" in json.loads(f) for f in frames[:-2])
    assert 2.0 < ended < 4.5, ended
    ((resp, answered),) = plain
    assert resp.status_code == 503, resp.text
    error = resp.json()["error"]
    assert error["code"] == "server_shutting_down" and error["type"] == "service_unavailable"
    assert 2.0 < answered - signalled < 4.5, answered - signalled
    # A clean exit (uvicorn re-raises the signal once shut down).
    assert proc.proc.wait(10) in (0, -signal.SIGTERM), proc.log()
    assert "Application shutdown complete" in proc.log()
    main.wait_idle(timeout=5)  # both requests were cancelled on the worker


# ---- 3. a closed stream frees its KV blocks --------------------------------------------------
def test_closing_a_stream_frees_kv_blocks_within_a_second(main):
    main.wait_idle()
    before = int(main.heartbeat()["tokens_total"])
    stream = client(main.base).chat.completions.create(
        model=main.model, messages=MESSAGES, max_tokens=1900, stream=True, extra_body=IGNORE_EOS
    )
    it = iter(stream)
    for _ in range(4):
        next(it)
    wait_for(lambda: int(main.heartbeat()["kv_blocks_used"]) > 0, 3, "blocks in use", 0.02)
    stream.close()
    closed = time.monotonic()
    wait_for(lambda: main.heartbeat()["kv_blocks_used"] == "0", 1.0, "blocks freed", 0.01)
    freed_after = time.monotonic() - closed
    assert freed_after < 1.0
    hb = main.heartbeat()
    assert hb["running"] == "0"
    # The worker stopped generating for it: no new tokens, and fewer than asked (the tiny
    # model makes hundreds a second, so the count before the close is not small).
    total = int(hb["tokens_total"])
    time.sleep(0.5)
    assert int(main.heartbeat()["tokens_total"]) == total
    assert total - before < 1900


def test_disconnected_streams_leave_no_subscription_behind(main):
    """Clients that drop their streams (curl killed, a browser tab closed) leave the API no
    output channel to listen to: its subscriptions go back to none."""
    r = main.redis()
    out_channels = lambda: r.pubsub_channels(f"{Keys().prefix}:out:*")  # noqa: E731
    main.wait_idle()
    assert out_channels() == []
    body = {"messages": MESSAGES, "max_tokens": 1900, "stream": True, **IGNORE_EOS}
    for _ in range(5):
        with httpx.stream("POST", f"{main.base}/v1/chat/completions", json=body) as resp:
            lines = resp.iter_lines()
            while not next(lines).startswith("data: {"):
                pass
            next(lines)
        # the connection is closed here, mid-answer
    wait_for(lambda: out_channels() == [], 3, "no output channel subscribed", 0.05)
    main.wait_idle()


def test_a_client_that_gives_up_on_a_non_streamed_answer_frees_its_blocks(main):
    main.wait_idle()
    time.sleep(1.2)  # one more heartbeat: its token count is current
    before = int(main.heartbeat()["tokens_total"])
    log_before = main.apis["main"][0].log(tail=10**7)
    body = {"messages": MESSAGES, "max_tokens": 1900, "n": 2, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{main.base}/v1/chat/completions", json=body, timeout=1.0)
    try:  # the two choices would take minutes: freed well before is freed by the cancel
        wait_for(lambda: main.heartbeat()["kv_blocks_used"] == "0", 30, "blocks freed", 0.01)
    except TimeoutError:
        raise AssertionError(f"{main.heartbeat()}\n{main.worker.log(tail=3000)}") from None
    assert main.heartbeat()["running"] == "0"
    time.sleep(1.2)
    # Cancelled, not run to the end: fewer tokens than the two choices asked for.
    generated = int(main.heartbeat()["tokens_total"]) - before
    assert generated < 2 * 1900, main.apis["main"][0].log(tail=4000) + main.worker.log(tail=4000)
    # Both choices were cancelled, quietly: no traceback in the API's log.
    time.sleep(0.3)
    new_log = main.apis["main"][0].log(tail=10**7)[len(log_before) :]
    assert "Traceback" not in new_log and "never retrieved" not in new_log, new_log[-3000:]


# ---- 4. a burst against a bounded queue ------------------------------------------------------
BURST_TOKENS = 32


def test_burst_of_300_gets_answers_or_429(main):
    """The worker is frozen while the burst arrives, so the queue fills however fast it runs:
    every request is either queued or refused at once, and the queued ones run once it wakes."""
    main.wait_idle()
    rc = main.redis()

    async def one(ac, i):
        try:
            return await ac.chat.completions.create(
                model=main.model,
                messages=[{"role": "user", "content": f"request number {i}"}],
                max_tokens=BURST_TOKENS,
                temperature=0,
                extra_body=IGNORE_EOS,
            )
        except openai.RateLimitError as exc:
            return exc

    async def run():
        async with aclient(main.base, timeout=60) as ac:
            tasks = [asyncio.ensure_future(one(ac, i)) for i in range(300)]
            with stopped(main.worker):
                deadline = time.monotonic() + 60
                # Until each request is refused or in the stream (a worker blocked in
                # XREADGROUP when frozen may still be handed a few entries by Redis).
                while sum(t.done() for t in tasks) + rc.xlen(main.stream) < 300:
                    assert time.monotonic() < deadline, "the burst neither queued nor refused"
                    await asyncio.sleep(0.05)
            return await asyncio.wait_for(asyncio.gather(*tasks), timeout=120)

    started = time.monotonic()
    results = asyncio.run(run())
    took = time.monotonic() - started
    ok = [r for r in results if not isinstance(r, openai.RateLimitError)]
    limited = [r for r in results if isinstance(r, openai.RateLimitError)]
    assert len(ok) + len(limited) == 300
    # 50 waiting, plus the few a frozen worker's blocked read was handed (at most one pull).
    assert 50 <= len(ok) <= 50 + 8, (len(ok), len(limited))
    for r in ok:
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == BURST_TOKENS
    for exc in limited:
        assert exc.status_code == 429 and exc.response.headers["retry-after"] == "1"
        assert exc.code == "queue_full"
    assert rc.xpending(main.stream, GROUP)["pending"] == 0
    assert rc.xlen(main.stream) == 0
    print(f"burst: {len(ok)} answered, {len(limited)} refused in {took:.1f}s")


def test_without_max_tokens_the_rest_of_the_context(small, ref):
    """No max_tokens: generation may fill the context (64 tokens on this worker)."""
    ids = ref.chat_ids(MESSAGES)
    r = client(small.base).chat.completions.create(
        model=small.model, messages=MESSAGES, temperature=0, extra_body=IGNORE_EOS
    )
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 64 - len(ids)
    assert r.choices[0].message.content == ref.text(ref.greedy([ids], 64 - len(ids))[0])


# ---- 5. schemathesis -------------------------------------------------------------------------
# Every operation of the schema is called; derandomized, so each run sends the same cases.
EXAMPLES_POST = 20  # per POST operation, half of them invalid on purpose
EXAMPLES_GENERATE = 60  # the two generation routes: enough valid cases to generate text
EXAMPLES_OTHER = 5  # per GET / DELETE operation (most have little to vary)
GENERATE = ("POST /v1/chat/completions", "POST /v1/completions")


def test_schemathesis_finds_no_5xx_with_the_api_key(small):
    """Generated requests, valid and not, to an API that requires a key (LLMQ_API_KEY), each
    sent with the key as a client would: none gets a 5xx, and none a 401."""
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st
    from schemathesis import GenerationMode

    base = small.api("keyed", api_key=API_KEY)
    assert_error(httpx.post(f"{base}/v1/completions", json={"prompt": "x"}), 401)
    auth = {"Authorization": f"Bearer {API_KEY}"}
    schema = schemathesis.openapi.from_url(f"{base}/openapi.json", headers=auth)
    calls: Counter = Counter()
    statuses: Counter = Counter()
    failures: list[str] = []

    def run(op) -> None:
        post = op.method.upper() == "POST"
        strategy = op.as_strategy(GenerationMode.POSITIVE)
        if post:
            strategy = st.one_of(strategy, op.as_strategy(GenerationMode.NEGATIVE))

        examples = EXAMPLES_POST if post else EXAMPLES_OTHER

        @settings(
            max_examples=EXAMPLES_GENERATE if op.label in GENERATE else examples,
            deadline=None,
            database=None,
            derandomize=True,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(case=strategy)
        def check(case):
            resp = case.call(base_url=base, headers=auth, timeout=60)
            calls[op.label] += 1
            statuses[(op.label, resp.status_code)] += 1
            if resp.status_code >= 500 and len(failures) < 10:
                failures.append(
                    f"{op.label} -> {resp.status_code} {resp.text[:300]}\n"
                    f"    body: {str(case.body)[:500]}"
                )

        check()

    for result in schema.get_all_operations():
        run(result.ok())
    print(f"schemathesis: {sum(calls.values())} calls {dict(calls)}, statuses {dict(statuses)}")
    assert not failures, "\n".join(failures)
    assert sum(calls.values()) >= 200
    codes = Counter()
    for (_, code), n in statuses.items():
        codes[code] += n
    assert codes[200] >= 20 and codes[400] >= 20 and codes[401] == 0
    # Generation itself was exercised, not only refusals. How many generated bodies fit the
    # worker's 64-token context varies between processes (8-12 seen: other modules' imports
    # move what hypothesis draws); a valid request to each route answers 200 in any case.
    generated = [statuses[(label, 200)] for label in GENERATE]
    assert sum(generated) >= 4, dict(statuses)
    valid = {"model": small.model, "max_tokens": 2}
    chat = {**valid, "messages": [{"role": "user", "content": "hi"}]}
    for path, body in (("chat/completions", chat), ("completions", {**valid, "prompt": "hi"})):
        assert httpx.post(f"{base}/v1/{path}", json=body, headers=auth, timeout=60).is_success


# ---- SSE framing ---------------------------------------------------------------------------
def _sse_events(raw: str) -> list[str]:
    """The data of each event; every event is one `data:` line, events end with a blank line."""
    assert raw.endswith("\r\n\r\n") or raw.endswith("\n\n"), raw[-50:]
    events = [e for e in raw.replace("\r\n", "\n").split("\n\n") if e]
    data = []
    for e in events:
        lines = e.split("\n")
        assert len(lines) == 1 and lines[0].startswith("data: "), e
        data.append(lines[0][len("data: ") :])
    return data


def test_sse_framing(main, ref):
    expected = ref.text(ref.greedy([ref.chat_ids(MESSAGES)], 6)[0])
    body = dict(
        model=main.model,
        messages=MESSAGES,
        max_tokens=6,
        temperature=0,
        ignore_eos=True,
        stream=True,
    )
    with httpx.stream("POST", f"{main.base}/v1/chat/completions", json=body, timeout=30) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        raw = resp.read().decode()
    data = _sse_events(raw)
    assert data[-1] == "[DONE]"
    frames = [json.loads(d) for d in data[:-1]]
    assert all(f["object"] == "chat.completion.chunk" for f in frames)
    assert len({f["id"] for f in frames}) == 1
    first, last = frames[0], frames[-1]
    assert first["choices"][0]["delta"]["role"] == "assistant"
    assert last["choices"][0]["finish_reason"] == "length"
    assert all(f["choices"][0]["finish_reason"] is None for f in frames[:-1])
    assert "".join(f["choices"][0]["delta"].get("content") or "" for f in frames) == expected

    body = dict(model=main.model, prompt=PROMPT, max_tokens=5, temperature=0, stream=True)
    body["stream_options"] = {"include_usage": True}
    with httpx.stream("POST", f"{main.base}/v1/completions", json=body, timeout=30) as resp:
        assert resp.status_code == 200
        data = _sse_events(resp.read().decode())
    assert data[-1] == "[DONE]"
    frames = [json.loads(d) for d in data[:-1]]
    *chunks, usage = frames
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] <= 5
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")
    assert all(f["choices"][0]["finish_reason"] is None for f in chunks[:-1])
