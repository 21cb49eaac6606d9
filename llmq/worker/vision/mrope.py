"""M-RoPE positions (Qwen2.5-VL): each token's (temporal, height, width) position, as
transformers' ``get_rope_index`` numbers a prompt. Text tokens have all three equal; an image
of rows x cols tokens starting at position s gives its token (r, c) the position
(s, s + r, s + c), and the text after it resumes at s + max(rows, cols). Past the last image a
token's position is its index plus the request's ``delta`` (that resumption's shift), so a
decode, a chunk, a recomputed preempted sequence and a prefix-cache hit all number a row from
its index alone and the request's images."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class RopeIndex:
    """A request's positions: ``table`` [3, n] for its first n tokens (to its last image's
    end), index + ``delta`` after them."""

    table: torch.Tensor
    delta: int


def rope_index(spans, grids: list[tuple[int, int]]) -> RopeIndex:
    """The positions of a prompt whose images are ``spans`` (one run each, in order: an image's
    tokens are contiguous) of (rows, cols) ``grids``."""
    if len(spans) != len(grids):
        raise ValueError(f"{len(spans)} image runs for {len(grids)} images")
    parts: list[torch.Tensor] = []
    index = position = 0
    for span, (rows, cols) in zip(spans, grids, strict=True):
        if span.count != rows * cols or span.offset:
            raise ValueError(f"an image run of {span.count} tokens for a {rows} x {cols} grid")
        text = span.start - index
        parts.append(torch.arange(position, position + text).expand(3, -1))
        position += text
        r = torch.arange(rows).repeat_interleave(cols)
        c = torch.arange(cols).repeat(rows)
        parts.append(torch.stack([torch.zeros_like(r), r, c]) + position)
        position += max(rows, cols)
        index = span.start + span.count
    table = torch.cat(parts, dim=1) if parts else torch.zeros(3, 0, dtype=torch.long)
    return RopeIndex(table, position - index)


def step_positions(batch, ropes: dict[str, RopeIndex]) -> torch.Tensor | None:
    """[3, 1, rows] positions of a packed step's rows; None where no row's request has images
    (every row's three positions equal its index)."""
    chunks = [(item, row) for row, item in enumerate(batch.decodes)] + batch.prefills
    found = [(ropes[item.seq.request_id], item, row) for item, row in chunks
             if item.seq.request_id in ropes]  # fmt: skip
    if not found:
        return None
    flat = torch.tensor(batch.positions)
    out = flat.expand(3, -1).clone()
    for rope, item, row in found:
        end = min(row + item.num_new_tokens, len(flat))
        index = flat[row:end]
        n = rope.table.shape[1]
        inside = index < n
        shifted = (index + rope.delta).expand(3, -1)
        if n:
            taken = rope.table[:, index.clamp(max=n - 1)]
            shifted = torch.where(inside, taken, shifted)
        out[:, row:end] = shifted
    return out[:, None, :]
