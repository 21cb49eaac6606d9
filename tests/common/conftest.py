"""Real tokenizers for the reasoning tests: a byte-level BPE one, and a copy with <think> and
</think> as added tokens of their own (as reasoning models have them)."""

from __future__ import annotations

import copy

import pytest

from llmq.common.serving.reasoning import FORMATS

THINK = FORMATS["qwen3"]


@pytest.fixture(scope="session")
def plain():
    """A byte-level BPE tokenizer trained on a line (the test models' take seconds)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(["some thinking, then the answer"] * 8, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False)


@pytest.fixture(scope="session")
def tagged(plain):
    tokenizer = copy.deepcopy(plain)
    tokenizer.add_tokens([THINK.start, THINK.end], special_tokens=False)
    return tokenizer
