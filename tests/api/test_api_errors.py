"""The API's errors: OpenAI-shaped 400s, 401, 404, 413 and 429, against real processes."""

from __future__ import annotations

import asyncio
import os
import signal

import httpx
import openai
import pytest

from llmq.common.sampling_params import SamplingParams
from tests.api.api_stack import API_KEY, MESSAGES, PROMPT, aclient, assert_error, client
from tests.harness import (
    wait_for,
)


# ---- 2. errors ------------------------------------------------------------------------------
def test_400_validation(main):
    url = f"{main.base}/v1/chat/completions"
    err = assert_error(
        httpx.post(url, json={"messages": MESSAGES, "temperature": 5}),
        400,
        type="invalid_request_error",
        param="temperature",
    )
    assert "temperature" in err["message"]
    assert_error(httpx.post(url, json={"model": main.model}), 400, param="messages")
    assert_error(httpx.post(url, json={"messages": []}), 400, param="messages")
    assert_error(
        httpx.post(url, content=b"{not json", headers={"content-type": "application/json"}),
        400,
        type="invalid_request_error",
    )
    assert_error(
        httpx.post(f"{main.base}/v1/completions", json={"max_tokens": 3}), 400, param="prompt"
    )
    with pytest.raises(openai.BadRequestError) as exc:
        client(main.base).chat.completions.create(
            model=main.model, messages=MESSAGES, temperature=5
        )
    assert exc.value.status_code == 400 and exc.value.param == "temperature"


def test_400_context_length(main, ref):
    ids = ref.chat_ids(MESSAGES)
    max_len = int(main.heartbeat()["max_model_len"])
    err = assert_error(
        httpx.post(
            f"{main.base}/v1/chat/completions",
            json={"messages": MESSAGES, "max_tokens": max_len - len(ids) + 1},
        ),
        400,
        type="invalid_request_error",
        param="max_tokens",
        code="context_length_exceeded",
    )
    assert str(max_len) in err["message"]
    body = {"messages": MESSAGES, "max_completion_tokens": max_len - len(ids) + 1}
    assert_error(
        httpx.post(f"{main.base}/v1/chat/completions", json=body),
        400,
        param="max_completion_tokens",
        code="context_length_exceeded",
    )
    # Exactly at the limit is fine (one token to generate).
    r = httpx.post(
        f"{main.base}/v1/completions",
        json={"prompt": [7] * (max_len - 1), "max_tokens": 1},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert_error(
        httpx.post(f"{main.base}/v1/completions", json={"prompt": [7] * max_len, "max_tokens": 1}),
        400,
        param="prompt",
        code="context_length_exceeded",
    )
    with pytest.raises(openai.BadRequestError) as exc:
        client(main.base).completions.create(model=main.model, prompt=PROMPT, max_tokens=max_len)
    assert exc.value.code == "context_length_exceeded"


def test_logit_bias_steers_greedy_tokens_as_the_engine_does(main, ref):
    ids = ref.ids(PROMPT)
    plain = ref.greedy([ids], 6)[0]
    forced = next(t for t in range(10, 100) if t not in plain)
    cases = [{forced: 100.0}, {plain[0]: -100.0, plain[1]: -100.0}]
    c = client(main.base)
    for bias in cases:
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=6, logit_bias=bias)
        want = ref.engine.generate([ids], params)[0]
        r = c.completions.create(
            model=main.model,
            prompt=PROMPT,
            max_tokens=6,
            temperature=0,
            extra_body={"ignore_eos": True},
            logit_bias={str(t): b for t, b in bias.items()},
        )
        assert r.choices[0].text == ref.text(want)
        if 100.0 in bias.values():
            assert want == [forced] * 6
        else:
            assert plain[0] not in want and plain[1] not in want


