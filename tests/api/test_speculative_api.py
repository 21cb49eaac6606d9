"""Speculative decoding behind the API: a worker with prompt lookup on answers as one without
(a request's ``"speculative": false`` turns it off), and its acceptance shows in the heartbeat,
``/metrics`` and ``llmq inspect``. Every surface's opt-out (chat's and Responses' extra body
field, Anthropic's top-level field, Ollama's option) leaves the worker's draft counter as it
was, where the same request without it adds drafts."""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import time

import anthropic
import httpx
import ollama
import pytest

from tests.api.api_stack import PROMPT, client, stack
from tests.harness import LLMQ, base_env, heartbeat, wait_for


@pytest.fixture(scope="module")
def spec_stack(llama_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("spec-logs")
    settings = dict(speculative_method="ngram", speculative_tokens=4, speculative_ngram_min=1)
    with stack(llama_dir, logs, "w-spec", settings, {}) as s:
        yield s


def test_speculation_is_lossless_and_visible(spec_stack):
    s = spec_stack
    c = client(s.base)
    # A bias that makes the output repeat itself: prompt lookup's drafts are accepted.
    for bias in ({}, {"7": 100}):
        body = dict(model=s.model, prompt=PROMPT, max_tokens=40, temperature=0, logit_bias=bias)
        on = c.completions.create(**body, extra_body={"ignore_eos": True})
        off = c.completions.create(**body, extra_body={"ignore_eos": True, "speculative": False})
        assert on.choices[0].text == off.choices[0].text
        assert on.usage.completion_tokens == off.usage.completion_tokens == 40

    beat = wait_for(
        lambda: (h := heartbeat(s.redis_url, s.worker_name)).get("spec_accepted", "0") != "0" and h,
        30,
        "the heartbeat's speculation counters",
    )
    assert int(beat["spec_accepted"]) <= int(beat["spec_proposed"])

    def metrics() -> str:
        return httpx.get(f"{s.base}/metrics", timeout=10).text

    def rate(text: str) -> float:
        gauge = "llmq:spec_decode_acceptance_rate{"
        return next((float(x.split()[-1]) for x in text.splitlines() if x.startswith(gauge)), 0)

    # The API reads heartbeats it may have cached from before the biased requests' drafts.
    text = wait_for(lambda: rate(m := metrics()) > 0 and m, 30, "the speculation gauges")
    assert 0 < rate(text) <= 1
    assert "llmq:spec_decode_mean_accepted_length{" in text

    shown = subprocess.run(
        [LLMQ, "inspect"],
        env=base_env(s.redis_url, s.model),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shown.returncode == 0, shown.stderr
    assert "speculative decoding:" in shown.stdout and "draft tokens accepted" in shown.stdout


# A prompt that repeats itself: its greedy continuation on the random model meets tokens it
# has seen, which prompt lookup proposes.
REPEATS = "one two three one two three one two three one two three"


def _beat_after(s, moment: float) -> dict[str, str]:
    """The first heartbeat written after ``moment`` (the worker's wall clock, this host's)."""
    return wait_for(
        lambda: float((h := s.heartbeat()).get("updated", 0)) > moment and h,
        30,
        "a heartbeat after the request",
    )


def test_every_surface_opts_out(spec_stack):
    s = spec_stack
    user = [{"role": "user", "content": REPEATS}]
    messages = anthropic.Anthropic(base_url=s.base, api_key="none", max_retries=0, timeout=120)
    oc = ollama.Client(host=s.base, timeout=120)
    c = client(s.base)

    def anthropic_sent(on: bool) -> int:
        extra = {"temperature": 0} | ({} if on else {"speculative": False})
        r = messages.messages.create(model=s.model, max_tokens=64, messages=user, extra_body=extra)
        return r.usage.output_tokens

    def ollama_chat(on: bool) -> int:
        options = {"temperature": 0, "num_predict": 64} | ({} if on else {"speculative": False})
        return oc.chat(model=s.model, messages=user, options=options).eval_count

    def responses(on: bool) -> int:
        extra = {} if on else {"extra_body": {"speculative": False}}
        r = c.responses.create(
            model=s.model, input=REPEATS, max_output_tokens=64, temperature=0, **extra
        )
        return r.usage.output_tokens

    # Each request's drafts: the heartbeats' count from one written after the request before
    # it answered to one written after it answered.
    beat = _beat_after(s, time.time())
    for send in (anthropic_sent, ollama_chat, responses):
        for on in (False, True):
            assert send(on) > 0  # output tokens
            before, beat = beat, _beat_after(s, time.time())
            drafts = int(beat["spec_proposed"]) - int(before["spec_proposed"])
            assert (drafts > 0) == on, (send.__name__, on, drafts)


def _bench(s, *flags: str) -> dict:
    """One short `llmq bench` run of the code-edit workload against the stack, in-process."""
    from llmq.tools.bench_cli import add_arguments, bench

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    run = ["--base-url", s.base, "--requests", "2", "--output-tokens", "64"]
    args = parser.parse_args([*run, "--workload", "code-edit", *flags])
    return asyncio.run(bench(args))["summary"]


def test_bench_reports_the_runs_acceptance(spec_stack):
    from llmq.tools.bench_cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    shown = parser.format_help()
    assert "--workload" in shown and "code-edit" in shown and "--no-speculative" in shown
    on = _bench(spec_stack)
    assert on["completed"] == 2 and on["speculative"]["drafts"] > 0
    assert 0 <= on["speculative"]["acceptance"] <= 1
    assert on["speculative"]["mean_accepted_length"] >= 1
    off = _bench(spec_stack, "--no-speculative")
    assert off["completed"] == 2 and off["speculative"]["drafts"] == 0
