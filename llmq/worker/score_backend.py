"""The backend of a cross-encoder worker: score requests batched as embedding requests are (the
pairs sorted by length to cut padding), each pair's score sent back as a vector of one."""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmq.common.protocol import EngineRequest
from llmq.worker.backends import EmbeddingBackend
from llmq.worker.request_error import RequestError

if TYPE_CHECKING:
    from llmq.common.settings import Settings
    from llmq.worker.loading.cross_encoder import CrossEncoderConfig


class ScoreBackend(EmbeddingBackend):
    """Inputs are (query, document) pairs tokenized together; ``options["token_type_ids"]``
    (one list per input, or none) tells their segments apart for models that read them."""

    kind = "score"

    def add(self, request: EngineRequest, prior_tokens: list[int]) -> None:
        types = request.options.get("token_type_ids")
        if types is not None:
            _check_token_types(types, request.inputs or [], self.runner.token_types)
        super().add(request, prior_tokens)

    def _run(self, batch) -> list:
        inputs, types = [], []
        for item in batch:
            request = self.pending[item.request_id].request
            inputs.append(request.inputs[item.index])
            given = request.options.get("token_type_ids")
            types.append(given[item.index] if given else None)
        return self.runner.score(inputs, types)


def _check_token_types(types, inputs: list[list[int]], token_types: int) -> None:
    if not isinstance(types, list) or len(types) != len(inputs):
        raise RequestError("token_type_ids must hold one list per input")
    for i, (row, ids) in enumerate(zip(types, inputs, strict=True)):
        if not isinstance(row, list) or len(row) != len(ids):
            raise RequestError(f"token_type_ids[{i}] must be as long as input[{i}]")
        limit = max(token_types, 1)
        if any(not isinstance(t, int) or not 0 <= t < limit for t in row):
            raise RequestError(f"token_type_ids[{i}]: type ids must be in [0, {limit})")


def build_score_backend(settings: Settings, tokenizer, config: CrossEncoderConfig):
    """The backend, the model and the longest pair it takes (the model's positions, the
    tokenizer's limit and LLMQ_MAX_MODEL_LEN, whichever is least)."""
    from llmq.worker.loading.cross_encoder import load_cross_encoder
    from llmq.worker.runner.cross_encoder_runner import CrossEncoderRunner

    model = load_cross_encoder(settings.model, settings.dtype, settings.device)
    tokenizer_limit = getattr(tokenizer, "model_max_length", None)
    if tokenizer_limit and tokenizer_limit > 1_000_000:  # transformers' "no limit" value
        tokenizer_limit = None
    limits = [config.max_length, tokenizer_limit, settings.max_model_len]
    max_len = min((x for x in limits if x), default=512)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    backend = ScoreBackend(
        CrossEncoderRunner(model, config, pad),
        settings.max_batch_size,
        settings.max_batch_tokens * 16,
        max_len,
    )
    return backend, model, max_len
