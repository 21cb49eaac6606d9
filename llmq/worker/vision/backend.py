"""The generation backend of a vision-language model: a request's images registered with the
runner's vision runtime as it arrives (its blocks holding image tokens keyed by the images'
hashes in the prefix cache), dropped when it ends; the heartbeat says the model takes images, how many tokens an image is, and how
many images were encoded."""

from __future__ import annotations

import json

from llmq.common.protocol import EngineRequest, OutputMessage
from llmq.worker.backends import GenerationBackend
from llmq.worker.vision.gemma3 import bidirectional_runs
from llmq.worker.vision.runtime import ImageSpan, VisionRuntime, image_salts


class VisionBackend(GenerationBackend):
    def __init__(self, engine, vision: VisionRuntime):
        super().__init__(engine)
        self.vision = vision
        engine.runner.vision = vision

    def add(self, request: EngineRequest, prior_tokens: list[int]) -> None:
        if not request.images:
            return super().add(request, prior_tokens)
        spans = self.vision.register(request.id, request.prompt_token_ids, request.images)
        try:
            runs = self._bidirectional(spans)
            super().add(request, prior_tokens)
        except BaseException:
            self.vision.drop(request.id)
            raise
        seq = self.engine.requests[request.id]
        seq.hash_salts = image_salts(spans, self.engine.block_manager.block_size)
        seq.bidirectional = runs

    def _bidirectional(self, spans: list[ImageSpan]) -> list[tuple[int, int]]:
        """The runs of image tokens that attend to each other both ways (Gemma 3's)."""
        if not getattr(self.vision.encoder, "bidirectional", False):
            return []
        return bidirectional_runs(spans, self.engine.scheduler.max_batch_tokens)

    def abort(self, request_id: str) -> OutputMessage | None:
        self.vision.drop(request_id)
        return super().abort(request_id)

    def take(self, request_id: str) -> list[int] | None:
        self.vision.drop(request_id)
        return super().take(request_id)

    def step(self) -> list[tuple[str, OutputMessage]]:
        out = super().step()
        for request_id, message in out:
            if message.done:
                self.vision.drop(request_id)
        return out

    def stats(self) -> dict:
        enc = self.vision.encoder
        return {
            **super().stats(),
            "images": True,
            "image_token_id": enc.image_token_id,
            "image_layout": json.dumps(enc.layout, separators=(",", ":")),
            "images_encoded": self.vision.images_encoded,
        }
