"""Redis reaches its maxmemory (`CONFIG SET maxmemory` to a tiny value, policy noeviction): it
refuses every write with OOM. Requests get a clear 503 naming it (never a hang, never a 500),
the request running when it hit ends with a clear error too, the worker survives; once
maxmemory is reset the next requests are served exactly."""

from __future__ import annotations

import asyncio

import httpx

from tests.faults.stack import complete, completion, greedy_texts, served
from tests.harness import recorded_tokens, request_ids, wait_for

PROMPT = [7, 21, 3, 99, 14]
MAX_TOKENS = 64
LONG = 1800


def test_redis_out_of_memory_is_a_clear_error_and_the_worker_survives(llama_dir, tmp_path):
    expected = greedy_texts(llama_dir, [PROMPT], MAX_TOKENS)[0]
    worker = dict(heartbeat_ttl=2)
    api = dict(request_timeout=60)
    with served(
        llama_dir, tmp_path, "w-oom", worker, api, ["--maxmemory-policy", "noeviction"]
    ) as s:
        r = s.redis()
        warm = httpx.post(f"{s.base}/v1/completions", json=completion(PROMPT, 1), timeout=60)
        assert warm.status_code == 200, warm.text

        async def run():
            async with httpx.AsyncClient(timeout=60) as http:
                running = asyncio.ensure_future(
                    complete(http, s.base, completion(PROMPT, LONG, stream=True))
                )
                generating = lambda: any(  # noqa: E731
                    len(recorded_tokens(r, i)) >= 3 for i in request_ids(r)
                )
                await asyncio.to_thread(wait_for, generating, 30, "the first tokens", 0.02)
                r.config_set("maxmemory", 1)  # below what it holds already: every write fails
                refused = [
                    await complete(http, s.base, completion(PROMPT, 4, stream=stream))
                    for stream in (False, True)
                ]
                return await asyncio.wait_for(running, 30), refused

        try:
            cut, refused = asyncio.run(run())
        finally:
            r.config_set("maxmemory", 0)
        for answer in refused:
            assert answer.status == 503, answer
            assert answer.error["code"] == "redis_out_of_memory", answer.error
            assert "maxmemory" in answer.error["message"]
            assert int(answer.headers["retry-after"]) > 0
        assert cut.error is not None and cut.status == 200, cut  # its stream's error event
        print(f"the request running at OOM ended with {cut.error['code']}")
        assert cut.error["code"] in ("no_worker", "redis_out_of_memory"), cut.error

        wait_for(lambda: s.heartbeat(), 30, "the worker's heartbeat back")
        after = httpx.post(
            f"{s.base}/v1/completions", json=completion(PROMPT, MAX_TOKENS), timeout=60
        )
        assert after.status_code == 200, after.text
        assert after.json()["choices"][0]["text"] == expected
        assert s.worker.alive() and "engine loop crashed" not in s.worker.log(10**6)
        assert "unhandled error" not in s.api.log(10**6)
