"""A worker of a vision-language model: its text model under the engine, its image encoder
in the runner's vision runtime, image bytes read from Redis."""

from __future__ import annotations

import functools
import logging

from llmq.common.settings import Settings

log = logging.getLogger(__name__)


def vision_backend(settings: Settings, tokenizer, served_name: str):
    """(the backend, the text model, its context) for ``settings.model``, a vision-language
    folder of a family served."""
    from llmq.common.model_files import load_tokenizer
    from llmq.common.transport.redis_clients import engine_client, keys_for
    from llmq.worker.grammar_compiler import LazyTokenizer
    from llmq.worker.llm_engine import EngineConfig, LLMEngine
    from llmq.worker.loading.model_loader import eos_token_ids, resolve_device, resolve_dtype
    from llmq.worker.vision.backend import VisionBackend
    from llmq.worker.vision.families import vision_model_type
    from llmq.worker.vision.llava import load_vision_lm
    from llmq.worker.vision.qwen2_5_vl import load_qwen2_5_vl
    from llmq.worker.vision.runtime import VisionRuntime

    if settings.quantization != "none":
        log.warning("LLMQ_QUANTIZATION ignored: vision-language models are served unquantized")
    device = resolve_device(settings.device)
    load = load_qwen2_5_vl if vision_model_type(settings.model) == "qwen2_5_vl" else load_vision_lm
    lm, encoder = load(settings.model, resolve_dtype(settings.dtype, device), device)
    eos = eos_token_ids(lm, tokenizer)
    lazy = LazyTokenizer(functools.partial(load_tokenizer, settings.model), len(tokenizer))
    engine = LLMEngine(lm, EngineConfig.from_settings(settings), eos, tokenizer=lazy)
    client = engine_client(settings.redis_url_or_default(), settings.redis_sentinel_master)
    keys = keys_for(settings).for_model(served_name)

    def fetch(digest: str) -> bytes | None:
        return client.get(keys.image(digest))

    runtime = VisionRuntime(encoder, fetch)
    return VisionBackend(engine, runtime), lm, engine.max_model_len
