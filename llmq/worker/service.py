"""Builds a worker's engine loop from Settings: model, engine, Redis transport, heartbeat."""

from __future__ import annotations

import functools
import logging
import os
import socket
import time

from llmq.common.engine_status import EngineStatus
from llmq.common.lora_adapters import AdapterError, AdapterRecord, check_adapter, parse_lora_modules
from llmq.common.settings import Settings
from llmq.common.transport import EngineTransport
from llmq.common.transport.redis_clients import engine_client, keys_for
from llmq.worker.engine_loop import EngineLoop

log = logging.getLogger(__name__)


def served_name(settings: Settings) -> str:
    return settings.served_model_name or settings.model


def build_backend(settings: Settings):
    """The generation engine, the embeddings engine for a sentence-transformers model, or the
    scoring engine for a cross-encoder (a sequence-classification model of one label)."""
    from llmq.common.model_files import load_tokenizer
    from llmq.worker import preload
    from llmq.worker.loading.cross_encoder import cross_encoder_config
    from llmq.worker.loading.model_loader import embedding_config
    from llmq.worker.vision.families import refuse_unserved, served_vision
    from llmq.worker.vision.serve import vision_backend

    refuse_unserved(settings.model)  # before anything loads: refused by name, not a traceback
    preloaded = preload.take(settings.model)  # `llmq worker --fork`: loaded before the fork
    tokenizer = preloaded.tokenizer if preloaded else load_tokenizer(settings.model)
    cross = cross_encoder_config(settings.model)
    if cross is not None:
        from llmq.worker.score_backend import build_score_backend

        return build_score_backend(settings, tokenizer, cross)
    emb = embedding_config(settings.model)
    if emb is not None:
        from llmq.worker.backends import EmbeddingBackend
        from llmq.worker.loading.model_loader import load_encoder
        from llmq.worker.runner.embedding_runner import EmbeddingRunner

        model = load_encoder(settings.model, settings.dtype, settings.device)
        limits = [emb.max_seq_length, getattr(model.config, "max_position_embeddings", None)]
        max_len = min(x for x in [*limits, settings.max_model_len] if x)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        backend = EmbeddingBackend(
            EmbeddingRunner(model, emb, pad),
            settings.max_batch_size,
            settings.max_batch_tokens * 16,
            max_len,
        )
        return backend, model, max_len

    from llmq.worker.backends import GenerationBackend
    from llmq.worker.grammar_compiler import LazyTokenizer
    from llmq.worker.llm_engine import EngineConfig, LLMEngine
    from llmq.worker.loading.model_loader import eos_token_ids, load_causal_lm

    if served_vision(settings.model):
        return vision_backend(settings, tokenizer, served_name(settings))
    if preloaded is not None:
        model = preloaded.model
    else:
        model = load_causal_lm(
            settings.model, settings.dtype, settings.device, settings.quantization
        )
    eos = eos_token_ids(model, tokenizer)
    if preloaded is None:  # loaded again by the first grammar, if one comes: not held till then
        tokenizer = LazyTokenizer(functools.partial(load_tokenizer, settings.model), len(tokenizer))
    engine = LLMEngine(model, EngineConfig.from_settings(settings), eos, tokenizer=tokenizer)
    return GenerationBackend(engine), model, engine.max_model_len


def torch_threads(settings: Settings) -> int:
    """Intra-op threads for the engine's large steps: as set, or torch's default (one per
    core). Small steps run on one thread (see ModelRunner)."""
    import torch

    return settings.torch_threads or torch.get_num_threads()


def configured_adapters(
    settings: Settings, name: str, config: dict, kind: str
) -> tuple[AdapterRecord, ...]:
    """LLMQ_LORA_MODULES as registry records, each checked against the model; one that
    cannot be applied is left out with its reason logged (the others are served)."""
    if not settings.lora_modules:
        return ()
    if kind != "generate":
        log.error("LLMQ_LORA_MODULES ignored: %s is not a generation model", name)
        return ()
    records = []
    created = int(time.time())
    for lora_name, path in parse_lora_modules(settings.lora_modules):
        try:
            info = check_adapter(path, config, settings.max_lora_rank)
        except AdapterError as exc:
            log.error("LoRA adapter %s not offered: %s", lora_name, exc)
            continue
        records.append(AdapterRecord(lora_name, name, path, "", info.rank, created))
        log.info("LoRA adapter %s (rank %d, %s) offered on %s", lora_name, info.rank, path, name)
    return tuple(records)


def forward_plan(backend) -> str:
    """The generation engine's forward plan in one line; empty for an embedding or scoring
    model, whose encoder runs transformers' forward."""
    plan = getattr(getattr(getattr(backend, "engine", None), "runner", None), "plan", None)
    return plan.describe() if plan is not None else ""


def build_engine_loop(settings: Settings, worker_name: str) -> EngineLoop:
    import torch

    from llmq.worker.runner.forward.model_support import UnsupportedModel

    torch.set_num_threads(torch_threads(settings))
    name = served_name(settings)
    try:
        backend, model, max_model_len = build_backend(settings)
    except UnsupportedModel as exc:
        from llmq.worker.refusal import record_refusal

        record_refusal(settings, name, worker_name, str(exc))
        raise
    transport = EngineTransport(
        engine_client(settings.redis_url_or_default(), settings.redis_sentinel_master),
        keys_for(settings),
        worker_name,
        name,
        settings.request_ttl,
        placement=settings.placement and backend.kind == "generate",
        adapters=configured_adapters(settings, name, model.config.to_dict(), backend.kind),
    )
    status = EngineStatus(
        model=name,
        source=settings.model,
        kind=backend.kind,
        max_model_len=max_model_len,
        vocab_size=model.config.vocab_size,
        dtype=str(next(model.parameters()).dtype).removeprefix("torch."),
        device=str(next(model.parameters()).device),
        host=socket.gethostname(),
        pid=os.getpid(),
        started=round(time.time(), 3),
        torch_threads=torch.get_num_threads(),
        forward_plan=forward_plan(backend),
        random_weights=bool(getattr(model.config, "llmq_random_weights", False)),
        worker=worker_name,
    )
    return EngineLoop(
        backend,
        transport,
        status,
        heartbeat_ttl=settings.heartbeat_ttl,
        max_deliveries=settings.max_deliveries,
        stall_timeout=settings.stall_timeout,
        stream_interval_s=settings.stream_interval_ms / 1000,
    )
