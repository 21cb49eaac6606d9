"""Inputs built to break the server are answered 400 or 404 in OpenAI's shape, never a 500: a
logit_bias key of 5000 digits, numbers past int64 or below zero, a temperature so small that
dividing by it overflows (it is greedy), and ids in URL paths that are not ids, which build
no Redis key at all (MONITOR sees none)."""

from __future__ import annotations

import re
import socket
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
import redis

from tests.faults.stack import Served, served

MESSAGES = [{"role": "user", "content": "What does XREADGROUP do?"}]
HUGE = [10**30, 2**63, 2**64, -(2**64), 1e308]


@pytest.fixture(scope="module")
def s(llama_dir, tmp_path_factory) -> Iterator[Served]:
    with served(llama_dir, tmp_path_factory.mktemp("bad-inputs"), "w-bad") as s:
        yield s


def assert_error(resp: httpx.Response, status: int, param: str | None = None) -> dict:
    assert resp.status_code == status, (resp.status_code, resp.text[:300])
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    if param is not None:
        assert error["param"] == param, error
    return error


def test_a_logit_bias_key_of_5000_digits_is_a_400(s):
    """Past Python's int() digit limit: it was a 500."""
    huge = {"9" * 5000: 1}
    chat = {"messages": MESSAGES, "logit_bias": huge}
    assert_error(httpx.post(f"{s.base}/v1/chat/completions", json=chat), 400, "logit_bias")
    comp = {"prompt": "x", "logit_bias": huge}
    assert_error(httpx.post(f"{s.base}/v1/completions", json=comp), 400, "logit_bias")


def test_a_temperature_of_1e_40_is_the_greedy_answer(s):
    for path, body in (
        ("chat/completions", {"messages": MESSAGES}),
        ("completions", {"prompt": "def fibonacci(n):"}),
    ):
        texts = []
        for temperature in (0, 1e-40):
            extra = {"temperature": temperature, "max_tokens": 24, "ignore_eos": True}
            resp = httpx.post(f"{s.base}/v1/{path}", json={**body, **extra}, timeout=60)
            assert resp.status_code == 200, resp.text
            choice = resp.json()["choices"][0]
            texts.append(choice["text"] if "text" in choice else choice["message"]["content"])
        assert texts[0] == texts[1] and texts[0], texts


@pytest.mark.parametrize("name", ["n", "best_of", "max_tokens", "max_completion_tokens"])
def test_n_best_of_and_max_tokens_at_their_extremes_are_400(s, name):
    for value in (0, -1, 10**6, *HUGE, 1e-40):
        body = {"messages": MESSAGES, "max_tokens": 2, name: value}
        resp = httpx.post(f"{s.base}/v1/chat/completions", json=body, timeout=30)
        assert_error(resp, 400, name)
        if name == "max_completion_tokens" or (name == "max_tokens" and value == 0):
            continue  # completions' max_tokens 0: the prompt alone (its logprobs)
        body = {"prompt": "x", "max_tokens": 2, name: value}
        assert_error(httpx.post(f"{s.base}/v1/completions", json=body, timeout=30), 400, name)


@contextmanager
def monitored(s: Served) -> Iterator[list[str]]:
    """Every command Redis ran meanwhile (MONITOR), read up to a marker sent at the end."""
    seen: list[str] = []
    with socket.create_connection((s.server.host, s.server.port), timeout=10) as sock:
        sock.sendall(b"MONITOR\r\n")
        assert sock.recv(5) == b"+OK\r\n"
        yield seen
        marker = f"monitor-end-{uuid.uuid4().hex}".encode()
        s.redis().echo(marker)
        out = b""
        while marker not in out:
            out += sock.recv(1 << 16)
    seen += out.decode(errors="replace").splitlines()


BAD_IDS = ["..%2Fx", "a:b", "x" * 5000, "fïlé-ü", "%00", f"{uuid.uuid4().hex}:content"]


def test_ids_in_url_paths_not_in_the_id_format_are_404_and_build_no_key(s):
    r: redis.Redis = s.redis()
    keys = set(r.keys())
    with monitored(s) as commands:
        for raw in BAD_IDS:
            for prefix in ("", "file-", "batch-"):
                bad = prefix + raw
                for method, path in (
                    ("GET", f"/v1/files/{bad}"),
                    ("GET", f"/v1/files/{bad}/content"),
                    ("DELETE", f"/v1/files/{bad}"),
                    ("GET", f"/v1/batches/{bad}"),
                    ("POST", f"/v1/batches/{bad}/cancel"),
                ):
                    error = assert_error(httpx.request(method, s.base + path, timeout=30), 404)
                    assert error["type"] == "not_found_error"
                body = {"input_file_id": bad, "endpoint": "/v1/completions"}
                body["completion_window"] = "24h"
                resp = httpx.post(f"{s.base}/v1/batches", json=body, timeout=30)
                assert_error(resp, 404, "input_file_id")
        # A well-formed id that names nothing is looked up: MONITOR shows that lookup.
        control = f"file-{uuid.uuid4().hex}"
        assert_error(httpx.get(f"{s.base}/v1/files/{control}", timeout=30), 404, "file_id")
    # The object keys (files:{id}, batches:{id}) were never named but for the well-formed id;
    # the index of active batches and the files' retention index are the workers' business.
    named = [c for c in commands if re.search(r'"llmq:(files|batches):(?!(active|expiry)")', c)]
    assert named and all(f'"llmq:files:{control}"' in c for c in named), named[:5]
    # No key made (an earlier test's request record may expire meanwhile: fewer is fine).
    made = set(r.keys()) - keys
    assert not made, made
