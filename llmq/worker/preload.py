"""One load of a CPU model, shared by several workers forked from it (``llmq worker --fork N``).

Each worker process held its own copy of what it loads before serving: torch's relocated code and
data, the tokenizer, and the weights (docs/performance.md: PSS with and without the fork). Loaded
once and forked, the workers share those pages copy-on-write; nothing writes the weights, so they
stay shared. RSS counts a shared page in every process that maps it, PSS once.

What may cross a fork: no OpenMP thread team (libgomp's does not survive one: the load runs on
one torch thread, which runs no parallel region), no thread of any kind, no connection (Redis and
Celery connect after it). CUDA does not survive a fork at all: GPU workers load on their own.
"""

from __future__ import annotations

import gc
import logging
import os
from dataclasses import dataclass

from llmq.common.settings import Settings

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Preloaded:
    model_name: str
    tokenizer: object
    model: object  # the causal LM, its decoder forward built (``decoder_forward.attach``)


_preloaded: Preloaded | None = None


def preload(settings: Settings) -> bool:
    """Load the served model into this process for the workers forked from it; False where it
    cannot be shared (a GPU, an embeddings model, a cross-encoder): each worker then loads its
    own."""
    global _preloaded
    import torch

    from llmq.common.model_files import load_tokenizer
    from llmq.worker.kv_setup import inspect_ahead
    from llmq.worker.loading.cross_encoder import cross_encoder_config
    from llmq.worker.loading.model_loader import embedding_config, load_causal_lm, resolve_device
    from llmq.worker.runner import cpu_kernels
    from llmq.worker.runner.forward.decoder_forward import attach, build_forward

    if (
        resolve_device(settings.device) != "cpu"
        or embedding_config(settings.model) is not None
        or cross_encoder_config(settings.model) is not None
    ):
        return False
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tokenizer = load_tokenizer(settings.model)
        model = load_causal_lm(
            settings.model, settings.dtype, settings.device, settings.quantization
        )
        inspect_ahead(model)  # while transformers' forward has its weights
        # Built and loaded once, before the workers fork (the forward's packing may use them).
        kernels = settings.cpu_kernels and cpu_kernels.load()
        forward = build_forward(model, settings.fast_forward, settings.pack_weights, kernels)
        if forward is not None:
            attach(model, forward)
    finally:
        torch.set_num_threads(threads)
    _preloaded = Preloaded(settings.model, tokenizer, model)
    return True


def take(model_name: str) -> Preloaded | None:
    """The preloaded model, once, if it is ``model_name``."""
    global _preloaded
    got, _preloaded = _preloaded, None
    return got if got is not None and got.model_name == model_name else None


def fork(count: int) -> tuple[int, list[int]]:
    """Fork ``count - 1`` more processes from this one. Returns this process's index (0: the
    parent) and, in the parent, the children's pids."""
    gc.collect()
    gc.freeze()  # the collector would otherwise write to every shared object's page
    children = []
    for index in range(1, count):
        pid = os.fork()
        if pid == 0:
            return index, []
        children.append(pid)
    log.info("forked %d workers sharing one load of the model: %s", len(children), children)
    return 0, children
