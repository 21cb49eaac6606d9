"""Batch jobs (the OpenAI Batch API) as Celery tasks on queue ``llmq.batch``.

A task runs one batch: it validates the input file, then feeds its lines with bounded
concurrency through the same generation code as interactive requests, at batch priority, so
batches fill idle capacity while interactive requests go first. Each line's result is
checkpointed in Redis as it finishes; a lease (renewed while the task runs) keeps a second copy
of the task from running the same batch, and a re-run after a crash continues with the lines
not yet recorded, attaching to the requests its first run had started. Task arguments are ids
only.

Modules: ``task`` (the Celery task), ``run`` (one run of a batch: lease, states, progress),
``input_lines`` (reading and validating the input file), ``lines`` (running one line),
``executor`` (where a line's request is answered), ``results`` (result rows, output and error
files), ``supervisor`` (re-dispatching batches whose task died).
"""
