"""The Celery app of llmq workers: the broker, backend and serializers of
``llmq.common.transport.celery_client`` (shared with the API, which sends batch tasks by name), plus the
worker's own settings.

A worker-level bootstep loads the model and runs the engine loop in its own thread from worker
start to warm shutdown (a consumer step would restart on every broker reconnect). The pool is
``threads``: CUDA does not survive fork, and the solo pool stops answering pings while a task
runs. Batch-job tasks (queue ``llmq.batch``) run in the same process beside the engine.

Should the engine loop ever stop for good, the worker exits with code 1 rather than go on
answering ``celery inspect ping`` (the compose healthcheck) with no engine behind it.
"""

from __future__ import annotations

import logging
import os
import socket
import threading

from celery import Celery, bootsteps

from llmq.common.settings import get_settings
from llmq.common.transport.celery_client import BATCH_QUEUE, make_celery

log = logging.getLogger("llmq.worker")

# After the engine loop died: how long the warm shutdown may wait for batch tasks before the
# process exits anyway (their leases expire and another worker re-runs them).
ENGINE_DEATH_EXIT_S = 10.0
# Set once the engine loop died: `llmq worker` exits with code 1 after Celery's shutdown.
engine_died = threading.Event()

__all__ = ["BATCH_QUEUE", "app", "create_app", "engine_died"]


def create_app() -> Celery:
    app = make_celery(
        get_settings(),
        include=["llmq.worker.batch.task", "llmq.worker.background", "llmq.worker.webhook_task"],
    )
    app.conf.update(
        worker_pool="threads",
        worker_prefetch_multiplier=1,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_send_task_events=True,
        task_track_started=True,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
    )
    app.steps["worker"].add(EngineStep)
    return app


class EngineStep(bootsteps.StartStopStep):
    """Loads the model at worker start and runs the engine loop until warm shutdown."""

    requires = {"celery.worker.components:Pool"}

    def __init__(self, worker, **kwargs):
        super().__init__(worker, **kwargs)
        self.loop = None
        self.thread: threading.Thread | None = None
        self.supervisor_stop = threading.Event()

    def start(self, worker) -> None:
        settings = get_settings()
        name = settings.worker_name or worker.hostname or f"{socket.gethostname()}:{id(worker)}"
        if settings.catalogue:  # no model of its own: those requests name, loaded on demand
            from llmq.worker.model_manager import start_manager

            self.loop = start_manager(settings, name)
            self._start_supervisor()
            return
        built = threading.Event()
        failure: list[BaseException] = []

        def serve() -> None:
            # The model loads and runs on this one thread. OpenMP keeps a thread team per
            # thread that runs parallel regions; a second team (the model loaded on the main
            # thread) puts more OpenMP threads than cores in the process, and libgomp then
            # sleeps between regions instead of spinning, which slows every step.
            from llmq.worker.service import build_engine_loop

            try:
                self.loop = build_engine_loop(settings, name)
            except BaseException as exc:
                failure.append(exc)
                return
            finally:
                built.set()
            try:
                self.loop.run()
            except BaseException:
                _exit_worker()

        self.thread = threading.Thread(target=serve, name="llmq-engine", daemon=True)
        self.thread.start()
        built.wait()
        if failure:  # a model that cannot load or is refused: exit 1 after Celery's shutdown
            engine_died.set()
            from llmq.worker.runner.forward.model_support import UnsupportedModel

            if isinstance(failure[0], UnsupportedModel):  # refused by name (logged): no traceback
                raise SystemExit(1)
            raise failure[0]
        log.info("engine loop started as %s", name)
        self._start_supervisor()

    def _start_supervisor(self) -> None:
        from llmq.worker.batch.supervisor import supervise

        threading.Thread(
            target=supervise,
            args=(self.supervisor_stop,),
            name="llmq-batch-supervisor",
            daemon=True,
        ).start()

    def stop(self, worker) -> None:
        self.supervisor_stop.set()
        if self.loop is None:
            return
        grace = get_settings().shutdown_grace
        self.loop.stop(grace)
        if self.thread is not None:
            self.thread.join(grace + 5)
        log.info("engine loop stopped")

    def shutdown(self, worker) -> None:
        self.stop(worker)


def _exit_worker() -> None:
    """The engine loop died (its heartbeat is gone, so other workers take its requests over):
    shut the worker down warm with exit code 1, so that an orchestrator restarts it, and exit
    for sure if batch tasks keep the warm shutdown waiting."""
    from celery.worker import state

    log.critical("the engine loop stopped for good; the worker exits with code 1")
    engine_died.set()
    state.should_stop = 1  # the worker's main loop checks it once a turn
    timer = threading.Timer(ENGINE_DEATH_EXIT_S, os._exit, args=(1,))
    timer.daemon = True
    timer.start()


def _survive_lost_broker_on_close() -> None:
    """kombu's Redis QoS puts unacknowledged messages back when its channel closes; after the
    broker's connection was lost (a Sentinel failover while a batch task ran) the channel has
    no connection left, the restore raises AttributeError ('NoneType' has no 'hostname'), and
    Celery takes that for an unrecoverable error: the whole worker stopped, engine included.
    The messages stay in kombu's unacked hash, which puts them back after the visibility
    timeout (and the batch supervisor re-dispatches a run whose lease lapsed)."""
    from kombu.transport import redis as kombu_redis

    restore = kombu_redis.QoS.restore_unacked_once

    def restore_unacked_once(self, stderr=None):
        try:
            return restore(self, stderr)
        except AttributeError as exc:
            log.warning("unacknowledged batch messages left for redelivery (%s)", exc)
            return None

    kombu_redis.QoS.restore_unacked_once = restore_unacked_once


_survive_lost_broker_on_close()
app = create_app()
