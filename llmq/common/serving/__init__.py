"""The generation service: OpenAI-compatible requests (chat, completions, embeddings, the model
list) answered through the pipeline, with no HTTP in it."""

from llmq.common.serving.metrics import GenerationMetrics
from llmq.common.serving.run import Generation
from llmq.common.serving.service import ENDPOINT_BODIES, GenerationService
from llmq.common.serving.submission import SubmitOptions

__all__ = [
    "ENDPOINT_BODIES",
    "Generation",
    "GenerationMetrics",
    "GenerationService",
    "SubmitOptions",
]
