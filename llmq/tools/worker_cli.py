"""`llmq worker`: a Celery worker (threads pool) that holds the model and runs the engine."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
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
    p.add_argument(
        "--fork",
        type=int,
        default=1,
        metavar="N",
        help="run N workers that share one load of a CPU model (forked after loading it); "
        "SIGTERM to this process stops them all",
    )
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

    index, children = _fork_workers(args.fork) if args.fork > 1 else (0, [])
    from llmq.worker.celery_app import BATCH_QUEUE, app, engine_died

    if children:
        from celery.signals import worker_shutting_down

        worker_shutting_down.connect(lambda **_: _signal(children, signal.SIGTERM), weak=False)

    name = get_settings().worker_name or f"llmq-{os.getpid()}@%h"
    if args.fork > 1 and get_settings().worker_name:
        name = f"{name}-{index}"  # one name per forked worker
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
    for pid in children:
        os.waitpid(pid, 0)
    return 1 if engine_died.is_set() else 0  # restart me: the engine loop is gone


def _fork_workers(count: int) -> tuple[int, list[int]]:
    """Load the model once, then fork: this process's index, and the children's pids here."""
    from llmq.common.settings import get_settings
    from llmq.worker import preload

    preload.preload(get_settings())  # a GPU or embeddings model: each worker loads its own
    return preload.fork(count)


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
