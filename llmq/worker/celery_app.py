"""The Celery app of llmq workers: Redis broker and result backend, JSON only.

A worker-level bootstep loads the model and runs the engine loop in its own thread from worker
start to warm shutdown (a consumer step would restart on every broker reconnect). The pool is
``threads``: CUDA does not survive fork, and the solo pool stops answering pings while a task
runs. Batch-job tasks (queue ``llmq.batch``) run in the same process beside the engine.
"""

from __future__ import annotations

import logging
import socket
import threading

from celery import Celery, bootsteps

from llmq.common.settings import get_settings

log = logging.getLogger("llmq.worker")

BATCH_QUEUE = "llmq.batch"


def create_app() -> Celery:
    settings = get_settings()
    url = _with_tls_defaults(settings.redis_url_or_default())
    app = Celery("llmq", broker=url, backend=url, include=["llmq.worker.batch_tasks"])
    app.conf.update(
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        event_serializer="json",
        task_default_queue=BATCH_QUEUE,
        worker_pool="threads",
        worker_prefetch_multiplier=1,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        result_expires=7 * 24 * 3600,
        worker_send_task_events=True,
        task_send_sent_event=True,
        task_track_started=True,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        broker_transport_options={
            "visibility_timeout": 60,
            "global_keyprefix": f"{settings.key_prefix}:celery:",
        },
        result_backend_transport_options={"global_keyprefix": f"{settings.key_prefix}:celery:"},
    )
    app.steps["worker"].add(EngineStep)
    return app


def _with_tls_defaults(url: str) -> str:
    """Celery refuses a rediss:// URL without ssl_cert_reqs; default it to verifying the
    server's certificate (redis-py reads the same query parameter), so TLS is configured by the
    URL alone."""
    if url.startswith("rediss://") and "ssl_cert_reqs" not in url:
        url += ("&" if "?" in url else "?") + "ssl_cert_reqs=required"
    return url


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
        built = threading.Event()
        failure: list[BaseException] = []

        def serve() -> None:
            # The model loads and runs on this one thread. OpenMP keeps a thread team per
            # thread that runs parallel regions; a second team (the model loaded on the main
            # thread) puts more OpenMP threads than cores in the process, and libgomp then
            # sleeps between regions instead of spinning: a two-thread step took 2x as long.
            from llmq.worker.service import build_engine_loop

            try:
                self.loop = build_engine_loop(settings, name)
            except BaseException as exc:
                failure.append(exc)
                return
            finally:
                built.set()
            self.loop.run()

        self.thread = threading.Thread(target=serve, name="llmq-engine", daemon=True)
        self.thread.start()
        built.wait()
        if failure:
            raise failure[0]
        log.info("engine loop started as %s", name)
        from llmq.worker.batch_tasks import supervise

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


app = create_app()
