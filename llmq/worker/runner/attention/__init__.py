"""Paged attention over the KV block pool: the attention function transformers calls
(``paged``), the pool and its 8-bit form (``kv_pool``, ``kv_quant``), and each step's metadata
(``step_metadata``, with ``decode_cuts``' chunking of the decodes)."""
