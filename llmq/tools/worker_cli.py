"""`llmq worker`: a Celery worker (threads pool) that holds the model and runs the engine."""

from __future__ import annotations

import argparse
import os
import socket

from llmq.tools.settings_flags import override_settings


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "worker",
        help="run a Celery worker that holds the model and runs the engine",
        description="A Celery worker (threads pool) whose engine loop serves the model's "
        "request stream; it also runs batch-job tasks.",
    )
    p.add_argument("--name", help="worker name (LLMQ_WORKER_NAME); default llmq-PID@HOST")
    p.add_argument("--model", help="model id or path (LLMQ_MODEL)")
    p.add_argument("--redis-url", help="Redis URL (LLMQ_REDIS_URL)")
    p.add_argument("--torch-threads", type=int, help="torch threads (LLMQ_TORCH_THREADS)")
    p.add_argument("--concurrency", type=int, default=4, help="batch-task threads (default 4)")
    p.set_defaults(func=run, parser=p)


def run(args: argparse.Namespace) -> int:
    # Idle OpenMP threads spin briefly, then sleep (read when torch loads). A step runs
    # ~2,400 parallel regions back to back: sleeping between them (OMP_WAIT_POLICY=PASSIVE)
    # made a two-thread step twice as slow as one thread; spinning forever takes the cores
    # from Redis and the API between steps. A short spin bridges the gaps inside a step only.
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")
    override_settings(
        model=args.model,
        worker_name=args.name,
        redis_url=args.redis_url,
        torch_threads=args.torch_threads,
    )
    from llmq.common.settings import get_settings
    from llmq.worker.celery_app import BATCH_QUEUE, app, engine_died

    name = get_settings().worker_name or f"llmq-{os.getpid()}@%h"
    name = name.replace("%h", socket.gethostname())  # Celery's host placeholder
    override_settings(worker_name=name)
    app.worker_main(
        [
            "worker",
            "--pool=threads",
            f"--concurrency={args.concurrency}",
            f"--queues={BATCH_QUEUE}",
            f"--hostname={name}",
            f"--loglevel={args.log_level}",
            "--without-gossip",
            "--without-mingle",
            "--task-events",
        ]
    )
    return 1 if engine_died.is_set() else 0  # restart me: the engine loop is gone
