"""Scores of (query, document) pairs, and the answers of /v1/rerank and /v1/score built on them.

A cross-encoder worker (kind "score") reads each pair as one input: the pair is tokenized here
with the tokenizer's pair template, cut to the model's limit, and sent as one score request.
An embedding model's score is the cosine of the two texts' embeddings, as vLLM gives it: each
distinct text embedded once, in one embedding request."""

from __future__ import annotations

import asyncio
import base64
import time

import numpy as np

from llmq.common.engine_client.model_registry import ModelRegistry
from llmq.common.engine_client.pipeline import TokenGeneratorPipeline
from llmq.common.engine_status import EngineStatus
from llmq.common.errors import InvalidRequest
from llmq.common.ids import new_id
from llmq.common.serving.embeddings import embed
from llmq.common.serving.request_bodies import EmbeddingRequest
from llmq.common.serving.rerank.answers import (
    RerankDocumentText,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreResponse,
    ScoreUsage,
)
from llmq.common.serving.rerank.bodies import RerankRequest, ScoreRequest
from llmq.common.serving.rerank.pairs import encode_pairs
from llmq.common.serving.submission import SubmitOptions

_SCORING_KINDS = ("score", "embed")


async def _scoring_model(
    registry: ModelRegistry, model: str | None
) -> tuple[TokenGeneratorPipeline, EngineStatus]:
    try:
        return await registry.get(model, kind=_SCORING_KINDS)
    except InvalidRequest as exc:
        if exc.code != "wrong_model_kind":
            raise
        name = model or await registry.default_model()
        raise InvalidRequest(
            f"{name!r} is a generation model: rerank and score need a cross-encoder (a "
            "sequence-classification model of one label) or an embedding model",
            "model",
            "wrong_model_kind",
        ) from None


def _pair_limit(truncate: int | None, limit: int) -> int:
    """The tokens a pair is cut to: the model's limit, or fewer where the request asks."""
    if truncate == 0:
        raise InvalidRequest(
            "truncate_prompt_tokens must be positive (or -1 for the model's limit)",
            "truncate_prompt_tokens",
        )
    if truncate is None or truncate == -1:
        return limit
    return min(truncate, limit)


def _floats(vector: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(vector), dtype="<f4").astype(np.float64)


async def _cross_encoder_scores(
    pipeline: TokenGeneratorPipeline,
    engine: EngineStatus,
    pairs: list[tuple[str, str]],
    truncate: int | None,
    options: SubmitOptions,
) -> tuple[list[float], int]:
    max_length = _pair_limit(truncate, engine.max_model_len)
    ids, types = await asyncio.to_thread(encode_pairs, pipeline.tokenizer, pairs, max_length)
    result = await pipeline.embed(
        ids,
        request_id=options.request_id(0),
        priority=options.priority,
        attach=options.attach,
        kind="score",
        options={"token_type_ids": types} if types else None,
    )
    return [float(_floats(v)[0]) for v in result.vectors], result.prompt_tokens


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    norms = float(np.linalg.norm(a) * np.linalg.norm(b))
    return float(a @ b) / norms if norms else 0.0


async def _cosine_scores(
    pipeline: TokenGeneratorPipeline,
    engine: EngineStatus,
    pairs: list[tuple[str, str]],
    truncate: int | None,
    options: SubmitOptions,
) -> tuple[list[float], int]:
    texts = list(dict.fromkeys(t for pair in pairs for t in pair))
    body = EmbeddingRequest(
        input=texts,
        model=pipeline.model,
        encoding_format="base64",
        truncate_prompt_tokens=-1 if truncate is None else truncate,
    )
    listing = await embed(pipeline, engine, body, list(texts), options)
    vectors = {t: _floats(d.embedding) for t, d in zip(texts, listing.data, strict=True)}
    return [_cosine(vectors[a], vectors[b]) for a, b in pairs], listing.usage.prompt_tokens


async def pair_scores(
    registry: ModelRegistry,
    model: str | None,
    pairs: list[tuple[str, str]],
    truncate: int | None,
    options: SubmitOptions,
) -> tuple[list[float], int, str]:
    """Each pair's score, the tokens read and the model's name."""
    pipeline, engine = await _scoring_model(registry, model)
    run = _cross_encoder_scores if engine.kind == "score" else _cosine_scores
    scores, tokens = await run(pipeline, engine, pairs, truncate, options)
    return scores, tokens, pipeline.model


async def rerank(
    registry: ModelRegistry, body: RerankRequest, options: SubmitOptions
) -> RerankResponse:
    """The documents by relevance to the query, best first (the first n with ``top_n``)."""
    texts = body.texts()
    pairs = [(body.query, text) for text in texts]
    scores, tokens, name = await pair_scores(
        registry, body.model, pairs, body.truncate_prompt_tokens, options
    )
    order = sorted(range(len(texts)), key=lambda i: -scores[i])  # stable: ties by position
    if body.top_n:
        order = order[: body.top_n]
    results = [
        RerankResult(
            index=i,
            relevance_score=scores[i],
            document=RerankDocumentText(text=texts[i]) if body.return_documents else None,
        )
        for i in order
    ]
    usage = RerankUsage(prompt_tokens=tokens, total_tokens=tokens)
    return RerankResponse(id=new_id("rerank"), model=name, results=results, usage=usage)


async def score(
    registry: ModelRegistry, body: ScoreRequest, options: SubmitOptions
) -> ScoreResponse:
    """Each pair's score, in the pairs' order."""
    pairs = body.pairs()
    scores, tokens, name = await pair_scores(
        registry, body.model, pairs, body.truncate_prompt_tokens, options
    )
    return ScoreResponse(
        id=new_id("score"),
        created=int(time.time()),
        model=name,
        data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)],
        usage=ScoreUsage(prompt_tokens=tokens, total_tokens=tokens),
    )
