"""Answers of /v1/rerank and /v1/score, typed: vLLM's fields (Jina's and Cohere's for rerank)."""

from __future__ import annotations

from llmq.common.serving.responses import WireModel


class RerankDocumentText(WireModel):
    text: str


class RerankResult(WireModel):
    omit_if_none = frozenset({"document"})

    index: int  # the document's place in the request
    relevance_score: float
    document: RerankDocumentText | None = None  # only with return_documents


class RerankUsage(WireModel):
    prompt_tokens: int
    total_tokens: int


class RerankResponse(WireModel):
    id: str
    model: str
    results: list[RerankResult]  # best first
    usage: RerankUsage


class ScoreData(WireModel):
    index: int  # the pair's place in the request
    object: str = "score"
    score: float


class ScoreUsage(WireModel):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0


class ScoreResponse(WireModel):
    id: str
    object: str = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: ScoreUsage
