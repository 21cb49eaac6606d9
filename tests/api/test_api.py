"""The OpenAI-compatible API against real processes only: redis-server, `llmq worker`, `llmq api`
(uvicorn), driven by the real openai client (sync and async) and httpx. Texts are checked
against the in-process engine on the same model folder. Chat and completions."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict

import httpx
import pytest

from tests.api.api_stack import (
    IGNORE_EOS,
    MESSAGES,
    PROMPT,
    PROMPT2,
    aclient,
    alist,
    assert_error,
    chat_stream,
    client,
    completion_stream,
)


# ---- 1. chat and completions --------------------------------------------------------------
def test_chat_greedy_equals_engine_sync_async_streaming(main, ref):
    ids = ref.chat_ids(MESSAGES)
    tokens = ref.greedy([ids], 32)[0]
    expected = ref.text(tokens)
    assert len(set(tokens)) > 8, "the reference output is not varied"
    kw = dict(
        model=main.model, messages=MESSAGES, max_tokens=32, temperature=0, extra_body=IGNORE_EOS
    )
    c = client(main.base)

    r = c.chat.completions.create(**kw)
    assert r.object == "chat.completion" and r.model == main.model
    assert len(r.choices) == 1 and r.choices[0].index == 0
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == expected
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(tokens))
    assert r.usage.total_tokens == len(ids) + len(tokens)

    texts, finish, usage = chat_stream(
        c.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    assert texts == {0: expected} and finish == {0: "length"}
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(ids), len(tokens))

    async def run():
        async with aclient(main.base) as ac:
            r = await ac.chat.completions.create(**kw)
            chunks = await alist(await ac.chat.completions.create(**kw, stream=True))
            return r, chunks

    r, chunks = asyncio.run(run())
    assert r.choices[0].message.content == expected
    assert r.usage.completion_tokens == len(tokens)
    texts, finish, usage = chat_stream(chunks)
    assert texts == {0: expected} and finish == {0: "length"} and usage is None


def test_live_engines_come_from_the_registry_not_a_scan(main):
    """The API finds live engines in the registry its workers' heartbeats keep (a sorted set),
    never by a SCAN of the keyspace, whose cost grows with every key Redis holds."""
    r = main.redis()
    r.config_resetstat()
    for path in ("/v1/models", "/ready", "/metrics"):
        assert httpx.get(f"{main.base}{path}", timeout=30).status_code == 200
    body = {"prompt": "x", "max_tokens": 2}
    assert httpx.post(f"{main.base}/v1/completions", json=body, timeout=60).status_code == 200
    time.sleep(1.2)  # the API's engine cache (1 s) expired: one more look
    assert httpx.get(f"{main.base}/ready", timeout=30).json()["engines"] == 1
    stats = r.info("commandstats")
    assert "cmdstat_zrange" in stats and "cmdstat_scan" not in stats, sorted(stats)
    assert r.zscore("llmq:engines", main.worker_name) is not None


def test_completions_greedy_equals_engine(main, ref):
    ids, ids2 = ref.ids(PROMPT), ref.ids(PROMPT2)
    tokens, tokens2 = ref.greedy([ids, ids2], 24)
    expected, expected2 = ref.text(tokens), ref.text(tokens2)
    assert expected != expected2
    kw = dict(model=main.model, max_tokens=24, temperature=0, extra_body=IGNORE_EOS)
    c = client(main.base)

    r = c.completions.create(prompt=PROMPT, **kw)
    assert r.object == "text_completion"
    assert [ch.text for ch in r.choices] == [expected]
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 24)

    # The prompt as token ids.
    r = c.completions.create(prompt=ids, **kw)
    assert [ch.text for ch in r.choices] == [expected]
    assert r.usage.prompt_tokens == len(ids)

    # A list of two prompts: two choices, in order.
    r = c.completions.create(prompt=[PROMPT, PROMPT2], **kw)
    assert [(ch.index, ch.text) for ch in r.choices] == [(0, expected), (1, expected2)]
    assert r.usage.prompt_tokens == len(ids) + len(ids2)
    assert r.usage.completion_tokens == 48

    # Two choices of one prompt: the prompt counted once.
    r = c.completions.create(prompt=ids, n=2, **kw)
    assert [ch.text for ch in r.choices] == [expected, expected]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 48)

    # Two prompts as token ids, streamed.
    texts, finish, usage = completion_stream(
        c.completions.create(
            prompt=[ids, ids2], stream=True, stream_options={"include_usage": True}, **kw
        )
    )
    assert texts == {0: expected, 1: expected2}
    assert finish == {0: "length", 1: "length"}
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(ids) + len(ids2), 48)

    async def run():
        async with aclient(main.base) as ac:
            r = await ac.completions.create(prompt=PROMPT, **kw)
            chunks = await alist(await ac.completions.create(prompt=PROMPT, stream=True, **kw))
            return r, chunks

    r, chunks = asyncio.run(run())
    assert r.choices[0].text == expected
    texts, finish, _ = completion_stream(chunks)
    assert texts == {0: expected} and finish == {0: "length"}


def test_seeded_sampling_streamed_equals_non_streamed(main):
    c = client(main.base)
    chat = dict(model=main.model, messages=MESSAGES, max_tokens=24, temperature=1.0)
    comp = dict(model=main.model, prompt=PROMPT, max_tokens=24, temperature=1.0)

    async def astreams(seed):
        async with aclient(main.base) as ac:
            a = await alist(await ac.chat.completions.create(**chat, seed=seed, stream=True))
            b = await alist(await ac.completions.create(**comp, seed=seed, stream=True))
            return chat_stream(a)[0][0], completion_stream(b)[0][0]

    seen_chat, seen_comp = set(), set()
    for seed in (11, 12, 13):
        text = c.chat.completions.create(**chat, seed=seed).choices[0].message.content
        streamed = chat_stream(c.chat.completions.create(**chat, seed=seed, stream=True))[0][0]
        ctext = c.completions.create(**comp, seed=seed).choices[0].text
        cstreamed = completion_stream(c.completions.create(**comp, seed=seed, stream=True))[0][0]
        assert streamed == text and cstreamed == ctext
        assert asyncio.run(astreams(seed)) == (text, ctext)
        seen_chat.add(text)
        seen_comp.add(ctext)
    # Sampling at temperature 1 does depend on the seed.
    assert len(seen_chat) > 1 and len(seen_comp) > 1


def _stop_from(text: str) -> str:
    """A 3-character printable ASCII substring near the middle of ``text``."""
    for start in range(len(text) // 2, len(text) - 3):
        cand = text[start : start + 3]
        if cand.isascii() and cand.isprintable() and cand.strip() == cand and cand.strip():
            return cand
    raise AssertionError(f"no usable stop string in {text!r}")


def test_stop_strings_are_trimmed(main, ref):
    ids = ref.chat_ids(MESSAGES)
    full = ref.text(ref.greedy([ids], 48)[0])
    stop = _stop_from(full)
    expected = full[: full.index(stop)]
    assert 0 < len(expected) < len(full) - 3
    kw = dict(
        model=main.model, messages=MESSAGES, max_tokens=48, temperature=0, extra_body=IGNORE_EOS
    )
    c = client(main.base)

    r = c.chat.completions.create(**kw, stop=[stop, "never-seen-xyz"])
    assert r.choices[0].message.content == expected
    assert r.choices[0].finish_reason == "stop"
    assert 0 < r.usage.completion_tokens < 48
    texts, finish, _ = chat_stream(c.chat.completions.create(**kw, stop=stop, stream=True))
    assert texts == {0: expected} and finish == {0: "stop"}

    cids = ref.ids(PROMPT)
    cfull = ref.text(ref.greedy([cids], 48)[0])
    cstop = _stop_from(cfull)
    ckw = dict(model=main.model, prompt=PROMPT, max_tokens=48, temperature=0, extra_body=IGNORE_EOS)
    r = c.completions.create(**ckw, stop=cstop)
    assert r.choices[0].text == cfull[: cfull.index(cstop)]
    assert r.choices[0].finish_reason == "stop"
    texts, finish, _ = completion_stream(c.completions.create(**ckw, stop=[cstop], stream=True))
    assert texts == {0: cfull[: cfull.index(cstop)]} and finish == {0: "stop"}


def test_stop_string_options_min_tokens_and_include(main, ref):
    """Stop strings count from min_tokens on (as EOS and stop_token_ids do), and
    include_stop_str_in_output ends the text with the stop string."""
    ids = ref.ids(PROMPT)
    tokens = ref.greedy([ids], 24)[0]
    full = ref.text(tokens)
    c = client(main.base)
    kw = dict(model=main.model, prompt=PROMPT, max_tokens=24, temperature=0)

    early = full[0]  # hit by the first token without min_tokens
    r = c.completions.create(**kw, stop=early, extra_body=IGNORE_EOS)
    assert r.choices[0].text == "" and r.choices[0].finish_reason == "stop"
    r = c.completions.create(**kw, stop=early, extra_body={**IGNORE_EOS, "min_tokens": 6})
    text = r.choices[0].text
    head = ref.text(tokens[:5])  # what the first 5 tokens make is never searched
    assert r.usage.completion_tokens >= 6 and full.startswith(text) and len(text) >= len(head)
    if r.choices[0].finish_reason == "stop":
        assert full[len(text)] == early
    else:
        assert text == full and early not in full[len(head) :]

    stop = _stop_from(full)
    with_stop = full[: full.index(stop) + len(stop)]
    include = {**IGNORE_EOS, "include_stop_str_in_output": True}
    r = c.completions.create(**kw, stop=[stop, "never-seen-xyz"], extra_body=include)
    assert r.choices[0].text == with_stop and r.choices[0].finish_reason == "stop"
    texts, finish, _ = completion_stream(
        c.completions.create(**kw, stop=stop, stream=True, extra_body=include)
    )
    assert texts == {0: with_stop} and finish == {0: "stop"}


def test_truncate_prompt_tokens_and_continue_final_message(main, ref):
    c = client(main.base)
    ids = ref.ids(PROMPT2)
    assert len(ids) > 6
    body = dict(model=main.model, prompt=ids, max_tokens=5, temperature=0)
    r = c.completions.create(**body, extra_body={**IGNORE_EOS, "truncate_prompt_tokens": 4})
    assert r.usage.prompt_tokens == 4
    assert r.choices[0].text == ref.text(ref.greedy([ids[-4:]], 5)[0])
    max_len = int(main.heartbeat()["max_model_len"])
    long = (ids * (max_len // len(ids) + 1))[: max_len + 10]
    r = c.completions.create(
        **{**body, "prompt": long}, extra_body={**IGNORE_EOS, "truncate_prompt_tokens": -1}
    )
    assert r.usage.prompt_tokens == max_len - 5 and r.usage.completion_tokens == 5

    # An assistant turn continued, not a new one started.
    messages = [*MESSAGES, {"role": "assistant", "content": "Redis streams are"}]
    cont = ref.tok.apply_chat_template(
        messages, continue_final_message=True, tokenize=True, return_dict=False
    )
    extra = {**IGNORE_EOS, "add_generation_prompt": False, "continue_final_message": True}
    r = c.chat.completions.create(
        model=main.model, messages=messages, max_tokens=5, temperature=0, extra_body=extra
    )
    assert r.usage.prompt_tokens == len(cont)
    assert r.choices[0].message.content == ref.text(ref.greedy([list(cont)], 5)[0])
    chat = f"{main.base}/v1/chat/completions"
    assert_error(
        httpx.post(chat, json={"messages": messages, "continue_final_message": True}),
        400,
        param="continue_final_message",
    )


def test_n_choices_count_once_in_the_metrics_and_seeds_span_64_bits(main):
    def counters() -> dict[str, float]:
        text = httpx.get(f"{main.base}/metrics", timeout=10).text
        out: dict[str, float] = defaultdict(float)
        for line in text.splitlines():
            name = line.split("{")[0]
            if name in ("llmq:prompt_tokens_total", "llmq:request_success_total"):
                out[name] += float(line.rsplit(" ", 1)[1])
        return out

    c = client(main.base)
    before = counters()
    r = c.chat.completions.create(model=main.model, messages=MESSAGES, max_tokens=3, n=4)
    after = counters()
    assert after["llmq:request_success_total"] - before["llmq:request_success_total"] == 1
    prompt_added = after["llmq:prompt_tokens_total"] - before["llmq:prompt_tokens_total"]
    assert prompt_added == r.usage.prompt_tokens

    def sample(seed: int, n: int = 1) -> list[str]:
        body = dict(model=main.model, prompt=PROMPT, max_tokens=12, seed=seed, n=n)
        r = c.completions.create(**body, extra_body=IGNORE_EOS)
        return [ch.text for ch in r.choices]

    assert sample(-1) == sample(-1)
    assert sample(-1) != sample(2**63 - 1)
    assert sample(-(2**63)) not in sample(2**63 - 1, n=2)


def test_logprobs_have_the_asked_shape(main, ref):
    c = client(main.base)
    greedy = dict(model=main.model, max_tokens=8, temperature=0, extra_body=IGNORE_EOS)

    r = c.chat.completions.create(messages=MESSAGES, logprobs=True, top_logprobs=3, **greedy)
    content = r.choices[0].logprobs.content
    assert len(content) == 8 == r.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 3
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        # Greedy: the chosen token is the most likely one.
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-5)
    assert r.choices[0].message.content == ref.text(ref.greedy([ref.chat_ids(MESSAGES)], 8)[0])

    chunks = list(
        c.chat.completions.create(
            messages=MESSAGES, logprobs=True, top_logprobs=3, stream=True, **greedy
        )
    )
    streamed = [
        e for ch in chunks for ch_c in ch.choices if ch_c.logprobs for e in ch_c.logprobs.content
    ]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [
        (e.token, round(e.logprob, 4)) for e in content
    ]
    assert all(len(e.top_logprobs) == 3 for e in streamed)

    # Without logprobs there are none.
    assert c.chat.completions.create(messages=MESSAGES, **greedy).choices[0].logprobs is None

    r = c.completions.create(prompt=PROMPT, logprobs=2, **greedy)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    assert len(lp.text_offset) == 8 and lp.text_offset[0] == 0
    assert lp.text_offset == sorted(lp.text_offset)
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob <= 0
        assert 1 <= len(top) <= 2  # two ids that decode alike share one key
        assert max(top.values()) == pytest.approx(logprob, abs=1e-5) and token in top


def test_n_choices(main, ref):
    c = client(main.base)
    ids = ref.chat_ids(MESSAGES)
    kw = dict(model=main.model, messages=MESSAGES, max_tokens=12, temperature=1.0, seed=5, n=3)
    r = c.chat.completions.create(**kw, extra_body=IGNORE_EOS)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    texts = [ch.message.content for ch in r.choices]
    assert len(set(texts)) > 1, "n choices with one seed must differ"
    assert all(ch.finish_reason == "length" for ch in r.choices)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 36)

    # Streamed, the same seed gives the same three texts, each choice finishing once.
    got, finish, usage = chat_stream(
        c.chat.completions.create(
            **kw, stream=True, stream_options={"include_usage": True}, extra_body=IGNORE_EOS
        )
    )
    assert got == dict(enumerate(texts))
    assert finish == {0: "length", 1: "length", 2: "length"}
    assert usage.completion_tokens == 36

    # Completions: n per prompt, prompts in order.
    r = c.completions.create(
        model=main.model,
        prompt=[PROMPT, PROMPT2],
        n=2,
        max_tokens=6,
        temperature=0,
        extra_body=IGNORE_EOS,
    )
    greedy = [ref.text(t) for t in ref.greedy([ref.ids(PROMPT), ref.ids(PROMPT2)], 6)]
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
    assert [ch.text for ch in r.choices] == [greedy[0], greedy[0], greedy[1], greedy[1]]
    assert r.usage.completion_tokens == 24
