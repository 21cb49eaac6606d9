"""Tool-call markers that are special tokens come back into the detokenized text where their
token stands, however the tokens are grouped into chunks."""

from __future__ import annotations

import asyncio

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from llmq.common.engine_client.request_stream import GenerationChunk
from llmq.common.engine_client.tokenizer import IncrementalDetokenizer
from llmq.common.serving.marker_tokens import MarkerKeepingStream, skipped_markers

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["[TOOL_CALLS]", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>")


class ChunkList:
    """What a RequestStream yields, from a list (the seam MarkerKeepingStream wraps)."""

    def __init__(self, chunks: list[GenerationChunk]):
        self.chunks = chunks
        self.id = "r"

    async def _gen(self):
        for c in self.chunks:
            yield c

    def __aiter__(self):
        return self._gen()

    async def aclose(self) -> None:
        pass

    def fail(self, error) -> None:
        raise AssertionError(error)


def chunks_of(tokenizer, ids: list[int], size: int) -> list[GenerationChunk]:
    detok = IncrementalDetokenizer(tokenizer)
    out = []
    for k in range(0, len(ids), size):
        part = ids[k : k + size]
        out.append(GenerationChunk(text=detok.add(part), token_ids=part))
    out[-1].text += detok.flush()
    return out


async def joined(stream: MarkerKeepingStream) -> str:
    return "".join([c.text async for c in stream])


def test_markers_are_found_only_when_detokenizing_drops_them(tokenizer):
    found = skipped_markers(tokenizer, ("[TOOL_CALLS]", "<tool_call>"))
    assert list(found.values()) == ["[TOOL_CALLS]"]


def test_marker_tokens_come_back_where_they_stand(tokenizer):
    markers = skipped_markers(tokenizer, ("[TOOL_CALLS]",))
    (marker_id,) = markers
    text_ids = tokenizer.encode("Sure é. ", add_special_tokens=False)
    call_ids = tokenizer.encode('[{"name": "f"}]', add_special_tokens=False)
    eos = tokenizer.eos_token_id
    ids = [*text_ids, marker_id, *call_ids, eos]
    expected = 'Sure é. [TOOL_CALLS][{"name": "f"}]'
    for size in range(1, len(ids) + 1):
        stream = MarkerKeepingStream(ChunkList(chunks_of(tokenizer, ids, size)), tokenizer, markers)

        assert asyncio.run(joined(stream)) == expected, size
