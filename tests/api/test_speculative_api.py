"""Speculative decoding behind the API: a worker with prompt lookup on answers as one without
(a request's ``"speculative": false`` turns it off), and its acceptance shows in the heartbeat,
``/metrics`` and ``llmq inspect``."""

from __future__ import annotations

import subprocess

import httpx
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

    text = wait_for(
        lambda: "llmq:spec_decode_acceptance_rate{" in (m := metrics()) and m,
        30,
        "the speculation gauges in /metrics",
    )
    rate = next(x for x in text.splitlines() if x.startswith("llmq:spec_decode_acceptance_rate{"))
    assert 0 < float(rate.split()[-1]) <= 1
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