def test_400_bad_values(main):
    chat = f"{main.base}/v1/chat/completions"
    assert_error(httpx.post(chat, json={"messages": MESSAGES, "n": 9}), 400, param="n")
    assert_error(
        httpx.post(chat, json={"messages": MESSAGES, "top_logprobs": 2}), 400, param="top_logprobs"
    )
    assert_error(
        httpx.post(chat, json={"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}),
        400,
        param="top_logprobs",
    )
    comp = f"{main.base}/v1/completions"
    assert_error(httpx.post(comp, json={"prompt": "x", "logprobs": 21}), 400, param="logprobs")
    vocab = int(main.heartbeat()["vocab_size"])
    for bad in ({"x": 1}, {"-1": 1}, {str(vocab): 1}, {str(i): 1 for i in range(301)}):
        body = {"messages": MESSAGES, "logit_bias": bad}
        assert_error(httpx.post(chat, json=body), 400, param="logit_bias")
    body = {"messages": MESSAGES, "logit_bias": {"5": 101}}
    assert_error(httpx.post(chat, json=body), 400, param="logit_bias.5")
    # What this server does not do is refused, not ignored.
    assert_error(httpx.post(comp, json={"prompt": "x", "best_of": 3}), 400, param="best_of")
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    for name, value in (("functions", [tool["function"]]),):
        body = {"messages": MESSAGES, name: value}
        msg = assert_error(httpx.post(chat, json=body), 400, param=name)["message"]
        assert "not supported" in msg and f"{name}: {name}" not in msg, msg  # named once
    # ... but what asks for plain text is served.
    for extra in (
        {"response_format": {"type": "text"}},
        {"tools": [tool], "tool_choice": "none"},
        {"tools": [tool]},  # auto: the model may answer in text
    ):
        r = httpx.post(chat, json={"messages": MESSAGES, "max_tokens": 2, **extra}, timeout=60)
        assert r.status_code == 200, r.text
    assert_error(httpx.post(comp, json={"prompt": "x", "suffix": "end"}), 400, param="suffix")
    for url, extra in ((chat, {"messages": MESSAGES}), (comp, {"prompt": "x"})):
        for name, value in (
            ("allowed_token_ids", [1, 2]),
            ("bad_words", ["x"]),
            ("prompt_logprobs", -1),
            ("truncate_prompt_tokens", 0),
        ):
            assert_error(httpx.post(url, json={**extra, name: value}), 400, param=name)
        # Structured output is served; a constraint that cannot be built is refused, naming it.
        schema_format = {"type": "json_schema", "json_schema": {"name": "x"}}
        for name, value, param in (
            ("response_format", schema_format, "response_format.json_schema.schema"),
            ("response_format", {"type": "xml"}, "response_format.type"),
            ("guided_json", {"type": "object", "not": {}}, "guided_json"),
            ("guided_choice", [], "guided_choice"),
            ("structured_outputs", {"regex": "a("}, "structured_outputs.regex"),
        ):
            assert_error(httpx.post(url, json={**extra, name: value}), 400, param=param)
    for name, value in (
        ("tool_choice", "required"),
        ("tool_choice", {"type": "function", "function": {"name": "f"}}),
        ("modalities", ["text", "audio"]),
        ("audio", {"voice": "x", "format": "mp3"}),
        ("best_of", 2),
        ("echo", True),
    ):
        assert_error(httpx.post(chat, json={"messages": MESSAGES, name: value}), 400, param=name)
    for role in ("user", "system"):
        body = {"messages": [{"role": role, "content": None}]}
        assert_error(httpx.post(chat, json=body), 400, param="messages.0.content")
    body = {"messages": [{"role": "user"}]}
    assert_error(httpx.post(chat, json=body), 400, param="messages.0.content")
    # JSON may carry a lone surrogate; it is no text to tokenize.
    headers = {"content-type": "application/json"}
    body = b'{"prompt": "hi \\ud800 x", "max_tokens": 2}'
    assert_error(httpx.post(comp, content=body, headers=headers), 400, param="prompt")
    body = b'{"messages": [{"role": "user", "content": "hi \\ud800"}], "max_tokens": 2}'
    assert_error(httpx.post(chat, content=body, headers=headers), 400, param="messages")
    assert_error(httpx.post(comp, json={"prompt": [1, vocab]}), 400, param="prompt")
    # A field of several shapes names them, not pydantic's union members.
    shapes = "an array of token ids or an array of arrays of token ids"
    for prompt in (5, [1.5], {"a": 1}, ["a", 3]):
        err = assert_error(httpx.post(comp, json={"prompt": prompt}), 400, param="prompt")
        assert err["message"].startswith("prompt must be a string,") and shapes in err["message"]
    err = assert_error(httpx.post(comp, json={"prompt": []}), 400, param="prompt")
    assert err["message"] == "prompt must not be empty"
    bad = {"messages": [{"role": "user", "content": 5}]}
    err = assert_error(httpx.post(chat, json=bad), 400, param="messages.0.content")
    assert err["message"] == "messages.0.content must be a string or an array of content parts"
    err = assert_error(httpx.post(chat, json={**bad, "messages": MESSAGES, "stop": 5}), 400)
    assert (
        err["param"] == "stop" and err["message"] == "stop must be a string or an array of strings"
    )
    # A stop token past the vocabulary is refused here; it would fail in the worker's sampler.
    for url, extra in ((chat, {"messages": MESSAGES}), (comp, {"prompt": "x"})):
        assert_error(
            httpx.post(url, json={**extra, "stop_token_ids": [vocab], "min_tokens": 2}),
            400,
            param="stop_token_ids",
        )
    # A top_k past the vocabulary (even past int64) keeps every token.
    r = httpx.post(comp, json={"prompt": "x", "top_k": 2**70, "max_tokens": 2}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1
    c = client(main.base)
    with pytest.raises(openai.BadRequestError) as exc:
        c.chat.completions.create(model=main.model, messages=MESSAGES, n=9)
    assert exc.value.param == "n"
    with pytest.raises(openai.BadRequestError) as exc:
        c.chat.completions.create(model=main.model, messages=MESSAGES, top_logprobs=2)
    assert exc.value.param == "top_logprobs"


def test_401_without_the_api_key(main):
    base = main.api("secured", api_key=API_KEY, max_body_bytes=20000)
    chat = f"{base}/v1/chat/completions"
    body = {"messages": MESSAGES, "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        resp = httpx.post(chat, json=body, headers=headers)
        assert_error(resp, 401, type="authentication_error", code="invalid_api_key")
        assert resp.headers["www-authenticate"] == "Bearer"
    assert_error(httpx.get(f"{base}/v1/models"), 401)
    with pytest.raises(openai.AuthenticationError) as exc:
        client(base, key="wrong").chat.completions.create(model=main.model, messages=MESSAGES)
    assert exc.value.status_code == 401
    # The right key works, and /health stays public.
    r = client(base, key=API_KEY).chat.completions.create(
        model=main.model, messages=MESSAGES, max_tokens=2
    )
    assert r.usage.completion_tokens <= 2
    assert (
        httpx.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}).json()[
            "data"
        ][0]["id"]
        == main.model
    )
    assert httpx.get(f"{base}/health").status_code == 200
    assert httpx.head(f"{base}/health").status_code == 200  # load balancers' probes


def test_404_unknown_model(main):
    for path, body in (
        ("/v1/chat/completions", {"messages": MESSAGES, "model": "no-such-model"}),
        ("/v1/completions", {"prompt": "x", "model": "no-such-model"}),
    ):
        assert_error(
            httpx.post(f"{main.base}{path}", json=body),
            404,
            param="model",
            code="model_not_found",
        )
    assert_error(httpx.get(f"{main.base}/v1/models/no-such-model"), 404, code="model_not_found")
    assert_error(httpx.get(f"{main.base}/v1/no-such-route"), 404, type="not_found_error")
    with pytest.raises(openai.NotFoundError) as exc:
        client(main.base).chat.completions.create(model="no-such-model", messages=MESSAGES)
    assert exc.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client(main.base).models.retrieve("no-such-model")
    assert client(main.base).models.retrieve(main.model).id == main.model


def test_400_rerank_and_score_on_a_generation_model(main):
    """A generative model scores nothing: a 400 that says why (tests/api/test_rerank.py has
    the cross-encoder's)."""
    for path, body in (
        ("/v1/rerank", {"query": "q", "documents": ["a", "b"]}),
        ("/v1/score", {"text_1": "a", "text_2": "b"}),
    ):
        err = assert_error(
            httpx.post(f"{main.base}{path}", json={**body, "model": main.model}),
            400,
            param="model",
            code="wrong_model_kind",
        )
        assert "generation model" in err["message"] and "cross-encoder" in err["message"], err


def test_413_body_over_the_limit(main):
    base = main.api("secured", api_key=API_KEY, max_body_bytes=20000)
    auth = {"Authorization": f"Bearer {API_KEY}", "content-type": "application/json"}
    url = f"{base}/v1/chat/completions"
    # Not JSON at all: a parser would answer 400, so 413 means it was refused before parsing.
    assert_error(httpx.post(url, content=b"{" * 30000, headers=auth), 413, code="request_too_large")
    big = [{"role": "user", "content": "x" * 25000}]
    assert_error(
        httpx.post(url, json={"messages": big, "max_tokens": 1}, headers=auth),
        413,
        code="request_too_large",
    )
    with pytest.raises(openai.APIStatusError) as exc:
        client(base, key=API_KEY).chat.completions.create(model=main.model, messages=big)
    assert exc.value.status_code == 413 and exc.value.code == "request_too_large"
    # Under the limit it is served.
    small_body = {"messages": [{"role": "user", "content": "x" * 1000}], "max_tokens": 1}
    assert httpx.post(url, json=small_body, headers=auth, timeout=30).status_code == 200


def test_413_chunked_body_over_the_limit(main):
    base = main.api("secured", api_key=API_KEY, max_body_bytes=20000)
    auth = {"Authorization": f"Bearer {API_KEY}", "content-type": "application/json"}

    def chunks():  # no Content-Length: the limit must count the bytes as they arrive
        for _ in range(6):
            yield b" " * 5000

    assert_error(
        httpx.post(f"{base}/v1/chat/completions", content=chunks(), headers=auth),
        413,
        code="request_too_large",
    )


def test_429_when_the_queue_is_full(main):
    """A stopped (SIGSTOP) but still registered worker takes nothing new: requests fill a
    queue of two, the next gets 429 with Retry-After; once the worker runs again the queued
    requests are answered. (A read the worker had blocked in Redis when it stopped may still
    take the first one: that one is in service, not waiting, and does not count.)"""
    base = main.api("limited", max_queue=2)
    main.warm(base)
    r = main.redis()
    main.wait_idle()
    body = {"messages": MESSAGES, "max_tokens": 3, "temperature": 0, "ignore_eos": True}

    async def run():
        async with httpx.AsyncClient(base_url=base, timeout=60) as http:
            os.kill(main.worker.proc.pid, signal.SIGSTOP)
            try:
                queued = []
                for n in range(1, 4):
                    queued.append(
                        asyncio.ensure_future(http.post("/v1/chat/completions", json=body))
                    )
                    await asyncio.to_thread(
                        wait_for, lambda n=n: r.xlen(main.stream) == n, 10, "queued", 0.02
                    )
                    if main.waiting(r) == 2:
                        break
                assert main.waiting(r) == 2
                resp = await http.post("/v1/chat/completions", json=body)
                async with aclient(base, timeout=10) as ac:
                    try:
                        await ac.chat.completions.create(
                            model=main.model, messages=MESSAGES, max_tokens=3
                        )
                        refused = None
                    except openai.RateLimitError as exc:
                        refused = exc
            finally:
                os.kill(main.worker.proc.pid, signal.SIGCONT)
            return resp, refused, await asyncio.gather(*queued)

    resp, refused, answered = asyncio.run(run())
    assert_error(resp, 429, type="rate_limit_error", code="queue_full")
    assert resp.headers["retry-after"] == "1"
    assert refused is not None, "the openai client got no RateLimitError"
    assert refused.status_code == 429 and refused.response.headers["retry-after"] == "1"
    for a in answered:
        assert a.status_code == 200, a.text
        assert a.json()["usage"]["completion_tokens"] == 3
    wait_for(lambda: r.xlen(main.stream) == 0, 5, "an empty queue")
