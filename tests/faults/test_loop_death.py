"""An engine loop that stops for good takes the worker with it: the heartbeat vanishes (other
workers take its requests over) and the process exits non-zero, so that `celery inspect ping`
fails and an orchestrator restarts it, instead of a worker answering pings with no engine."""

from __future__ import annotations

import sys

import redis

from llmq.common.protocol import EngineRequest
from llmq.common.sampling_params import SamplingParams
from llmq.common.transport.redis_server import RedisServer
from tests.harness import Proc, base_env, wait_for, wait_worker
from tests.pipeline_client import stream_of

# `llmq worker`, with one thing changed from outside: a request of this id makes the loop's
# turn raise an error it does not survive (a bug the loop cannot know of).
DOOMED = """
import sys
from llmq.cli import main
from llmq.worker import engine_loop

admit = engine_loop.EngineLoop._admit

def doomed(self, pulled):
    if any(p.request is not None and p.request.id == "kill-the-loop" for p in pulled):
        raise RuntimeError("a bug in the engine loop")
    return admit(self, pulled)

engine_loop.EngineLoop._admit = doomed
sys.exit(main(["worker", "--name", "w-doomed"]))
"""


def test_a_dead_engine_loop_removes_the_heartbeat_and_exits_the_worker(llama_dir, tmp_path):
    with RedisServer() as server:
        r = redis.Redis.from_url(server.url)
        env = base_env(server.url, llama_dir, heartbeat_ttl=30)  # only removal ends it soon
        worker = Proc([sys.executable, "-c", DOOMED], env, tmp_path / "worker.log")
        try:
            wait_worker(server.url, "w-doomed", worker)
            assert r.zscore("llmq:engines", "w-doomed") is not None
            request = EngineRequest("kill-the-loop", [5, 6, 7], SamplingParams(max_tokens=4))
            r.xadd(
                stream_of(llama_dir),
                {"id": request.id, "kind": "generate", "payload": request.to_json()},
            )
            wait_for(lambda: not worker.alive(), 60, "the worker to exit")
            assert worker.proc.returncode == 1, worker.log()
            assert not r.exists("llmq:engines:w-doomed")
            assert r.zscore("llmq:engines", "w-doomed") is None
            log = worker.log(10**6)
            assert "engine loop crashed" in log and "RuntimeError: a bug in the engine loop" in log
            assert "the worker exits with code 1" in log
        finally:
            worker.terminate()
