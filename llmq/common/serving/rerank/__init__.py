"""/v1/rerank and /v1/score: (query, document) pairs scored by a cross-encoder worker, or by the
cosine of their embeddings where the model is an embedding model."""

from llmq.common.serving.rerank.answers import RerankResponse, ScoreResponse
from llmq.common.serving.rerank.bodies import RerankRequest, ScoreRequest
from llmq.common.serving.rerank.run import rerank, score

__all__ = ["RerankRequest", "RerankResponse", "ScoreRequest", "ScoreResponse", "rerank", "score"]
