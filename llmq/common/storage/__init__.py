"""What the Batch API, the Files API, stored responses, background responses and Message
Batches keep in Redis, read by any API replica and the worker's batch tasks: ``store`` (batches
and files together), ``batches_store``, ``files_store`` (``file_chunks``), ``responses_store``,
``background_responses``, ``message_batches``, ``batch_checkpoint`` and ``jsonl_lines``."""
