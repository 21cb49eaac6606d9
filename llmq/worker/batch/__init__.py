"""Batch jobs (the OpenAI Batch API) as Celery tasks on queue ``llmq.batch``.

A task runs one batch: it validates the input file in one streaming pass, then reads its lines
again as it goes and feeds them to ``batch_concurrency`` runners through a bounded queue, through
the same generation code as interactive requests, at batch priority, so batches fill idle
capacity while interactive requests go first. A line answered with a temporary error runs again
with backoff while the window lasts. Each line's result is checkpointed in Redis as it finishes;
a lease (renewed while the task runs) keeps a second copy of the task from running the same
batch, a run that loses it stops, and a re-run after a crash continues with the lines not yet
recorded, attaching to the requests its first run had started. Task arguments are ids only.

Modules: ``task`` (the Celery task), ``run`` (one run of a batch: lease, states, progress),
``input_lines`` (reading and validating the input file), ``feed`` (lines to a bounded number of
runners), ``lines`` (running one line, its retries and its record), ``retry`` (which answers are
temporary, the backoff), ``executor`` (where a line's request is answered), ``results`` (result
rows), ``finalize`` (the output and error files, written a slice at a time, and the final
state), ``supervisor`` (re-dispatching batches whose task died; sweeping expired files).
"""
