"""The Celery task that runs one batch, registered under its name on queue ``llmq.batch``."""

from __future__ import annotations

import asyncio

from celery import Task

from llmq.common.transport.celery_client import BATCH_TASK
from llmq.worker.batch.run import BatchRun
from llmq.worker.celery_app import app


@app.task(name=BATCH_TASK, bind=True, acks_late=True, reject_on_worker_lost=True)
def run_batch(self: Task, batch_id: str) -> dict:
    return asyncio.run(BatchRun(batch_id, self).run())
