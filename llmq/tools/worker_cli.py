"""`llmq worker`: a Celery worker (threads pool) that holds the model and runs the engine."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import TYPE_CHECKING

from llmq.tools.settings_flags import override_settings

if TYPE_CHECKING:
    from llmq.common.settings import Settings

log = logging.getLogger(__name__)


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

    if get_settings().catalogue and args.fork > 1:
        args.parser.error("--fork shares one model's load: not with LLMQ_CATALOGUE")
    if get_settings().catalogue and "PYTHONMALLOC" not in os.environ:
        _run_on_system_malloc()
    announced: LoadingAnnouncement | None = None
    if not get_settings().catalogue:  # with one, each load on demand is announced as it runs
        announced = LoadingAnnouncement(get_settings(), _worker_name(args.fork, 0))
    index, children = _fork_workers(args.fork, announced) if args.fork > 1 else (0, [])
    if index > 0:
        announced = None  # the parent's, not this forked worker's
    name = _worker_name(args.fork, index)
    override_settings(worker_name=name)
    from llmq.worker.celery_app import BATCH_QUEUE, app, engine_died

    if children:
        from celery.signals import worker_shutting_down

        worker_shutting_down.connect(lambda **_: _signal(children, signal.SIGTERM), weak=False)

    try:
        _start_celery_worker(app, name, BATCH_QUEUE, args)
    finally:
        if announced is not None:
            announced.withdraw()
    for pid in children:
        os.waitpid(pid, 0)
    return 1 if engine_died.is_set() else 0  # restart me: the engine loop is gone


def _start_celery_worker(app, name: str, queue: str, args: argparse.Namespace) -> None:
    """What `celery worker --pool=threads --without-gossip --without-mingle --task-events`
    runs, without Celery's click command line: that imports its every verb and plugin (the
    REPL's prompt_toolkit, Flower's tornado), ~0.3 s of CPU of each worker's start."""
    from celery.concurrency import get_implementation
    from celery.platforms import maybe_drop_privileges
    from celery.utils.nodenames import default_nodename, host_format

    maybe_drop_privileges()  # its warning for a worker run as root, as the command's
    app.Worker(
        hostname=host_format(default_nodename(name)),
        pool_cls=get_implementation("threads"),
        concurrency=args.concurrency,
        queues=[queue],
        loglevel=args.log_level,
        without_gossip=True,
        without_mingle=True,
        task_events=True,
    ).start()


def _run_on_system_malloc() -> None:
    """A catalogue worker runs on glibc's malloc, not Python's small-object allocator: its
    arenas, pinned by a few objects each load leaves behind, kept SmolLM2's worker 17-20% over
    its idle RSS after an unload, 8 MiB more each cycle; on malloc, 5% and flat
    (docs/models-on-demand.md, "Memory after an unload"). Read as the interpreter starts, so the
    worker starts itself again with it (PYTHONMALLOC set by hand is kept)."""
    os.environ["PYTHONMALLOC"] = "malloc"
    os.execv(sys.executable, sys.orig_argv)


def _worker_name(fork: int, index: int) -> str:
    """LLMQ_WORKER_NAME (with the index of a forked worker), else llmq-PID@HOST."""
    from llmq.common.settings import get_settings

    name = get_settings().worker_name or f"llmq-{os.getpid()}@%h"
    if fork > 1 and get_settings().worker_name:
        name = f"{name}-{index}"  # one name per forked worker
    return name.replace("%h", socket.gethostname())  # Celery's host placeholder


def _fork_workers(count: int, announced: LoadingAnnouncement) -> tuple[int, list[int]]:
    """Load the model once, then fork: this process's index, and the children's pids here.
    The announcement's thread is stopped across the fork (a lock it held would stay held in
    the children) and goes on in the parent."""
    from llmq.common.settings import get_settings
    from llmq.worker import preload

    preload.preload(get_settings())  # a GPU or embeddings model: each worker loads its own
    announced.pause()
    index, children = preload.fork(count)
    if index == 0:
        announced.resume()
    return index, children


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


class LoadingAnnouncement:
    """The worker's model listed as loading (``Keys.loading``) from its start until an engine
    of it serves: an app that lists /v1/models once at its start sees the model it will get,
    not nothing. Renewed every ``RENEW`` seconds and valid for ``VALID``: a worker that dies
    loading leaves a record the API ignores (and deletes) seconds later. Best effort: a Redis
    not there yet is asked again at the next renewal."""

    RENEW, VALID = 2.0, 10.0

    def __init__(self, settings: Settings, worker: str):
        from llmq.common.transport.redis_clients import keys_for, tool_client

        self.worker, self.keys = worker, keys_for(settings)
        self.model, self.source = settings.served_name, settings.model
        self.client = tool_client(settings.redis_url_or_default(), settings.redis_sentinel_master)
        self.since, self.lock = time.time(), threading.Lock()
        self.resume()

    def resume(self) -> None:
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="loading-announcement", daemon=True)
        self.thread.start()

    def pause(self) -> None:
        """The thread stopped and joined, its record left as it is."""
        self.stop.set()
        self.thread.join()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                if self._served():
                    log.info(
                        "load phase: %s serving, %.2f s after the worker started",
                        self.model,
                        time.time() - self.since,
                    )
                    self.withdraw()
                    return
                record = {"model": self.model, "source": self.source, "since": self.since}
                record["until"] = time.time() + self.VALID
                with self.lock:  # never renewed after its withdrawal
                    if not self.stop.is_set():
                        self.client.hset(self.keys.loading, self.worker, json.dumps(record))
            except Exception as exc:  # Redis not there yet: the engine's start reports it
                log.debug("loading announcement: %s", exc)
            self.stop.wait(self.RENEW)

    def _served(self) -> bool:
        """Whether an engine of this model has started since this worker did."""
        from llmq.common.transport.keys import as_text

        for worker in self.client.zrange(self.keys.engines_index, 0, -1):
            model, started = self.client.hmget(
                self.keys.engine(as_text(worker)), "model", "started"
            )
            if model and as_text(model) == self.model and float(started or 0) >= self.since:
                return True
        return False

    def withdraw(self) -> None:
        with self.lock, contextlib.suppress(Exception):
            self.stop.set()
            self.client.hdel(self.keys.loading, self.worker)
