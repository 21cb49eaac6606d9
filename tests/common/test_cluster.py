"""llmq on a Redis Cluster (three real masters) with Celery's broker on a node of its own: two
models served by two workers through two API replicas answer exactly as a single node does
(the in-process engine's greedy output), every key of a model in its own hash slot, and no
request's keys left behind but its record."""

from __future__ import annotations

import asyncio

import httpx

from llmq.common.transport import Keys
from llmq.common.transport.redis_server import RedisServer
from tests.faults.stack import complete, completion, greedy_texts
from tests.harness import kill_all, start_api, start_worker, wait_worker
from tests.redis_cluster import RedisClusterNodes

PROMPTS = [[5 + i, 17, 33, 2 + 3 * i] for i in range(6)]
MAX_TOKENS = 24


def test_two_models_through_two_replicas_on_a_cluster_equal_one_node(
    llama_dir, qwen2_dir, tmp_path
):
    models = [str(llama_dir), str(qwen2_dir)]
    expected = {m: greedy_texts(m, PROMPTS, MAX_TOKENS) for m in models}
    with RedisClusterNodes(tmp_path / "cluster") as cluster, RedisServer() as broker:
        common = dict(celery_broker_url=broker.url)
        procs = [
            start_worker(cluster.url, m, f"w{i}", tmp_path, wait=False, **common)
            for i, m in enumerate(models)
        ]
        # The APIs start while the workers load, side by side.
        apis = [start_api(cluster.url, models[0], tmp_path, f"api{i}", **common) for i in (0, 1)]
        workers, procs = procs, procs + [proc for proc, _ in apis]
        try:
            for i, proc in enumerate(workers):
                wait_worker(cluster.url, f"w{i}", proc)

            async def ask_all() -> dict[tuple[str, int, int, bool], str]:
                bodies = [
                    (m, i, replica, stream)
                    for m in models
                    for i in range(len(PROMPTS))
                    for replica in (0, 1)
                    for stream in (False, True)
                ]
                async with httpx.AsyncClient(timeout=120) as http:
                    answers = await asyncio.gather(
                        *[
                            complete(
                                http,
                                apis[replica][1],
                                completion(PROMPTS[i], MAX_TOKENS, stream, model=m),
                            )
                            for m, i, replica, stream in bodies
                        ]
                    )
                for a in answers:
                    assert a.status == 200 and a.error is None, a
                return {b: a.text for b, a in zip(bodies, answers, strict=True)}

            texts = asyncio.run(ask_all())
            for (m, i, _, _), text in texts.items():
                assert text == expected[m][i], (m, i)

            client = cluster.client()
            streams = [Keys(cluster=True).requests(m) for m in models]
            assert all(client.exists(s) for s in streams)
            slots = {client.keyslot(s) for s in streams}
            assert len(slots) == 2  # each model in its own slot
            keys = Keys(cluster=True).for_model(models[0])
            assert client.keyslot(keys.req("x")) == client.keyslot(streams[0])
            assert all(client.xlen(s) == 0 for s in streams)  # every entry acknowledged, deleted
        finally:
            kill_all(procs)
