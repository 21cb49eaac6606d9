"""Runs an encoder over a padded batch and pools it as the model's own pooling config says."""

from __future__ import annotations

import torch

from llmq.worker.loading.model_loader import EmbeddingConfig


def padded_batch(
    inputs: list[list[int]], pad_token_id: int, device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The inputs as one right-padded batch: token ids and the attention mask."""
    longest = max(len(ids) for ids in inputs)
    ids = torch.full((len(inputs), longest), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(inputs), longest), dtype=torch.long)
    for i, row in enumerate(inputs):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
    return ids.to(device), mask.to(device)


class EmbeddingRunner:
    def __init__(self, model, config: EmbeddingConfig, pad_token_id: int):
        self.model = model
        self.config = config
        self.pad_token_id = pad_token_id
        self.device = next(model.parameters()).device
        self.vocab_size = model.config.vocab_size
        self.dimensions = model.config.hidden_size
        self.matryoshka = config.matryoshka

    @torch.inference_mode()
    def embed(self, inputs: list[list[int]]) -> list[torch.Tensor]:
        ids, mask = padded_batch(inputs, self.pad_token_id, self.device)
        hidden = self.model(input_ids=ids, attention_mask=mask).last_hidden_state.float()
        pooled = self._pool(hidden, mask)
        if self.config.normalize:
            pooled = torch.nn.functional.normalize(pooled, p=2, dim=-1)
        return list(pooled.cpu())

    def _pool(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        mode = self.config.pooling
        if mode == "cls":
            return hidden[:, 0]
        if mode == "lasttoken":
            last = mask.sum(dim=1) - 1
            return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
        m = mask.unsqueeze(-1).to(hidden.dtype)
        if mode == "max":
            return hidden.masked_fill(m == 0, float("-inf")).max(dim=1).values
        summed = (hidden * m).sum(dim=1)
        counts = m.sum(dim=1).clamp(min=1)
        if mode == "mean_sqrt_len":
            return summed / counts.sqrt()
        return summed / counts

    def truncate(self, vector: torch.Tensor, dimensions: int) -> torch.Tensor:
        vector = vector[:dimensions]
        if self.config.normalize:
            vector = torch.nn.functional.normalize(vector, p=2, dim=-1)
        return vector
