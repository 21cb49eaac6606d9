"""Constrained decoding's allowed tokens, applied to a step's logits. Pure torch and numpy: the
grammar engine that fills the bitmask lives in ``llmq.worker.grammar_*``.

The bitmask has one bit per token (int32 words, bit t % 32 of word t // 32, llguidance's
layout). It becomes an additive mask, 0 where allowed and -inf elsewhere, through a table of the
8 floats each byte spells: a byte-wise table lookup then an add, several times faster on the
CPU than masked_fill with a bool mask (docs/performance.md, "Choices: serving"); on CUDA the
same lookup runs on the device from the bitmask.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(slots=True)
class TokenMask:
    """The allowed tokens of some of a step's rows: ``bitmask[i]`` for logits row ``rows[i]``."""

    rows: list[int]
    bitmask: np.ndarray  # int32 [len(rows), words], words * 32 >= the logits' width


def _byte_table() -> np.ndarray:
    """[256, 8] float32: for each byte value, 0.0 where its bit k is set and -inf where not."""
    bits = (np.arange(256)[:, None] >> np.arange(8)[None, :]) & 1
    return np.where(bits == 1, np.float32(0.0), np.float32(-np.inf)).astype(np.float32)


_TABLE = _byte_table()
_DEVICE_TABLES: dict[torch.device, torch.Tensor] = {}


def additive_mask(mask: TokenMask, width: int, device: torch.device) -> torch.Tensor:
    """float32 [len(rows), width] on ``device``: 0.0 for allowed tokens, -inf for the others."""
    n = len(mask.rows)
    as_bytes = np.ascontiguousarray(mask.bitmask).view(np.uint8)
    if device.type == "cpu":
        return torch.from_numpy(np.take(_TABLE, as_bytes, axis=0)).view(n, -1)[:, :width]
    table = _DEVICE_TABLES.get(device)
    if table is None:
        table = _DEVICE_TABLES[device] = torch.from_numpy(_TABLE).to(device)
    idx = torch.from_numpy(as_bytes).to(device, non_blocking=True).long()
    return table[idx].view(n, -1)[:, :width]


def apply_token_mask(logits: torch.Tensor, mask: TokenMask) -> None:
    """Set the forbidden tokens of the masked rows to -inf, in place (x + 0.0 leaves an allowed
    logit exactly as it was)."""
    add = additive_mask(mask, logits.shape[-1], logits.device)
    if len(mask.rows) == logits.shape[0] and mask.rows == list(range(logits.shape[0])):
        logits += add
        return
    rows = torch.tensor(mask.rows, device=logits.device)
    logits.index_add_(0, rows, add)
