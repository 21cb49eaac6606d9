"""Runs a cross-encoder over a padded batch of (query, document) pairs: one score per pair, the
classifier's logit through the model's activation."""

from __future__ import annotations

import torch

from llmq.worker.loading.cross_encoder import CrossEncoderConfig
from llmq.worker.runner.embedding_runner import padded_batch


class CrossEncoderRunner:
    def __init__(self, model, config: CrossEncoderConfig, pad_token_id: int):
        self.model = model
        self.config = config
        self.pad_token_id = pad_token_id
        self.device = next(model.parameters()).device
        self.vocab_size = model.config.vocab_size
        # BERT-like models tell the query from the document by token type (segment) ids too;
        # models of one type (XLM-RoBERTa, ModernBERT) by the separator alone.
        self.token_types = int(getattr(model.config, "type_vocab_size", 0) or 0)
        # What the embeddings backend reports of its vectors: a score is a vector of one.
        self.dimensions = 1
        self.matryoshka = False

    @torch.inference_mode()
    def score(
        self, inputs: list[list[int]], token_type_ids: list[list[int] | None]
    ) -> list[torch.Tensor]:
        ids, mask = padded_batch(inputs, self.pad_token_id, self.device)
        extra = {}
        if self.token_types > 1 and any(types for types in token_type_ids):
            types = torch.zeros_like(ids)
            for i, row in enumerate(token_type_ids):
                if row:
                    types[i, : len(row)] = torch.tensor(row)
            extra["token_type_ids"] = types
        logits = self.model(input_ids=ids, attention_mask=mask, **extra).logits.float()
        scores = torch.sigmoid(logits) if self.config.activation == "sigmoid" else logits
        return list(scores[:, :1].cpu())
