"""Image embeddings placed at a step's image-token rows.

A request's images are registered when it arrives: its prompt's runs of the image token, one
per image in order, each of the family's token count, with the image's content hash; the
bytes are read from Redis then (where the API stored them once). An image is encoded only when
a step computes one of its rows, all of a step's images in one batched tower call, and its
embeddings are kept (a few, least recently used dropped) so that the same image in a later
turn, or a request preempted and computed again, is not encoded again. Rows whose KV the
prefix cache holds are never computed, so an image found there is never encoded."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from llmq.worker.request_error import RequestError
from llmq.worker.vision.mrope import RopeIndex, rope_index, step_positions

# Images whose embeddings are kept after their step.
KEPT_IMAGES = 64


@dataclass(frozen=True, slots=True)
class ImageSpan:
    """A run of an image's tokens in the prompt: its embeddings from ``offset`` on."""

    digest: str
    start: int  # the prompt position of its first token
    count: int
    offset: int = 0


def image_spans(
    prompt: list[int], token: int, digests: list[str], counts: list[int]
) -> list[ImageSpan]:
    """The prompt's runs of ``token``, the images' tokens in order (``counts`` each; a family
    whose prompt tags tiles gives an image several runs)."""
    positions = [p for p, t in enumerate(prompt) if t == token]
    if len(positions) != sum(counts) or len(counts) != len(digests):
        raise RequestError(
            f"the prompt's {len(positions)} image tokens do not fit its {len(digests)} images "
            f"({counts} tokens)"
        )
    spans: list[ImageSpan] = []
    i = 0
    for digest, count in zip(digests, counts, strict=True):
        for offset in range(count):
            p = positions[i + offset]
            last = spans[-1] if spans else None
            if offset and last.start + last.count == p:
                spans[-1] = ImageSpan(digest, last.start, last.count + 1, last.offset)
            else:
                spans.append(ImageSpan(digest, p, 1, offset))
        i += count
    return spans


def image_salts(spans: list[ImageSpan], block_size: int) -> dict[int, int]:
    """Block index -> a key of the image tokens it holds (each image's hash and where in the
    image they start), so that two different images never share a block while the text
    before them does; the same images in the same places key alike in every process."""
    parts: dict[int, list[str]] = {}
    for span in spans:
        for block in range(
            span.start // block_size, (span.start + span.count - 1) // block_size + 1
        ):
            first = max(span.start, block * block_size) - span.start + span.offset
            parts.setdefault(block, []).append(f"{span.digest}:{first}")
    return {
        block: int.from_bytes(
            hashlib.blake2b("|".join(keys).encode(), digest_size=8).digest(), "little", signed=True
        )
        for block, keys in parts.items()
    }


class VisionRuntime:
    def __init__(self, encoder, fetch: Callable[[str], bytes | None]):
        self.encoder = encoder
        self.fetch = fetch
        self.spans: dict[str, list[ImageSpan]] = {}
        self.pending: dict[str, bytes] = {}  # digest -> bytes not yet encoded
        self.kept: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.images_encoded = 0
        # Per request, its M-RoPE positions (an encoder with ``mrope``: Qwen2.5-VL).
        self.ropes: dict[str, RopeIndex] = {}

    def register(self, request_id: str, prompt: list[int], digests: list[str]) -> list[ImageSpan]:
        enc = self.encoder
        counts = []
        for d in digests:
            if d not in self.pending:
                self.pending[d] = self._bytes(d)
            counts.append(enc.token_count(self.pending[d]))
        spans = image_spans(prompt, enc.image_token_id, digests, counts)
        if getattr(enc, "mrope", False):
            grids = [enc.grid(self.pending[d]) for d in digests]
            self.ropes[request_id] = rope_index(spans, grids)
        self.spans[request_id] = spans
        return spans

    def drop(self, request_id: str) -> None:
        """Forget a request that ended; bytes no other request waits for go with it."""
        self.ropes.pop(request_id, None)
        if self.spans.pop(request_id, None) is None:
            return
        waiting = {s.digest for spans in self.spans.values() for s in spans}
        self.pending = {d: data for d, data in self.pending.items() if d in waiting}

    def rows(self, batch) -> list[tuple[int, str, int]]:
        """(packed row, image digest, index of the image's token) of the step's image rows."""
        if not self.spans:
            return []
        found = []
        chunks = [(item, row) for row, item in enumerate(batch.decodes)] + batch.prefills
        for item, row in chunks:
            spans = self.spans.get(item.seq.request_id)
            for span in spans or ():
                lo = max(span.start, item.start)
                hi = min(span.start + span.count, item.start + item.num_new_tokens)
                found += [
                    (row + p - item.start, span.digest, span.offset + p - span.start)
                    for p in range(lo, hi)
                ]
        return found

    def embeddings(self, digests: set[str]) -> dict[str, torch.Tensor]:
        """Each image's embeddings: kept ones as they are, the others encoded in one call."""
        missing = [d for d in digests if d not in self.kept]
        if missing:
            encoded = self.encoder.encode([self._bytes(d) for d in missing])
            self.kept.update(zip(missing, encoded, strict=True))
            self.images_encoded += len(missing)
        out = {}
        for d in digests:
            self.kept.move_to_end(d)
            out[d] = self.kept[d]
        while len(self.kept) > KEPT_IMAGES:
            self.kept.popitem(last=False)
        return out

    def _bytes(self, digest: str) -> bytes:
        data = self.pending.pop(digest, None) or self.fetch(digest)
        if data is None:
            raise RequestError(f"image {digest[:12]}... expired before its request ran")
        return data

    def positions(self, batch) -> torch.Tensor | None:
        """The step's rows' M-RoPE positions [3, 1, rows]; None: their indices serve."""
        return step_positions(batch, self.ropes) if self.ropes else None

    def forward(self, model, batch, rows, keep_rows: torch.Tensor, meta, fast=None) -> torch.Tensor:
        """The step's logits, the image rows' embeddings replaced by the images': through
        llmq's forward ``fast`` where the runner has one (its packed weights are the only
        copy), else transformers' (llmq's paged attention)."""
        dev = keep_rows.device
        ids = torch.tensor(batch.input_ids, device=dev)
        embeds = model.get_input_embeddings()(ids)
        feats = self.embeddings({d for _, d, _ in rows})
        index = torch.tensor([r for r, _, _ in rows], device=dev)
        embeds[index] = torch.stack([feats[d][i] for _, d, i in rows]).to(embeds.dtype)
        positions = self.positions(batch)
        if fast is not None:
            rows_at = torch.tensor(batch.positions) if positions is None else positions[:, 0]
            return fast(ids, rows_at.to(dev), keep_rows, meta, embeds)
        if positions is None:
            positions = torch.tensor([batch.positions])
        return model(
            inputs_embeds=embeds[None],
            position_ids=positions.to(dev),
            use_cache=False,
            logits_to_keep=keep_rows,
            llmq_step=meta,
        ).logits[0]
