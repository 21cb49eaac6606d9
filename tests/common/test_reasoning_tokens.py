"""Reasoning tokens and the prompt's open think block, on a real tokenizer: </think> as one
added token (as reasoning models have it) and as several ordinary ones."""

from __future__ import annotations

import pytest

from llmq.common.serving.reasoning import FORMATS, prompt_opens_block, reasoning_tokens

pytestmark = pytest.mark.unit

THINK = FORMATS["qwen3"]


@pytest.mark.parametrize("which", ["plain", "tagged"])
def test_reasoning_tokens_run_to_the_closing_tag(request, which):
    tok = request.getfixturevalue(which)
    before = tok.encode("some thinking", add_special_tokens=False)
    tag = tok.encode(THINK.end, add_special_tokens=False)
    after = tok.encode("\n\nthe answer", add_special_tokens=False)
    assert (len(tag) == 1) == (which == "tagged")
    ids = before + tag + after
    assert reasoning_tokens(tok, THINK, ids) == len(before) + len(tag)
    assert reasoning_tokens(tok, THINK, before) == len(before)  # never closed: all of it


@pytest.mark.parametrize("which", ["plain", "tagged"])
def test_prompt_opens_the_block(request, which):
    tok = request.getfixturevalue(which)

    def opens(text: str) -> bool:
        return prompt_opens_block(tok, THINK, tok.encode(text, add_special_tokens=False))

    assert opens("<|im_start|>assistant\n<think>\n")
    assert not opens("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not opens("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert opens("<think>a</think> then <think>\n")
