"""The reasoning split on text: whole, and streamed with the text cut at every position (tags
split across chunks), which must give the same parts."""

from __future__ import annotations

import pytest

from llmq.common.errors import InvalidRequest
from llmq.common.serving.reasoning import (
    FORMATS,
    ReasoningSplitter,
    choose_reasoning,
    reasoning_template_kwargs,
    split_reasoning,
)

pytestmark = pytest.mark.unit

THINK = FORMATS["deepseek_r1"]

# (output, prompt opened the block, reasoning, content)
CASES = [
    ("let me see\n</think>\n\nThe answer is 4.", True, "let me see\n", "\n\nThe answer is 4."),
    ("<think>hmm</think>Four.", False, "hmm", "Four."),
    ("\n <think>\nhmm\n</think>\nFour.", False, "\nhmm\n", "\nFour."),
    ("no thinking here", False, None, "no thinking here"),
    ("a < b and </thin", False, None, "a < b and </thin"),
    ("still thinking, cut by max_tokens", True, "still thinking, cut by max_tokens", ""),
    ("thinking </thi", True, "thinking </thi", ""),
    ("</think>", True, "", ""),
    ("<think>", False, "", ""),
    ("<thi", False, None, "<thi"),
    ("  ", False, None, "  "),
    ("x</think>y</think>z", True, "x", "y</think>z"),
    ("Four.<think>later</think>", False, None, "Four.<think>later</think>"),
]


@pytest.mark.parametrize(("text", "inside", "reasoning", "content"), CASES)
def test_whole_output(text, inside, reasoning, content):
    assert split_reasoning(THINK, inside, text) == (reasoning, content)


def streamed(text: str, inside: bool, cuts: list[int]) -> tuple[str, str, list[str]]:
    splitter = ReasoningSplitter(THINK, inside)
    reasoning, content, pieces = "", "", []
    bounds = [0, *cuts, len(text)]
    for a, b in zip(bounds, bounds[1:], strict=False):
        r, c = splitter.feed(text[a:b])
        reasoning, content = reasoning + r, content + c
        pieces += [r, c]
    r, c = splitter.finish()
    return reasoning + r, content + c, pieces


@pytest.mark.parametrize(("text", "inside", "reasoning", "content"), CASES)
def test_streamed_split_at_every_position(text, inside, reasoning, content):
    for cut in range(len(text) + 1):
        got = streamed(text, inside, [cut])[:2]
        assert got == (reasoning or "", content), cut
    for cut in range(1, len(text)):  # every pair of cuts
        for second in range(cut, len(text)):
            assert streamed(text, inside, [cut, second])[:2] == (reasoning or "", content)


def test_streamed_one_character_at_a_time_never_shows_a_tag():
    text = "<think>a</think>b"
    got = streamed(text, False, list(range(1, len(text))))
    assert got[:2] == ("a", "b")
    assert not any("<" in p for p in got[2])


def test_reasoning_is_passed_on_as_it_comes():
    splitter = ReasoningSplitter(THINK, True)
    assert splitter.feed("step one, ") == ("step one, ", "")
    assert splitter.feed("step two </") == ("step two ", "")  # "</" may open the closing tag
    assert splitter.feed("think>Done") == ("", "Done")
    assert splitter.feed(" here") == ("", " here")


def test_parser_chosen_by_setting_or_template():
    assert choose_reasoning(None, "{{ '<think>' }}...{{ '</think>' }}") is THINK
    assert choose_reasoning(None, "<|im_start|>assistant") is None
    assert choose_reasoning(None, None) is None
    assert choose_reasoning("none", "</think>") is None
    assert choose_reasoning("qwen3", None) is FORMATS["qwen3"]


def test_reasoning_effort_only_where_the_template_reads_it():
    assert reasoning_template_kwargs(None, "no knob") == {}
    knob = "{% if reasoning_effort %}Effort: {{ reasoning_effort }}{% endif %}"
    assert reasoning_template_kwargs("low", knob) == {"reasoning_effort": "low"}
    for template in ("no knob", None):
        with pytest.raises(InvalidRequest) as err:
            reasoning_template_kwargs("high", template)
        assert err.value.param == "reasoning_effort" and err.value.status == 400
