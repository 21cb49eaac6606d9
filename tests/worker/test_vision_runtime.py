"""The vision runtime's bookkeeping (llmq/worker/vision/runtime.py), with an in-memory encoder
standing for the tower: a prompt's image runs checked against its images, the packed rows of
a step's image tokens (decodes and prefill chunks, a chunk cut inside an image), each image
encoded once and kept, read again from Redis's stand-in once dropped, and the prefix-cache
root that keeps different images apart."""

from __future__ import annotations

import pytest
import torch

from llmq.worker.engine.scheduler import ScheduledSequence
from llmq.worker.engine.sequence import Sequence
from llmq.worker.request_error import RequestError
from llmq.worker.runner.packed_batch import pack_step
from llmq.worker.vision import runtime
from llmq.worker.vision.runtime import VisionRuntime, image_salts, image_spans

pytestmark = pytest.mark.unit
IMG = 9  # the image token


class Encoder:
    """Each image's "embeddings": rows of its first byte, as many as its second byte says."""

    image_token_id = IMG

    def __init__(self):
        self.calls: list[int] = []

    def token_count(self, data: bytes) -> int:
        return data[1]

    def encode(self, images: list[bytes]) -> list[torch.Tensor]:
        self.calls.append(len(images))
        return [torch.full((d[1], 2), float(d[0])) for d in images]


def test_spans_follow_the_runs_and_refuse_a_mismatch():
    prompt = [1, IMG, IMG, 2, IMG, IMG, IMG, 3]
    spans = image_spans(prompt, IMG, ["a", "b"], [2, 3])
    assert [(s.digest, s.start, s.count) for s in spans] == [("a", 1, 2), ("b", 4, 3)]
    with pytest.raises(RequestError, match="do not fit"):
        image_spans(prompt, IMG, ["a", "b"], [2, 2])
    # Tiles tagged in the prompt: one image's tokens in several runs, two images back to back.
    tiles = [IMG, 1, IMG, IMG, 2, IMG, IMG]
    spans = image_spans(tiles, IMG, ["a", "b"], [4, 1])
    assert [(s.digest, s.start, s.count, s.offset) for s in spans] == [
        ("a", 0, 1, 0), ("a", 2, 2, 1), ("a", 5, 1, 3), ("b", 6, 1, 0)
    ]  # fmt: skip
    with pytest.raises(RequestError):
        image_spans(prompt, IMG, ["a"], [2])


def test_blocks_holding_image_tokens_are_keyed_by_the_images():
    from llmq.common.placement.block_hashes import chain_hashes

    def chain(prompt, digests, counts):
        spans = image_spans(prompt, IMG, digests, counts)
        return chain_hashes(prompt, 4, len(prompt) // 4, salts=image_salts(spans, 4))

    text = [1, 2, 3, 4, 5, 6, 7, 8]
    prompt = text + [IMG] * 6 + [3, 3]  # blocks 0-1 text, 2-3 the image
    a, b = chain(prompt, ["a"], [6]), chain(prompt, ["b"], [6])
    assert a[:2] == b[:2] == chain_hashes(text, 4, 2)  # the text before is shared
    assert a[2] != b[2] and a[3] != b[3]
    assert chain(prompt, ["a"], [6]) == a  # the same image keys alike
    # Two images, and the same two the other way round.
    two = text + [IMG] * 4 + [IMG] * 4
    assert chain(two, ["a", "b"], [4, 4]) != chain(two, ["b", "a"], [4, 4])


def _scheduled(request_id: str, prompt: list[int], start: int, n: int) -> ScheduledSequence:
    seq = Sequence(request_id, prompt)
    seq.block_table = list(range(8))
    return ScheduledSequence(seq, start, n)


def test_rows_map_a_steps_image_tokens_and_each_image_is_encoded_once(monkeypatch):
    store = {"a": bytes([1, 2]), "b": bytes([2, 3])}
    fetched: list[str] = []

    def fetch(d):
        fetched.append(d)
        return store.get(d)

    enc = Encoder()
    vision = VisionRuntime(enc, fetch)
    p1, p2 = [5, IMG, IMG, 6, 7], [5, IMG, IMG, IMG, 6]
    vision.register("r1", p1, ["a"])
    vision.register("r2", p2, ["b"])
    # r1 whole; r2's chunk stops inside its image (positions 0..2).
    batch = pack_step([_scheduled("r1", p1, 0, 5), _scheduled("r2", p2, 0, 3)], 4, 99)
    rows = vision.rows(batch)
    assert rows == [(1, "a", 0), (2, "a", 1), (6, "b", 0), (7, "b", 1)]
    feats = vision.embeddings({d for _, d, _ in rows})
    assert enc.calls == [2] and vision.images_encoded == 2  # one tower call for both
    assert feats["b"].shape == (3, 2) and float(feats["b"][0, 0]) == 2.0
    # The rest of r2's image, next step (a one-token chunk packs as a decode).
    rest = vision.rows(pack_step([_scheduled("r2", p2, 3, 1)], 4, 99))
    assert rest == [(0, "b", 2)]
    vision.embeddings({"b"})
    assert vision.images_encoded == 2  # kept: not again
    # Dropped past the kept limit, an image is read again and encoded again.
    monkeypatch.setattr(runtime, "KEPT_IMAGES", 1)
    vision.drop("r1")
    vision.drop("r2")
    vision.embeddings({"b"})
    assert "a" not in vision.kept
    vision.register("r3", p1, ["a"])
    vision.embeddings({"a"})
    assert vision.images_encoded == 3 and fetched.count("a") == 2


def test_an_image_gone_from_redis_fails_its_request():
    vision = VisionRuntime(Encoder(), lambda d: None)
    with pytest.raises(RequestError, match="expired"):
        vision.register("r", [IMG, IMG], ["a"])


def test_a_request_entry_with_malformed_images_fails_alone():
    from llmq.common.protocol import EngineRequest

    good = EngineRequest("r", [1, IMG], images=["ab" * 32])
    assert EngineRequest.from_json(good.to_json()).images == ["ab" * 32]
    for bad in ('"ab"', "[1, 2]", "{}"):
        raw = good.to_json().replace(f'"images":["{"ab" * 32}"]', f'"images":{bad}')
        with pytest.raises(ValueError, match="images must be"):
            EngineRequest.from_json(raw)
