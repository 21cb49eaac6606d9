"""The generation service: OpenAI-compatible requests (chat, completions, embeddings, the model
list) answered through the pipeline, with no HTTP in it."""

from llmq.common.generation.metrics import GenerationMetrics
from llmq.common.generation.run import Generation
from llmq.common.generation.service import ENDPOINT_BODIES, GenerationService
from llmq.common.generation.submission import SubmitOptions

__all__ = [
    "ENDPOINT_BODIES",
    "Generation",
    "GenerationMetrics",
    "GenerationService",
    "SubmitOptions",
]
